"""cotrain's own math on tensors, torch only (tests/unit/test_core_layout.py forbids importing hivemind
here): each part is testable in one process.

- ``aggregation``: how a reducer combines the group's copies of a part (``Aggregation``: mean,
  CenteredClip), chosen by name (cotrain.registry);
- ``codecs``: how a part travels (``Codec``: none, fp16, 8-bit, top-k records), chosen by name, with the
  bytes each value costs;
- ``sparse``: top-k records of a pseudo-gradient and their error feedback;
- ``lineage``: DiLoCo's lineages, which decide when a round also averages the outer state;
- ``fingerprint``: fingerprints of a training state and the verdicts on a downloaded one;
- ``donors``: which peer a newcomer downloads the state from; ``statelimit``: how large that state may be.
"""

__all__ = ["aggregation", "codecs", "donors", "fingerprint", "lineage", "sparse", "statelimit"]
