"""The cap on a state download: a donor may send no more tensors, and not many more bytes, than the state the
downloader itself holds.

A downloader knows what it expects: the same model and optimizer as every peer of the run (the run's config
record makes sure of it), so the same tensors, of the same shapes and dtypes, as it serves itself
(``served_sizes``). A donor's stream is refused, and the next donor asked as after any failed download, as
soon as it has started more tensors than that, or declared (a tensor's first part names its shape and dtype)
or sent more bytes than the tensors' bytes plus ``STATE_SLACK_BYTES`` and ``STATE_SLACK_PER_TENSOR`` a tensor:
the metadata (the step, the optimizer's flat description, a few hundred bytes a tensor), protobuf fields
and the chunks a tensor is streamed in, a compression's codebook. Without it a donor could stream tensors
until the downloader runs out of memory. Each message of the stream is counted once it is received: hivemind
reads a message of any length a donor announces before it reaches this count.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

STATE_SLACK_BYTES = 1 << 20  # beyond the tensors' bytes: the metadata and what the stream wraps them in
STATE_SLACK_PER_TENSOR = 1 << 12  # a tensor: its share of the metadata, protobuf fields, a codebook


class StateTooLarge(ValueError):
    """A donor sent more tensors or bytes than the downloader's own state holds."""


def declared_bytes(part) -> int:
    """The bytes a tensor's first streamed part (a ``runtime_pb2.Tensor``) says the whole tensor holds."""
    dtype = getattr(torch, part.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise StateTooLarge(f"a tensor of unknown dtype {part.dtype[:32]!r}")
    return math.prod(part.size) * torch.empty((), dtype=dtype).element_size()


class StateBudget:
    """Counts a download's stream against the downloader's own state: ``take`` each message as it comes."""

    def __init__(self, sizes: Iterable[int]) -> None:
        """``sizes``: the bytes of each tensor the downloader holds, in the order a state is served."""
        sizes = list(sizes)
        self.max_tensors = len(sizes)
        self.max_bytes = sum(sizes) + STATE_SLACK_BYTES + STATE_SLACK_PER_TENSOR * len(sizes)
        self.tensors = self.received = self.declared = 0

    def take(self, message) -> None:
        """Count one ``averaging_pb2.DownloadData`` message; raises StateTooLarge beyond the caps."""
        self.received += message.ByteSize()
        if self.received > self.max_bytes:
            raise StateTooLarge(f"more than {self.max_bytes} bytes, the most this peer's own state takes")
        if message.tensor_part.dtype:  # a tensor's first part
            self.tensors += 1
            if self.tensors > self.max_tensors:
                raise StateTooLarge(f"more than {self.max_tensors} tensors, as many as this peer's own state")
            self.declared += declared_bytes(message.tensor_part)
            if self.declared > self.max_bytes:
                raise StateTooLarge(
                    f"tensors of more than {self.max_bytes} bytes, the most this peer's own state takes"
                )
