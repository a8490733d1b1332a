"""The monitor's live web dashboard: a page (its JS and CSS ship in ``static/``) polling ``/api/state``."""

__all__ = ["server", "view"]
