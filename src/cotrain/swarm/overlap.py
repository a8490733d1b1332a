"""Where a DiLoCo peer's overlapped round started, and its change since (cotrain.swarm.diloco, ``overlap``).

With overlap a peer measures its round's change from where the round started (not from the global
parameters, which the previous round's outer step moves only at this round's end), then continues from the new
global parameters minus that change. With a codec the change is computed in place in the start's own
tensors, and the new parameters in place in the change once the codec has encoded it: a round's end then
takes no fresh memory of the model's size (hundreds of MB whose pages the kernel zeroes at every round,
which on a host shared by several peers took more time than the arithmetic). Dense rounds keep the change
itself until the next round's end (it is what the peer applies if its round fails), so theirs is a copy.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import torch


def snapshot(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """A float32 copy on the host of each of ``tensors``."""
    return [t.detach().to("cpu", torch.float32, copy=True) for t in tensors]


class RoundStart:
    """The start of a peer's round: float32 host copies of its parameters (``in_place``: see the module's
    doc)."""

    def __init__(self, parameters: Sequence[torch.Tensor], in_place: bool) -> None:
        self.parameters, self.in_place = parameters, in_place
        self.tensors = snapshot(parameters)

    def reset(self, tensors: Iterable[torch.Tensor]) -> None:
        """The round starts again at ``tensors`` (a download, a restart)."""
        self.tensors = snapshot(tensors)

    @torch.no_grad()
    def change(self) -> list[torch.Tensor]:
        """The round's pseudo-gradient: its start minus the parameters now (in the start's tensors, in
        place)."""
        pairs = zip(self.tensors, self.parameters, strict=True)
        if not self.in_place:
            return [(start - param.detach().cpu()).float() for start, param in pairs]
        for start, param in pairs:
            start.sub_(param.detach().cpu())
        return self.tensors

    @torch.no_grad()
    def next_round(
        self, global_parameters: Sequence[torch.Tensor], change: Sequence[torch.Tensor], lock: threading.Lock
    ) -> None:
        """The parameters become the global ones minus ``change`` (this round's, from ``change()``, no longer
        needed in place), and the next round starts there."""
        with lock:
            for param, glob, own in zip(self.parameters, global_parameters, change, strict=True):
                new = own.neg_().add_(glob) if self.in_place else glob - own
                param.copy_(new.to(param.device, param.dtype))
        if not self.in_place:
            self.tensors = snapshot(self.parameters)
            return
        for start, param in zip(self.tensors, self.parameters, strict=True):
            start.copy_(param.detach())
