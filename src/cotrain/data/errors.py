"""The one exception type of the data layer."""

from __future__ import annotations

from cotrain.errors import UserError


class DataError(UserError):
    """A problem the user can fix: a missing or empty corpus, an unusable tokenizer, a missing or
    incomplete prepared dataset. The message is one line and says what to do; the CLI prints it
    without a traceback (it is a ``cotrain.errors.UserError``)."""
