"""Shipped TOML run configs (read with importlib.resources)."""

__all__: list[str] = []
