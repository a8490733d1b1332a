"""How a part of an all-reduce travels: a ``Codec``, chosen by name (cotrain.registry). A codec says what it
is, what a value costs on the wire and which parameters it takes; what actually compresses is built from it
on first use (``builds``: a callable or its "module:attr" path, called with the codec's settled
parameters), so that reading a codec, as a run's config does to check its choices, imports neither torch nor
hivemind.

Two kinds:

- ``dense``: each tensor compressed on its own, the builder a hivemind compression (``--grad-compression``:
  ``none``, ``fp16``, ``8bit``). A receiver decodes whatever a sender's compression wrote (hivemind's tensor
  format names it), so peers with different dense codecs average together: a peer's own choice.
- ``records``: DiLoCo's rounds as fixed-size records that the reducers decode, average and encode again
  (``--outer-compression topk``: cotrain.algorithms.sparse); swarm-wide, the builder an object with
  ``encode``, ``decode``, ``add_decoded``, ``encoded_size``, ``record``, ``largest`` and ``problem`` like
  ``sparse.TopK``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cotrain.algorithms.parameters import Parameter, settle

__all__ = ["BITS_8", "Codec", "FP16", "KINDS", "NONE", "TOPK", "TOPK_BITS", "resolve"]

KINDS = ("dense", "records")
TOPK_BITS = (
    2,
    4,
    8,
)  # the bits per value topk can send (cotrain.algorithms.sparse.BITS, which tests compare)


def resolve(target: Callable[..., Any] | str) -> Callable[..., Any]:
    """A callable, or the one a "module:attr" path names (its module imported now)."""
    if not isinstance(target, str):
        return target
    module, sep, attribute = target.partition(":")
    if not sep:
        raise ValueError(f"a builder path is 'module:attr', got {target!r}")
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True)
class Codec:
    """A codec: its ``kind`` (dense or records), the bytes one value costs on the wire (records: at the
    codec's defaults; their exact size is the built codec's ``encoded_size``), what it ``builds`` and its
    ``parameters`` (cotrain.algorithms.parameters)."""

    kind: str
    bytes_per_value: float
    builds: Callable[..., Any] | str
    parameters: Mapping[str, Parameter] = field(default_factory=dict)
    doc: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"a codec's kind is one of {', '.join(KINDS)}, got {self.kind!r}")
        if not self.bytes_per_value > 0:
            raise ValueError(f"a codec's bytes per value must be positive, got {self.bytes_per_value}")

    @property
    def lossless(self) -> bool:
        """Whether a float32 value travels whole (4 bytes or more)."""
        return self.bytes_per_value >= 4

    def settings(self, options: Mapping[str, Any], fields: Any = None, what: str = "codec") -> dict[str, Any]:
        """Every parameter's value: those with a field of their own read from ``fields`` (a config object
        that has them; their defaults without one), the others from ``options`` over their defaults. Raises
        ValueError naming every problem of ``options`` (``what``: the codec, as the error names it)."""
        values = {
            name: p.default if fields is None else getattr(fields, p.field)
            for name, p in self.parameters.items()
            if p.field
        }
        return {**values, **settle(what, self.parameters, options)}

    def build(self, **settings: Any) -> Any:
        """What compresses: the builder called with the codec's ``settings``."""
        return resolve(self.builds)(**settings)


def _topk_density(value: float) -> str:
    return "" if 0 < value <= 0.5 else f"must be in (0, 0.5], got {value}"


def _topk_bits(value: int) -> str:
    return "" if value in TOPK_BITS else f"must be one of {', '.join(map(str, TOPK_BITS))}, got {value}"


def _topk_decay(value: float) -> str:
    return "" if 0 < value <= 1 else f"must be in (0, 1], got {value}"


NONE = Codec("dense", 4, "hivemind.compression:NoCompression", doc="float32 values as they are")
FP16 = Codec("dense", 2, "hivemind.compression:Float16Compression", doc="values in float16")
BITS_8 = Codec(
    "dense", 1, "hivemind.compression:Uniform8BitQuantization", doc="hivemind's uniform 8-bit quantization"
)
TOPK = Codec(
    "records",
    84 / 4096,  # at the defaults: 84 bytes a chunk of 4096 values (cotrain.algorithms.sparse)
    "cotrain.algorithms.sparse:TopK",
    {
        "density": Parameter(1 / 64, "the share of each chunk sent", "topk_density", _topk_density),
        "bits": Parameter(2, "bits per value sent", "topk_bits", _topk_bits),
        "decay": Parameter(0.9, "error feedback's decay", "topk_feedback_decay", _topk_decay),
    },
    doc="the top-k values of each chunk of 4096, quantized, with error feedback",
)
