"""A DiLoCo peer's overlapped rounds (cotrain.strategies.diloco_rounds, ``overlap``): where a round started,
its change since, and the end of a round.

With overlap a peer measures its round's change from where the round started (not from the global
parameters, which the previous round's outer step moves only at this round's end), then continues from the new
global parameters minus that change. With a codec the change is computed in place in the start's own
tensors, and the new parameters in place in the change once it is copied out: a round's end then
takes no fresh memory of the model's size (hundreds of MB whose pages the kernel zeroes at every round,
which on a host shared by several peers took more time than the arithmetic). Dense rounds keep the change
itself until the next round's end (it is what the peer applies if its round fails), so theirs is a copy.

With a codec the training thread only copies its change out and moves its parameters on; the host's work on
the whole vector (the error feedback, encoding, filling the averager, then decoding the group's records once
they arrive) runs in a thread of its own (``RoundEnds``) while the next round computes: a GPU peer's device
does not wait for its host. The next round's end takes the result (normally long ready) before it touches
the feedback buffer or the global parameters again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from cotrain.algorithms.sparse import flat

logger = logging.getLogger(__name__)


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
            if param.dtype != torch.float32 or param.device.type != "cpu":  # else the start holds them
                start.copy_(param.detach())


def add_feedback(codec: Any, whole: torch.Tensor, feedback: torch.Tensor) -> torch.Tensor:
    """``whole`` (a round's change) plus ``feedback`` times the codec's decay, in place."""
    return whole.add_(feedback, alpha=codec.decay)


def encode_with_feedback(codec: Any, whole: torch.Tensor, feedback: torch.Tensor) -> torch.Tensor:
    """The records of ``whole`` with the feedback added (``add_feedback``); ``feedback`` then keeps what they
    leave out (cotrain.algorithms.sparse)."""
    records = codec.encode(add_feedback(codec, whole, feedback))
    feedback.copy_(whole)
    codec.add_decoded(records, feedback, alpha=-1.0)
    return records


class RoundEnds:
    """One thread for the host's work of sparse overlapped rounds (see the module's doc), one round's at a
    time: ``job`` is the round in flight."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cotrain-round-end")
        self.job: Future | None = None

    def submit(self, work: Callable[..., Any], *args: Any) -> None:
        self.job = self._executor.submit(work, *args)

    def take(self) -> Future | None:
        """The round in flight (None if none), no longer this object's."""
        job, self.job = self.job, None
        return job

    def settle(self, job: Future | None, bound: float) -> None:
        """Wait up to ``bound`` s for ``job`` to end (its round cancelled: it ends once its encoding is)."""
        if job is not None:
            wait([job], timeout=bound)

    def close(self, bound: float) -> None:
        self.settle(self.take(), bound)
        self._executor.shutdown(wait=False, cancel_futures=True)


class OverlappedRounds:
    """For cotrain.strategies.diloco_rounds.DiLoCoOptimizer: a round's end with ``overlap``."""

    @torch.no_grad()
    def _overlapped_round(self, own: list[torch.Tensor]) -> None:
        """Apply the previous round's average (it had a whole round to arrive), continue from the new global
        parameters plus this round's own change, and launch this round's all-reduce in the background."""
        if self._pending_own is not None:
            averaged, base, self.last_group_size = self._finish_pending()
            self._outer_step(averaged, base)
        sa = self.state_averager
        if self._ends is None:
            sent, whole = self._payload(own)  # after the previous round: its reducer's residual is in
            self._start.next_round(sa.global_parameters, own, sa.lock_averaged_tensors)
            self._pending_own = whole
            self._pending = self._launch(sent, self.samples) if self._others() else None
            return
        # a codec: the change copied out, the rest of the host's work in the round ends' thread (overlap.py)
        whole = flat(self.attack.pseudo_gradient(own), out=self._whole)
        self._start.next_round(sa.global_parameters, own, sa.lock_averaged_tensors)
        self._pending_own, self._pending = self._shaped(whole), None
        if not self._others():
            add_feedback(self.codec, whole, self.feedback)
            return
        self._pending = self._matched()
        self._ends.submit(self._sparse_round, self._pending, whole, self.samples)

    @torch.no_grad()  # (grad mode is per thread)
    def _sparse_round(self, control: Any, whole: torch.Tensor, weight: int) -> tuple:
        """A sparse overlapped round's host work (in the round ends' thread): encode ``whole`` with the
        feedback, start the all-reduce, and read its result once it ends."""
        self._fill(control, [encode_with_feedback(self.codec, whole, self.feedback)], weight)
        gathered, partial = control.result()
        return gathered, partial, self._received(gathered)

    def _finish_pending(self) -> tuple[list[torch.Tensor], Any, int]:
        own, control = self._pending_own, self._pending
        job = self._ends.take() if self._ends is not None else None
        self._pending = self._pending_own = None
        if control is None:
            return self._alone(own)
        try:
            return self._averaged(*(job or control).result(self.averaging_timeout))
        except BaseException as e:
            if not control.done():
                control.cancel()
            if job is not None:  # it no longer writes the feedback buffer that _alone empties
                self._ends.settle(job, self.averaging_timeout)
            logger.warning(
                f"Round {self.local_epoch - 1}: averaging failed ({type(e).__name__}: {e}); "
                "applying this peer's own change"
            )
            self.rounds_failed += 1
            return self._alone(own)
