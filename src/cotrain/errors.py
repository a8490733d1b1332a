"""The one exception type for problems a user causes and can fix; the CLI prints its message as one line."""


class UserError(Exception):
    pass
