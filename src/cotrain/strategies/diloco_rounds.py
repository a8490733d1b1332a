"""DiLoCo on hivemind: H local steps of the inner optimizer, then one outer step on the averaged change.

Each peer keeps two copies of the parameters: the model's (local, moved by the inner optimizer, LAMB or
AdamW with the preset's schedule, at every ``step``) and the swarm's global parameters (host memory, moved
only by the outer optimizer: SGD with Nesterov momentum). A round ends when the swarm has accumulated
``round_samples`` samples (hivemind's ``ProgressTracker``, as for a synchronous global step). Then every peer
computes its pseudo-gradient ``global - local`` (its own change over the round, sign as a gradient),
averages it with the others in one hivemind all-reduce (weighted by the samples it trained on, compressed on
the wire), and applies the outer step to the global parameters, which every peer then trains from.

Peers that diverged (a round alone, another group, a fresh download) must step from the same outer state
again: each peer keeps a *lineage*, and a group whose lineages differ averages the outer state (global
parameters and momentum) in the same all-reduce as the pseudo-gradients (cotrain.algorithms.lineage); a member
that shows a new lineage round after round is struck, and its lineage stops counting (``LineageWatch``).

``overlap``: a round's all-reduce runs in the background while the next round computes; its outer step is
applied one round late, at the end of the next round, and the peer then continues from the new global
parameters plus its own change since (so its work is never thrown away, and compute never waits;
cotrain.strategies.overlap).

A round whose all-reduce fails is retried with whoever is left until ``averaging_timeout``; then the peer
applies its own change alone. A peer the others left a round behind joins theirs when it reads the swarm
next, with the steps it took in its own (``_rejoin``). Client-mode peers send their parts to full peers.
With ``node`` (a peer of several ranks, cotrain.engine.node) the model is rank 0's replica: gathered from
the ranks at a round's end, sent back to them whenever it changed.

The state a newcomer (or the monitor) downloads is the global parameters, the outer optimizer's momentum,
the round number, and the serving peer's inner optimizer state and inner step
(cotrain.hivemind_ext.diloco_state).

With a ``codec`` (``--outer-compression topk``) the round's all-reduce carries the pseudo-gradient plus this
peer's error-feedback buffer as sparse quantized records (cotrain.algorithms.sparse), and every member of a
group decodes the same averaged records: their outer steps are the same to the bit, so the outer state rides
along only where lineages differ, never on a schedule. A peer that averages alone applies its whole change and
empties its buffer. The buffer is this peer's own: not served to newcomers, not saved in checkpoints (a peer
that restarts loses at most the residual of its last rounds).
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import hivemind
import torch
from hivemind.compression import CompressionBase
from hivemind.utils import get_dht_time

from cotrain import hivemind_ext as internals
from cotrain.algorithms.aggregation import Aggregation, Mean
from cotrain.algorithms.lineage import (
    LINEAGE_BREAKS,
    LINEAGE_WINDOW,
    LineageWatch,
    Voucher,
    carries_outer_state,
    fresh_lineage,
    initial_lineage,
    next_lineage,
    round_bits,
)
from cotrain.algorithms.sparse import Raw, TopK, flat
from cotrain.faults import Attack
from cotrain.hivemind_ext.diloco_state import (
    DiLoCoStateAverager,
    outer_optimizer_factory,
    set_schedule,
)
from cotrain.hivemind_ext.hooks import apply_optimizer_parameters
from cotrain.hivemind_ext.liveness import RoundWatch, cancel_controls
from cotrain.hivemind_ext.optimizer import LOAD_STATE_COMPRESSION, load_state_bounded
from cotrain.hivemind_ext.outer import round_averager, round_expiration
from cotrain.hivemind_ext.progress import PING_TIMEOUT, forget_gone_peers, round_pace, tracker_class
from cotrain.hivemind_ext.roundresults import RoundResult
from cotrain.keys import progress_key, state_averager_prefix
from cotrain.strategies.overlap import OverlappedRounds, RoundEnds, RoundStart, encode_with_feedback

logger = logging.getLogger(__name__)


def expected_members(round_: int, other_epochs: list[int]) -> int:
    """How many peers a round's group waits for before it closes: this one and every other whose last record
    is not past ``round_``. A record behind the round counts: it lags its peer, which may be in this round
    already (a peer that spent a whole averaging timeout in its last round reports nothing meanwhile, then
    joins the swarm's round), and a peer truly behind costs the group no more than its matchmaking time
    (``round_expiration``). Counted out, such a peer found every group closed before it came, round after
    round."""
    return 1 + sum(epoch <= round_ for epoch in other_epochs)


class DiLoCoOptimizer(OverlappedRounds):
    """A DiLoCo peer's optimizer (see the module's doc). Exposes what cotrain's healer, NaN guard and bounded
    state download use of ``hivemind.Optimizer``: ``state_averager``, ``tracker``, ``local_epoch``,
    ``client_mode``, ``load_state_from_peers``."""

    grad_averager = None  # no per-step gradient averaging: the bounded state download skips it
    use_gradient_averaging = False
    scheduled_grads = None

    def __init__(
        self,
        *,
        dht: hivemind.DHT,
        run_id: str,
        params: Sequence,
        inner_optimizer: Callable[[Iterable], torch.optim.Optimizer],
        inner_scheduler: Callable[[torch.optim.Optimizer], Any] | None,
        local_steps: int,
        round_samples: int,
        outer_lr: float,
        outer_momentum: float,
        overlap: bool,
        matchmaking_time: float,
        averaging_timeout: float,
        load_state_timeout: float,
        compression: CompressionBase,
        bytes_per_value: float = 2.0,
        batch_size_per_step: int | None = None,
        averager_opts: dict | None = None,
        aggregation: Aggregation = Mean(),
        tracker_opts: dict | None = None,
        performance_ema_alpha: float = 0.1,
        verbose: bool = False,
        codec: TopK | None = None,
    ) -> None:
        internals.install()
        self.dht, self.run_id, self.client_mode = dht, run_id, bool(dht.client_mode)
        self.local_steps, self.overlap = local_steps, overlap
        self.matchmaking_time, self.averaging_timeout = matchmaking_time, averaging_timeout
        self.load_state_timeout, self.batch_size_per_step = load_state_timeout, batch_size_per_step
        self.compression, self.codec = compression, codec
        self.bytes_per_value = bytes_per_value  # of ``compression`` on the wire (cotrain.registry)
        params = list(params)
        dicts = bool(params) and isinstance(params[0], dict)
        groups = [dict(g, params=list(g["params"])) for g in params] if dicts else [{"params": params}]
        self.parameters = [p for g in groups for p in g["params"]]
        loglevel = logging.INFO if verbose else logging.DEBUG
        inner = inner_optimizer([dict(g) for g in groups])
        schedule = inner_scheduler(inner) if inner_scheduler is not None else None
        averager_opts = dict(averager_opts or {})
        request_timeout = averager_opts.pop("request_timeout", 3.0)
        self.state_averager = DiLoCoStateAverager(
            dht=dht,
            prefix=state_averager_prefix(run_id),
            progress_key=progress_key(run_id) if aggregation.robust else None,
            witnessed_key=progress_key(run_id),  # a served state's round is bounded by the swarm's
            optimizer=outer_optimizer_factory(outer_lr, outer_momentum),
            params=groups,
            inner_optimizer=inner,
            inner_scheduler=schedule,
            local_steps=local_steps,
            # a newcomer downloads the state in full precision (cotrain.hivemind_ext.optimizer)
            state_compression=LOAD_STATE_COMPRESSION,
            min_matchmaking_time=matchmaking_time,
            request_timeout=request_timeout,
            client_mode=self.client_mode,
            allow_state_sharing=not self.client_mode,
            status_loglevel=loglevel,
            start=True,
        )
        self.state_averager.on_loaded = self._after_download
        self.voucher = Voucher(len(self.parameters))
        self.state_averager.served_lineage = self.voucher.served
        self.numel = sum(p.numel() for p in self.parameters)
        self.momentum = outer_momentum > 0  # whether the outer state carries momentum buffers
        self.outer_averager = round_averager(
            self.parameters,
            dht,
            run_id=run_id,
            codec=codec,
            compression=compression,
            aggregation=aggregation,
            matchmaking_time=matchmaking_time,
            request_timeout=request_timeout,
            averaging_timeout=averaging_timeout,
            averager_opts=averager_opts,
            client_mode=self.client_mode,
            momentum=self.momentum,
            # dense rounds average the outer state in place, where a round carries it
            state=[t.detach() for t in self._carried_state()] if codec is None else None,
            state_lock=self.state_averager.lock_averaged_tensors,
        )
        self.changes, self.state_bytes = self.outer_averager.changes, self.outer_averager.state_bytes
        self.feedback = self.outer_averager.feedback  # with a codec: what this peer did not send (_payload)
        self.tracker = tracker_class(aggregation.robust)(
            dht=dht,
            prefix=run_id,
            target_batch_size=round_samples,
            client_mode=self.client_mode,
            status_loglevel=loglevel,
            performance_ema_alpha=performance_ema_alpha,
            pace=round_pace(matchmaking_time),  # a round's progress, not an inner step's (progress.py)
            start=True,
            **(tracker_opts or {}),
        )
        self._round_began = time.monotonic()
        self.rounds_averaged, self.rounds_failed, self.last_group_size = 0, 0, 1
        self.rounds_caught_up = 0  # rounds averaged without this peer whose result it took (_catch_up)
        self.last_round_bytes = 0  # payload sent in its last all-reduce (from the sizes and the compression)
        self.last_carried_state = False  # whether the last averaged round carried the outer state
        self.last_round_partial = False  # whether it ended with a member's contribution or a part missing
        self.lineage = initial_lineage(
            self.state_averager.global_parameters
        )  # see cotrain.algorithms.lineage
        self.lineage_watch = LineageWatch()  # the other peers that keep breaking their lineage
        self._vouch()
        self.bytes_sent, self.samples = 0, 0  # samples: those this peer trained on in the current round
        self.inner_steps_done = self.inner_steps_this_round = 0  # this peer's, since it started; this round
        self._scheduled: Any = None  # matchmaking started ahead of the round's end
        self._pending: Any = None  # overlap: the previous round's all-reduce, with this peer's own change
        self._pending_own: list[torch.Tensor] | None = None
        self._rejoining = False  # see _rejoin
        self._start = RoundStart(self.parameters, in_place=codec is not None) if overlap else None
        # overlap with a codec: the round's pseudo-gradient plus feedback, kept until the next round's end,
        # and the thread that encodes it and decodes the group's average (overlap.RoundEnds)
        self._whole = torch.empty(self.numel) if overlap and codec is not None else None
        self._ends = RoundEnds() if overlap and codec is not None else None
        self.should_stop: Callable[[], bool] = lambda: False
        self.node: Any = None  # a peer of several ranks: see the module's doc
        self.round_watch = RoundWatch(
            [self.outer_averager],
            self.tracker,
            self.dht,
            self.matchmaking_time,
            lambda: self.should_stop(),
            left_behind=self._left_behind,
        )
        self.round_watch.start()
        self.attack = Attack.from_env("diloco", announce=False)  # COTRAIN_ATTACK (cotrain.faults)
        self.state_averager.state_sharing_priority = self.local_epoch

    # --- what the engine reads --------------------------------------------------------------------

    @property
    def local_epoch(self) -> int:
        """The outer round this peer is in (rounds completed since the start of the run)."""
        return self.state_averager.local_epoch

    @property
    def inner_optimizer(self) -> torch.optim.Optimizer:
        return self.state_averager.inner_optimizer

    @property
    def inner_scheduler(self) -> Any:
        return self.state_averager.inner_scheduler

    @property
    def inner_steps(self) -> int:
        """The inner schedule's position: the swarm's inner steps (local_steps per round)."""
        return self.state_averager.inner_steps

    # --- a step -------------------------------------------------------------------------------------

    def step(self, batch_size: int | None = None) -> None:
        """One inner step on the gradients in ``.grad``; at the end of a round, the outer round."""
        batch_size = batch_size if batch_size is not None else self.batch_size_per_step
        if self.tracker.global_epoch > self.local_epoch + 1:  # the swarm went on without this peer
            logger.info(f"The swarm is at round {self.tracker.global_epoch}: loading its state")
            self.load_state_from_peers()
            return
        self._rejoin()
        with self.state_averager.lock_inner:
            self.inner_optimizer.step()
            # the schedule follows the swarm: local_steps per round (a peer faster than the swarm's average
            # holds the last rate of the round), set to the round's start at each round (_next_round)
            if self.inner_steps_this_round < self.local_steps:
                if self.inner_scheduler is not None:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", UserWarning)
                        self.inner_scheduler.step()
                self.state_averager.inner_steps += 1
        self.inner_steps_this_round += 1
        self.inner_steps_done += 1
        self.samples += int(batch_size)
        self.tracker.report_local_progress(self.local_epoch, self.samples)
        self._maybe_schedule_round()
        if self.tracker.ready_to_update_epoch:
            self.outer_round()

    def zero_grad(self) -> None:
        self.inner_optimizer.zero_grad(set_to_none=True)

    def _others(self) -> bool:
        return self.tracker.global_progress.num_peers > 1

    def _rejoin(self) -> None:
        """After a round ended alone while others were there, once the swarm was read since: a swarm ahead is
        joined at once (else this peer could stay a round behind, see the module's doc)."""
        if not self._rejoining or not self.tracker.fetched_global_progress_this_epoch.is_set():
            return
        self._rejoining, sa, epoch = False, self.state_averager, self.tracker.ahead_of(self.local_epoch)
        if epoch is None:  # the others (client-mode peers too) are not all ahead of it
            return
        logger.info(f"The swarm is at round {epoch}: this peer joins it there")
        with self.tracker.pause_updates():
            sa.local_epoch = epoch
            with sa.lock_inner:
                sa.inner_steps = epoch * self.local_steps + min(self.inner_steps_this_round, self.local_steps)
                set_schedule(self.inner_scheduler, sa.inner_steps)
            self.tracker.update_epoch(new_epoch=epoch)
        self.tracker.report_local_progress(epoch, self.samples)
        self.tracker.fetch_now()  # the round's progress so far, to meet the others at its end
        if not self.client_mode:
            sa.state_sharing_priority = epoch

    def _maybe_schedule_round(self) -> None:
        """Start matchmaking ahead of the round's end (as hivemind.Optimizer does for gradients), so the
        group is formed when the peers get there."""
        # with overlap the all-reduce runs in the background anyway, and the lineage sent at matchmaking must
        # be the one after the previous round's outer step, which is applied only at this round's end
        if self.overlap or self._scheduled is not None or not self._others():
            return
        eta = self.tracker.estimated_next_update_time
        if eta - get_dht_time() <= self.matchmaking_time:
            self._match_this_round()
            self._scheduled = self.outer_averager.step(
                scheduled_time=round_expiration(eta, self.matchmaking_time, self.averaging_timeout),
                timeout=self.averaging_timeout,
                wait=False,
                require_trigger=True,
                gather=self._gather(),
            )

    # --- the outer round -------------------------------------------------------------------------------

    def outer_round(self) -> None:
        """End this round: average the pseudo-gradients and take the outer step (or, with overlap, launch
        this round's averaging and apply the previous one's)."""
        with self.tracker.pause_updates():
            if self.node is not None:
                with self.state_averager.lock_inner:
                    self.node.pull()
            own = self._own_change()
            if self.overlap:
                self._overlapped_round(own)
            else:
                sent, own = self._payload(own)
                averaged, base, self.last_group_size = self._average(own, sent, self.samples)
                self._outer_step(averaged, base)
                apply_optimizer_parameters(self.state_averager)  # the peer trains from the new global
            self._rejoining = self.last_group_size == 1 and self._others()
            self._next_round()
            self._vouch()
        self._to_node(optimizer=False)

    @torch.no_grad()
    def _own_change(self) -> list[torch.Tensor]:
        """This round's pseudo-gradient: where the round started minus where the peer is now."""
        if self.overlap:
            return self._start.change()
        glob = self.state_averager.global_parameters
        return [(s - p.detach().cpu()).float() for s, p in zip(glob, self.parameters, strict=True)]

    @torch.no_grad()
    def _payload(self, own: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(What this round sends, what this peer applies if it averages with nobody.) Dense: its change. With
        a codec: the records of its change plus its feedback buffer, which then keeps what they leave out;
        alone, the peer applies that whole sum (and empties the buffer: ``_alone``)."""
        sent = self.attack.pseudo_gradient(own)  # fault injection: a malicious peer's pseudo-gradient
        if self.codec is None:
            return sent, own
        whole = flat(sent, out=self._whole)
        return [encode_with_feedback(self.codec, whole, self.feedback)], self._shaped(whole)

    def _shaped(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` cut into tensors of the parameters' shapes."""
        sizes = [p.numel() for p in self.parameters]
        return [t.view(p.shape) for t, p in zip(flat.split(sizes), self.parameters, strict=True)]

    def _alone(self, own: list[torch.Tensor]) -> tuple[list[torch.Tensor], None, int]:
        """A round alone: this peer's own change (a codec's whole feedback in it); its matchmaking ends."""
        self.lineage = fresh_lineage()
        self.cancel_rounds()
        if self.codec is not None:
            self.feedback.zero_()
        return own, None, 1

    def _average(
        self, own: list[torch.Tensor], sent: list[torch.Tensor], weight: int
    ) -> tuple[list[torch.Tensor], Any, int]:
        """Average ``sent`` (with the outer state) with the group, retrying with whoever is left until
        averaging_timeout. Returns (the average change, the average outer state, the group's size); alone or
        when it cannot, (this peer's own change ``own``, None, 1)."""
        deadline = time.monotonic() + self.averaging_timeout
        attempt = 0
        while self._others() and not self.should_stop() and not self._left_behind():
            attempt += 1
            control = self._launch(sent, weight)
            try:
                return self._averaged(*control.result(max(0.0, deadline - time.monotonic())))
            except BaseException as e:  # a member left mid-round, no group formed, the timeout
                if not control.done():
                    control.cancel()
                if not self.should_stop():  # others that no longer answer are not waited for again
                    forget_gone_peers(self.tracker, self.dht, PING_TIMEOUT)
                remaining = deadline - time.monotonic()
                if remaining < self.matchmaking_time:
                    logger.warning(
                        f"Round {self.local_epoch}: averaging failed ({type(e).__name__}: {e}); "
                        "applying this peer's own change"
                    )
                    break
                logger.info(
                    f"Round {self.local_epoch}: averaging attempt {attempt} failed ({type(e).__name__}); "
                    f"retrying with the peers left ({remaining:.0f} s left)"
                )
        if self._others():
            caught = self._catch_up(own)
            if caught is not None:
                return caught
            self.rounds_failed += 1
            if self._left_behind():
                logger.info(f"Round {self.local_epoch}: the others finished it; this peer's own change")
        return self._alone(own)

    def _catch_up(self, own: list[torch.Tensor]) -> tuple[list[torch.Tensor], None, int] | None:
        """A round the others averaged without this peer: their group's average, fetched from peers that
        finished the round, for an outer step from the outer state they held too (sparse rounds, without
        overlap: cotrain.hivemind_ext.roundresults). This peer's own change (``own``: its whole change, the
        feedback buffer's in it) goes into its next round through the feedback buffer. None: none served."""
        if self.codec is None or self.overlap or self.should_stop():
            return None
        donors = self.tracker.peers_past(self.local_epoch)
        if not donors:  # the last read may predate the round's end elsewhere: read again, a matchmaking time
            self.tracker.fetch_now()
            deadline = time.monotonic() + self.matchmaking_time
            while not donors and time.monotonic() < deadline and not self.should_stop():
                time.sleep(0.1)
                donors = self.tracker.peers_past(self.local_epoch)
        result = self.outer_averager.fetch_result(
            donors, self.local_epoch, self.lineage, timeout=self.averaging_timeout / 2
        )
        if result is None:
            return None
        self.cancel_rounds()
        self.feedback.copy_(flat(own))
        self.lineage = result.after
        self.rounds_caught_up += 1
        self.last_carried_state = self.last_round_partial = False
        self.last_round_bytes = 0  # it sent nothing: its change goes into its next round
        logger.info(
            f"Round {self.local_epoch}: the others averaged it without this peer; it took their average "
            f"({sum(t.numel() * t.element_size() for t in result.tensors):,} bytes) and sends its own change "
            "in its next round"
        )
        return self._shaped(self.codec.decode(result.tensors[0], self.numel)), None, 1

    def _left_behind(self) -> bool:
        """Every other peer has finished this round (liveness.RoundWatch): nobody is left to average with."""
        return self.tracker.passed_by(self.local_epoch)

    def _gather(self) -> dict[str, Any]:
        """What this peer sends its group at matchmaking: its lineage and round, and the peers it strikes
        (carries_outer_state)."""
        gather = {"lineage": self.lineage, "round": self.local_epoch}
        struck = self.lineage_watch.struck()
        return {**gather, "struck": struck} if struck else gather

    def _received(self, gathered: dict[Any, Any]) -> tuple[list[torch.Tensor], list | None, bool, Any]:
        """What an all-reduce with the group that sent ``gathered`` left in the averager: (the average change,
        the average outer state, global parameters then momentum, or None when the group did not carry it,
        whether it did, the averaged records as received where the round sent records)."""
        n, full = self.changes, carries_outer_state(gathered, self.codec is None)
        with self.outer_averager.get_tensors() as tensors:  # dense rounds averaged the outer state in place
            averaged = [t.clone() for t in tensors[:n]]
            base = [t.clone() for t in tensors[n:]] if full and self.codec is not None else None
        records = None
        if self.codec is not None:  # the group's records, the same on every member
            records = averaged
            averaged = self._shaped(self.codec.decode(averaged[0], self.numel))
            if base is not None:
                base = [t for raw in base for t in self._shaped(Raw().decode(raw, self.numel))]
        return averaged, base, full, records

    def _averaged(
        self, gathered: dict[Any, Any], partial: bool, received: tuple | None = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, int]:
        """After an all-reduce with the group that sent ``gathered`` (``received``: what ``_received`` read
        of it, if read already): (the average change, the average outer state or None, the group's size).
        Counts the round and moves this peer to the group's lineage (a fresh one after a ``partial``
        round)."""
        averaged, base, full, records = received if received is not None else self._received(gathered)
        before = self.lineage
        self.lineage = fresh_lineage() if partial else next_lineage(self.local_epoch, gathered)
        if records is not None and not (partial or full or self.overlap):  # served to a peer that missed it
            result = RoundResult(self.local_epoch, before, self.lineage, tuple(records))
            self.outer_averager.keep_result(result)
        self.last_carried_state, self.last_round_partial = full, partial
        if partial:
            logger.info(f"Round {self.local_epoch}: a partial all-reduce; the next carries the outer state")
        self._watch_lineages(gathered, None if partial else self.lineage)
        return averaged, base, self._count_round(len(gathered), full)

    def _watch_lineages(self, gathered: dict[Any, Any], lineage: bytes | None) -> None:
        """Note which members of the round that sent ``gathered`` showed the lineage their previous round with
        this peer gave them, and expect ``lineage`` of them next (cotrain.algorithms.lineage.LineageWatch)."""
        me = self.dht.peer_id
        mine = gathered.get(me)
        round_ = mine.get("round") if isinstance(mine, dict) else None
        if not isinstance(round_, int) or isinstance(round_, bool):
            return
        for peer in self.lineage_watch.observe(me, round_, gathered, lineage):
            logger.warning(
                f"Peer {peer} showed a lineage other than the one its last round with this peer gave it in "
                f"{LINEAGE_BREAKS} of its last {LINEAGE_WINDOW} rounds with it: striking it (its lineage no "
                "longer makes this peer's groups average the outer state)"
            )

    def _launch(self, sent: list[torch.Tensor], weight: int) -> Any:
        """Put ``sent`` (and, with a codec, the outer state's records) in the averager and start its
        all-reduce (in the group matched ahead if any), which carries the outer state too where the group's
        lineages differ (OuterAverager; dense rounds average the state's own tensors)."""
        control = self._matched()
        self._fill(control, sent, weight)
        return control

    def _matched(self) -> Any:
        """This round's all-reduce: the one matched ahead if any, else a new matchmaking, which waits for
        its tensors (``_fill``)."""
        control, self._scheduled = self._scheduled, None
        if control is not None and (control.triggered or control.done()):
            control = None
        if control is None:
            self._match_this_round()
            control = self.outer_averager.step(
                timeout=self.averaging_timeout, wait=False, require_trigger=True, gather=self._gather()
            )
        return control

    def _fill(self, control: Any, sent: list[torch.Tensor], weight: int) -> None:
        """Put ``sent`` (and, with a codec, the outer state's records) in the averager; the all-reduce
        ``control`` may start."""
        with self.outer_averager.get_tensors() as tensors, self.state_averager.lock_averaged_tensors:
            state = []
            if self.codec is not None:
                state, n = self._carried_state(), len(self.parameters)
                kinds = (state[:n], state[n:]) if self.momentum else (state,)
                state = [Raw().encode(flat(part)) for part in kinds]
            for buffer, value in zip(tensors, [*sent, *state], strict=False):
                buffer.copy_(value)
        control.weight = self.attack.weight(float(max(weight, 1)))  # fault injection: a claimed weight
        control.allow_allreduce()

    def _match_this_round(self) -> None:
        """Look for a group at this round only (the key's low bits: a change never goes into another round's
        average). Set before every matchmaking: hivemind moves the bits after each group it assembles. The
        group closes as soon as every peer expected in the round is in it (``_expected_group``)."""
        self.outer_averager.set_group_bits(round_bits(self.local_epoch))
        self.outer_averager.expect_group(self._expected_group())

    def _expected_group(self) -> int | None:
        """The members of this round's group once every peer of the round is in it: this peer and the others
        that the last read of the swarm's progress does not put past this round (``expected_members``). None
        (the configured target group size) in a swarm with client-mode peers, whose group an auxiliary reducer
        may join (cotrain.hivemind_ext.auxiliary) that reports no progress."""
        if self.client_mode or self.tracker.global_progress.num_clients > 0:
            return None
        return expected_members(self.local_epoch, self.tracker.other_epochs())

    def _carried_state(self) -> list[torch.Tensor]:
        """What a round that carries the outer state averages: the global parameters, and the momentum unless
        it is 0."""
        sa = self.state_averager
        return sa.outer_state() if self.momentum else sa.global_parameters

    def _count_round(self, size: int, full: bool) -> int:
        """Count a successful round of ``size`` peers (returned) and the payload this peer sent in it."""
        self.rounds_averaged += 1
        # butterfly all-reduce of the changes (or the codec records) and the outer state when carried: a peer
        # sends (n-1)/n of its vector, and the averages of its part to the n-1 others
        codec = self.codec
        changes = self.numel * self.bytes_per_value if codec is None else codec.encoded_size(self.numel)
        vector = changes + (self.numel * (1 + self.momentum) * self.state_bytes if full else 0)
        sent = int(2 * vector * (size - 1) / size) if size > 1 else 0
        self.last_round_bytes = sent
        self.bytes_sent += sent
        return size

    @torch.no_grad()
    def _outer_step(self, averaged: list[torch.Tensor], base: list[torch.Tensor] | None) -> None:
        """The outer optimizer's step along ``averaged``, from ``base`` (the group's average outer state:
        global parameters and momentum) when given."""
        sa = self.state_averager
        if not all(bool(torch.isfinite(t).all()) for t in [*averaged, *(base or ())]):
            # the global parameters only ever move by finite steps: they are the NaN guard's backup
            logger.warning(f"Round {self.local_epoch}: a non-finite average or change; no outer step")
            self.lineage = fresh_lineage()
            return
        with sa.lock_averaged_tensors:
            self.voucher.withdraw()  # until _vouch: a state served meanwhile goes without a lineage
            if base is not None:
                for mine, value in zip(self._carried_state(), base, strict=True):
                    mine.copy_(value)
            for param, change in zip(sa.global_parameters, averaged, strict=True):
                param.grad = change  # lent for the step: no gradient buffer is kept between rounds
            sa.optimizer.step()
            for param in sa.global_parameters:
                param.grad = None

    def _next_round(self) -> None:
        sa = self.state_averager
        sa.local_epoch = max(self.local_epoch + 1, self.tracker.global_epoch)
        with sa.lock_inner:
            sa.inner_steps = self.local_epoch * self.local_steps
            set_schedule(self.inner_scheduler, sa.inner_steps)
        self.samples = self.inner_steps_this_round = 0
        now, expiration = time.monotonic(), self.tracker.metadata_expiration
        self.tracker.pace = round_pace(self.matchmaking_time, now - self._round_began, expiration)
        self._round_began = now
        self.tracker.update_epoch(new_epoch=self.local_epoch)
        if not self.client_mode:
            sa.state_sharing_priority = self.local_epoch

    # --- downloads, shutdown -------------------------------------------------------------------------

    def _after_download(self, lineage: bytes | None = None) -> None:
        """A downloaded state replaces this peer's: the round starts again from the global parameters, in
        the ``lineage`` its donor vouched for (a fresh one without)."""
        if self._pending is not None and not self._pending.done():
            self._pending.cancel()
        if self._ends is not None:
            self._ends.settle(self._ends.take(), self.averaging_timeout)
        self._pending = self._pending_own = None
        self.state_averager.pin_momentum()
        self.lineage = lineage if lineage is not None and not self.overlap else fresh_lineage()
        if self.overlap:
            self._start.reset(self.state_averager.global_parameters)
        self.samples = self.inner_steps_this_round = 0
        self._vouch()

    def _vouch(self) -> None:
        """Vouch for the global parameters as they are now (after a round's outer step, a download or a
        resume: lineage.Voucher), and have the state's fingerprint record attest it at once (a newcomer takes
        a lineage only where another peer attests it: cotrain.hivemind_ext.diloco_state). Not with overlap,
        where the global parameters and the lineage a round sends are a round apart."""
        if not self.overlap:
            with self.state_averager.lock_averaged_tensors:
                self.voucher.vouch(self.local_epoch, self.lineage, self.state_averager.global_parameters)
            publisher = getattr(self.state_averager, "fingerprints", None)
            if publisher is not None:
                publisher.nudge()

    def load_state_from_peers(self, **kwargs: Any) -> None:
        """Download the swarm's state, bounded by load_state_timeout (cotrain.hivemind_ext.optimizer)."""
        self.voucher.withdraw()
        self.cancel_rounds()
        load_state_bounded(self, self.load_state_timeout, self.should_stop)
        self._to_node()

    def tag_along_with_zero_weight(self, control: Any) -> None:
        if not control.done():
            control.cancel()

    def cancel_rounds(self) -> None:
        cancel_controls(self._scheduled, self._pending)
        self._scheduled = None

    def resumed_at(self, round_: int) -> None:
        """After a checkpoint was loaded into the global parameters and optimizers: continue from it."""
        sa = self.state_averager
        sa.local_epoch = int(round_)
        sa.inner_steps = sa.local_epoch * self.local_steps
        self.restart_round()
        if not self.client_mode:
            sa.state_sharing_priority = self.local_epoch

    def restart_round(self) -> None:
        """Train the round again from the global parameters (the model's own are dropped)."""
        apply_optimizer_parameters(self.state_averager)
        self._after_download()
        self.tracker.report_local_progress(local_epoch=self.local_epoch, samples_accumulated=0)
        self._to_node()

    def _to_node(self, optimizer: bool = True) -> None:
        if self.node is not None:  # the ranks train on from the replica's parameters (and inner state)
            self.node.push(optimizer)

    def shutdown(self) -> None:
        self.round_watch.close()
        self.cancel_rounds()
        if self._ends is not None:
            self._ends.close(self.averaging_timeout)
        for part in (self.tracker, self.outer_averager, self.state_averager):
            try:
                part.shutdown()
            except Exception as e:
                logger.debug(f"{type(part).__name__} shutdown: {e!r}")
