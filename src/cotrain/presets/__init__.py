"""Shipped TOML run configs (read with importlib.resources)."""
