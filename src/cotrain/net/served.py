"""Which peers serve a run's training state for download, and at which global step."""

from __future__ import annotations

import hivemind

from cotrain.keys import served_state_key


def served_epochs(dht: hivemind.DHT, run_id: str) -> dict[bytes, float]:
    """Peers that declare they serve the run's state, with their priority (their global step)."""
    found = dht.get(served_state_key(run_id), latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    out = {}
    for peer, item in found.value.items():
        value = getattr(item, "value", None)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[peer] = float(value)
    return out
