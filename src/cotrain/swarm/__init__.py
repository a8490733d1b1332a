"""The swarm layer: hivemind's DHT, averaging and optimizer as cotrain's peers use them."""

from cotrain.swarm import fixes as _fixes  # noqa: F401  (hivemind corrections, applied on import)
