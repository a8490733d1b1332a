"""The cap on a state download: a donor may send no more tensors, and not many more bytes, than a state of the
downloader's own model can hold.

A downloader knows its model: the same as every peer of the run (the run's config record makes sure of it),
so the same parameters, of the same shapes. Its optimizer's statistics are another matter: most optimizers
build them at their first step, so a newcomer holds none yet while its donors hold theirs. The bound is
therefore taken from the parameters (``state_bound``): each parameter, the holder's extra tensors, and per
optimizer at most ``TENSORS_PER_PARAMETER`` tensors a parameter (LAMB keeps five: its two statistics, its step
and two norms), of which at most ``FULL_STATS_PER_PARAMETER`` the size of the parameter (Adam with amsgrad:
three), in 32-bit floats or wider. A donor's stream is refused, and the next donor asked as after any failed
download, as soon as it has started more tensors than that, or declared (a tensor's first part names its shape
and dtype) or sent more bytes than their bytes plus ``STATE_SLACK_BYTES`` and ``STATE_SLACK_PER_TENSOR`` a
tensor: the metadata (the step, the optimizer's flat description, a few hundred
bytes a tensor), protobuf fields and the chunks a tensor is streamed in, a compression's codebook. Without it
a donor could stream tensors until the downloader runs out of memory. Each message of the stream is counted
once it is received: hivemind reads a message of any length a donor announces before it reaches this count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

STATE_SLACK_BYTES = 1 << 20  # beyond the tensors' bytes: the metadata and what the stream wraps them in
STATE_SLACK_PER_TENSOR = 1 << 12  # a tensor: its share of the metadata, protobuf fields, a codebook
TENSORS_PER_PARAMETER = 8  # an optimizer's state tensors per parameter, at most (LAMB: 5, Adam: 3)
FULL_STATS_PER_PARAMETER = 4  # of those, the most that are the parameter's size (Adam with amsgrad: 3)


class StateTooLarge(ValueError):
    """A donor sent more tensors or bytes than a state of the downloader's model can hold."""


def state_bound(
    parameters: Sequence[torch.Tensor], extra: Sequence[torch.Tensor] = (), optimizers: int = 1
) -> tuple[int, int]:
    """The most tensors, and bytes of tensors, a state of ``parameters`` (with ``extra`` tensors and the
    statistics of ``optimizers`` optimizers) may hold: what a donor's state may hold at most."""
    widest = sum(t.numel() * max(4, t.element_size()) for t in parameters)
    tensors = len(parameters) * (1 + TENSORS_PER_PARAMETER * optimizers) + len(extra)
    return tensors, widest * (1 + FULL_STATS_PER_PARAMETER * optimizers) + sum(t.nbytes for t in extra)


def declared_bytes(part) -> int:
    """The bytes a tensor's first streamed part (a ``runtime_pb2.Tensor``) says the whole tensor holds."""
    dtype = getattr(torch, part.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise StateTooLarge(f"a tensor of unknown dtype {part.dtype[:32]!r}")
    return math.prod(part.size) * torch.empty((), dtype=dtype).element_size()


class StateBudget:
    """Counts a download's stream against the most a state may hold: ``take`` each message as it comes."""

    def __init__(self, max_tensors: int, tensor_bytes: int) -> None:
        """The most tensors and bytes of tensors a state may hold (``state_bound``)."""
        self.max_tensors = max_tensors
        self.max_bytes = tensor_bytes + STATE_SLACK_BYTES + STATE_SLACK_PER_TENSOR * max_tensors
        self.tensors = self.received = self.declared = 0

    def take(self, message) -> None:
        """Count one ``averaging_pb2.DownloadData`` message; raises StateTooLarge beyond the caps."""
        self.received += message.ByteSize()
        if self.received > self.max_bytes:
            raise StateTooLarge(f"more than {self.max_bytes} bytes, the most a state of this model takes")
        if message.tensor_part.dtype:  # a tensor's first part
            self.tensors += 1
            if self.tensors > self.max_tensors:
                raise StateTooLarge(
                    f"more than {self.max_tensors} tensors, the most a state of this model has"
                )
            self.declared += declared_bytes(message.tensor_part)
            if self.declared > self.max_bytes:
                raise StateTooLarge(
                    f"tensors of more than {self.max_bytes} bytes, the most a state of this model takes"
                )
