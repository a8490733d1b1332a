"""``SwarmPeer``: the one place where a peer joins a swarm, catches up, steps, reports, heals, backs up and
shuts down. ``cotrain train`` is a loop over it, and so is a training loop of one's own:

    peer = cotrain.SwarmPeer(
        model,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        run_id="my-run",
        target_batch_size=4096,
        initial_peers=["/ip4/1.2.3.4/tcp/31337/p2p/12D3KooW..."],
    )
    with peer:
        for batch in loader:
            loss = model(**batch).loss
            loss.backward()
            peer.step(batch_size=len(batch["input_ids"]), loss=loss.item())

The DHT starts with cotrain's defaults (no port mapping, signed and schema-checked records), the training
strategy is a part (``sync``: hivemind.Optimizer with bounded state downloads, no matchmaking while alone,
fp16 on the wire but optimizer statistics in full precision), a newcomer loads the swarm's current state
before its first step, a peer cut off from the swarm re-joins and adopts the swarm's state, non-finite
gradients never reach the swarm, and one signed metrics record per global step goes to the DHT, where a
``cotrain monitor`` of the same run id shows it beside the trainers'.

hivemind requires the peer to be created in the main thread of its process, and one peer per process.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from cotrain import checkpoints as ck
from cotrain.config import PeerConfig, RunConfig
from cotrain.engine.compute import flat_tensors, gradient_norm
from cotrain.engine.handover import catch_up, leave_final_state
from cotrain.engine.join import SwarmConnection
from cotrain.engine.parts import CoreSharing, FaultInjection, Healing, NanGuard, Part
from cotrain.engine.settings import API_RUN, configs_of
from cotrain.engine.shutdown import kept_interrupt, leave_in_order, shutdown_in_order
from cotrain.errors import UserError
from cotrain.net.configrecord import API_ROLE
from cotrain.net.logs import one_line_errors
from cotrain.net.metrics import LocalMetrics, publish_metrics, reported_loss
from cotrain.registry import strategy_class

logger = logging.getLogger(__name__)


class SwarmPeer:
    """One peer of a collaborative run, stepped from a training loop.

    ``optimizer``: a function params -> torch optimizer (hivemind builds it on the averaged parameters);
    ``scheduler``: an optional function optimizer -> LR scheduler, stepped once per global step;
    ``params``: parameters or parameter groups to train (default: every parameter of ``model`` that
    requires a gradient). Every peer of a run must agree on ``run_id``, ``target_batch_size``, the model,
    the optimizer and the schedule.

    The other arguments are the per-peer settings of ``cotrain train`` with the same names:
    ``initial_peers`` (multiaddrs of peers in the swarm; none for the first peer), ``host_maddrs`` (where
    to listen), ``announce_maddrs``, ``client_mode`` (for peers that cannot accept connections),
    ``identity_path``, ``batch_size_per_step`` (the default for ``step``), ``matchmaking_time``,
    ``averaging_timeout``, ``grad_compression`` ("fp16", "8bit" or "none"), ``load_state_timeout``,
    ``statistics_expiration``, ``startup_timeout``, ``bandwidth``, ``batch_size_lead``, ``nat_port_map``,
    ``use_ipfs``, ``verbose``, ``max_grad_norm`` (clip each step's gradients to this norm; 0: no clipping).
    With ``load_state=False`` a newcomer keeps its own weights instead of loading the swarm's. Any other
    per-peer setting of ``cotrain train`` goes by its config name (``cotrain.config.PeerConfig``), e.g.
    ``delay_optimizer_step=True``, ``offload_optimizer=True``, ``target_group_size=16``,
    ``backup_every_steps=10`` (keep a backup to restore when the parameters turn NaN; 0, the default here:
    none).

    ``strategy="diloco"`` trains with DiLoCo instead of synchronous averaging: ``optimizer`` and ``scheduler``
    are then the inner ones, stepped at every ``step``; after ``local_steps`` x ``target_batch_size`` samples
    of the swarm, the peers average their parameters' change and take an outer SGD step with Nesterov
    momentum (``outer_lr``, ``outer_momentum``: 0.7 and 0.9 by default); ``outer_overlap=True`` runs that
    all-reduce in the background and applies it one round late. ``global_step`` then counts outer rounds.
    ``outer_compression="topk"`` sends each round's change as the top ``topk_density`` of every chunk in
    ``topk_bits`` bits, with error feedback (what stays unsent joins the next round times
    ``topk_feedback_decay``; docs/diloco.md); its outer step is then, by default, SparseLoCo's
    (``outer_lr`` 1, ``outer_momentum`` 0).

    ``aggregation="centered-clip"`` makes every reducer of the all-reduce combine its part with CenteredClip
    (``clip_tau``: "auto" or a radius; ``clip_iterations``) instead of the mean, against malicious peers
    (docs/security.md); every peer of a run must use the same. A registered part's own parameters go by
    name: ``aggregation_options={"trim": 0.1}`` (swarm-wide), ``outer_compression_options`` (a records
    codec's, swarm-wide) and ``grad_compression_options`` (this peer's --grad-compression codec's), each
    checked against what the part declares (cotrain.registry)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Callable[[Iterable], torch.optim.Optimizer],
        scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
        *,
        params: Iterable | None = None,
        batch_size_per_step: int | None = None,
        load_state: bool = True,
        config: tuple[RunConfig, PeerConfig] | None = None,
        connection: Any = None,
        stop: threading.Event | None = None,
        grad_scaler: Any = None,
        events: Callable[[str, dict], None] | None = None,
        start: bool = True,
        **settings: Any,
    ) -> None:
        if not callable(optimizer) or isinstance(optimizer, torch.optim.Optimizer):
            raise UserError(
                "optimizer must be a function params -> torch.optim.Optimizer, "
                "e.g. lambda params: torch.optim.AdamW(params, lr=1e-3)"
            )
        if scheduler is not None and not callable(scheduler):
            raise UserError("scheduler must be a function optimizer -> LR scheduler (or None)")
        if config is not None:
            if settings:
                raise UserError("give either config=(run, peer) or the settings as arguments, not both")
            run, peer = config
            max_grad_norm = run.max_grad_norm
        else:
            run, peer, max_grad_norm = configs_of(settings, batch_size_per_step)
            if not peer.verbose:  # hivemind's expected network failures (a peer left, no group) as one line
                one_line_errors()
        if params is None:
            params = [p for p in model.parameters() if p.requires_grad]
        self._open(model, run, peer, params, optimizer, scheduler, batch_size_per_step, connection, stop)
        self.max_grad_norm, self.grad_scaler = max_grad_norm, grad_scaler
        if events is not None:
            self.events = events
        if not start:  # the caller resumes from a checkpoint (optional), then calls catch_up and start
            return
        try:
            logger.info(f"Peer {self.peer_id} joined run {run.run_id!r}; others join with {self.maddrs}")
            if load_state:
                self.catch_up()
            self.start()
        except BaseException:
            self.shutdown()
            raise

    def _open(
        self,
        model: torch.nn.Module,
        run: RunConfig,
        peer: PeerConfig,
        params: Iterable,
        optimizer: Callable,
        scheduler: Callable | None,
        batch_size_per_step: int | None,
        connection: Any,
        stop: threading.Event | None,
    ) -> None:

        self.model, self.run, self.peer_config = model, run, peer
        self.max_grad_norm, self.grad_scaler = 0.0, None
        self._stop = stop if stop is not None else threading.Event()
        self._closed = False
        self.connection = connection
        self.strategy: Any = None
        self.parts: list[Part] = []  # called at the named points of a step (cotrain.engine.parts)
        self.healing: Any = None
        self.node: Any = None  # a peer of several ranks: cotrain.engine.node.Node (attach_node)
        self.events: Callable[[str, dict], None] = lambda name, fields: None
        self.last_report: dict | None = None
        self.reports = 0
        self._loss_sum, self._mini_steps, self._contribution = 0.0, 0, 0
        params = list(params)
        self.trained_tensors = flat_tensors(params)  # what step() checks and the fault hooks reach
        self.cores: Any = None  # this peer's share of the machine's cores, when it has no --torch-threads
        if peer.torch_threads:
            torch.set_num_threads(peer.torch_threads)
        else:  # several peers on one machine share its cores instead of oversubscribing them
            self.cores = CoreSharing()
            self.parts.append(self.cores)
        try:
            if self.connection is None:  # a loop of one's own: refused, like `cotrain train`, on the settings
                # it shares with the swarm (ConfigMismatch names them) before its averagers start
                self.connection = SwarmConnection(run.run_id, peer, role=API_ROLE, stop=self._stop)
                self.connection.agree(run, names=tuple(API_RUN))
            self.strategy = strategy_class(run.strategy)(
                self.connection.dht,
                run,
                peer,
                params,
                optimizer,
                scheduler,
                batch_size_per_step,
                self._stop.is_set,
            )
        except BaseException:
            shutdown_in_order(self.strategy, self.connection, self.cores)
            self._closed = True
            raise
        faults = FaultInjection.from_env(run.strategy)  # fault injection of the tests and benchmarks only
        if faults is not None:
            self.parts.append(faults)
        # a peer left running at exit still stops its averagers and DHT processes in order
        self._finalizer = leave_in_order(self, self._stop, self.strategy, self.connection, self.cores)
        self._last_epoch = self.strategy.global_step

    # --- what a loop reads ----------------------------------------------------------------------

    @property
    def global_step(self) -> int:
        """The swarm's global step this peer is at."""
        return self.strategy.global_step

    @property
    def peer_id(self) -> str:
        return self.connection.peer_id

    @property
    def maddrs(self) -> list[str]:
        """Addresses others can join this peer at (loopback last)."""
        return self.connection.maddrs()

    @property
    def dht(self) -> Any:
        return self.connection.dht

    @property
    def num_peers(self) -> int:
        """Peers training in this run, as the progress tracker last saw them (this one included)."""
        return self.strategy.progress.num_peers

    @property
    def last_group_size(self) -> int:
        """Peers in its last gradient-averaging group, itself included (1: it used local gradients)."""
        return self.strategy.progress.group_size

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer built from ``optimizer`` (it steps once per global step)."""
        return self.strategy.optimizer

    @property
    def refusal(self) -> str | None:
        """Why a private swarm stopped accepting this peer's access token, if it did."""
        return self.connection.refusal

    # --- joining --------------------------------------------------------------------------------

    def catch_up(self) -> None:
        """Load the swarm's state when others are already further along (bounded, with a message)."""

        self._last_epoch = catch_up(self, self._stop)

    def start(self) -> None:
        """Start healing (re-joining after a partition) and, with ``backup_every_steps``, the NaN guard's
        first backup."""

        self.healing = Healing(self.dht, self.peer_config.initial_peers, self._stop, self.strategy)
        # healing first (a peer back from a partition adopts the swarm's state before anything else), then the
        # fault hooks, then the guard (it checks the parameters right after a fault corrupted them)
        faults = [p for p in self.parts if isinstance(p, FaultInjection)]
        self.parts = [p for p in self.parts if p not in faults] + [self.healing] + faults
        if self.peer_config.backup_every_steps > 0:
            self.parts.append(NanGuard(self.strategy, self.peer_config.backup_every_steps))
        self._last_epoch = self.global_step

    # --- what a loop calls ----------------------------------------------------------------------

    def step(self, batch_size: int | None = None, loss: float | None = None, zero_grad: bool = True) -> bool:
        """Hand this micro-batch's gradients (already in ``.grad``, from ``loss.backward()``) to the swarm.

        ``batch_size``: samples behind these gradients (default: ``batch_size_per_step``); ``loss``: their
        loss, for the metrics record published at each global step (``None``: nothing to report). Non-finite
        gradients or loss are dropped, never sent. When the swarm has accumulated ``target_batch_size``
        samples, this call averages gradients with peers and steps the optimizer. Gradients are zeroed
        afterwards unless ``zero_grad=False``. Returns True when a global step happened."""
        samples = self._samples(batch_size)
        for part in self.parts:
            part.before_step(self)
        if self.node is not None:  # the gradients are the ranks' shards
            grad_norm = self.node.gradient_norm(self.max_grad_norm)
        else:
            grad_norm = gradient_norm(self.trained_tensors, self.max_grad_norm)
        loss_ok = loss is None or math.isfinite(loss)
        if loss_ok and math.isfinite(grad_norm):
            sent = samples
            for part in self.parts:
                sent = part.outgoing(self, sent)
            with kept_interrupt():  # Ctrl+C in a round's wait, which hivemind swallows, stops the script
                self.strategy.step(sent)
            self._count(samples, loss)
            if zero_grad:
                self.strategy.zero_grad()
        else:
            self._drop(loss, grad_norm)
        if self.global_step == self._last_epoch:
            return False
        self._last_epoch = self.global_step
        for part in self.parts:
            part.after_global_step(self)
        self.publish_metrics()
        return True

    def _samples(self, batch_size: int | None) -> int:
        if self._closed:
            raise UserError("this SwarmPeer was shut down")
        if batch_size is None and self.strategy.batch_size_per_step is None:
            raise UserError("give step(batch_size=...) or SwarmPeer(batch_size_per_step=...)")
        return batch_size if batch_size is not None else self.strategy.batch_size_per_step

    def _count(self, samples: int, loss: float | None) -> None:
        self._contribution += samples
        if loss is not None:
            self._loss_sum += float(loss)
            self._mini_steps += 1

    def _drop(self, loss: float | None, grad_norm: float) -> None:
        """A micro-batch with a non-finite loss or gradients: its gradients never reach the swarm."""
        self.strategy.zero_grad()
        loss_ok = loss is None or math.isfinite(loss)
        if loss_ok and self.grad_scaler is not None:
            logger.debug(f"fp16 gradients overflowed; loss scale now {self.grad_scaler.get_scale():g}")
            return
        self.events("dropped", {"step": self.global_step, "loss": loss, "grad_norm": grad_norm})
        shown = f"{loss:.4g}" if loss is not None else "-"
        logger.warning(
            f"Non-finite loss or gradients on this micro-batch (loss {shown}, gradient norm "
            f"{grad_norm:.4g}): its gradients are dropped, not sent to the swarm"
        )
        for part in self.parts:
            part.dropped(self, loss_ok)

    def zero_grad(self) -> None:
        self.strategy.zero_grad()

    def attach_node(self, node: Any) -> None:
        """Train as rank 0 of a peer of several ranks (cotrain.engine.node.Node): ``model`` is the node's
        replica on the host, the node measures and clips each step's gradients over its shards, and the
        strategy gathers and sends back its state around the swarm's rounds."""
        self.strategy.attach_node(node)
        node.attach(self.model)
        self.node = node

    def publish_metrics(self, loss: float | None = None, mini_steps: int | None = None) -> dict:
        """Publish this peer's signed metrics record for the current global step and log its line.

        ``loss``: mean loss per micro-batch since the last record (default: the mean of the losses given to
        ``step`` since then); ``mini_steps``: how many micro-batches it covers. ``step`` calls this at each
        global step. Returns the report (also in ``last_report``)."""

        if loss is None:
            mini_steps = self._mini_steps if mini_steps is None else mini_steps
            total = self._loss_sum
        else:
            mini_steps = 1 if mini_steps is None else mini_steps
            total = float(loss) * mini_steps
        strategy, peer = self.strategy, self.peer_config
        progress = strategy.progress
        record = LocalMetrics(
            step=strategy.global_step,
            samples_per_second=progress.samples_per_second,
            samples_accumulated=self._contribution,
            loss=reported_loss(float(total)),
            mini_steps=int(mini_steps),
            group_size=progress.group_size,
            client_mode=self.connection.client_mode,
            time=time.time(),
            peer_id=self.peer_id[:128],
            inner_steps=progress.inner_steps,
            round_bytes=progress.round_bytes,
        )
        publish_metrics(
            self.dht, self.run.run_id, self.connection.public_key, record, peer.statistics_expiration
        )
        mean = total / mini_steps if mini_steps else None
        averaged, failed = progress.rounds_averaged, progress.rounds_failed
        first, self.reports = self.reports == 0, self.reports + 1
        logged = record.step % peer.logging_steps == 0 or (first and peer.logging_first_step)
        if logged:
            logger.info(
                f"step {record.step} | loss {mean if mean is not None else float('nan'):.4f} | averaged with "
                f"{record.group_size} peers | {record.samples_per_second:.1f} samples/s | contribution "
                f"{record.samples_accumulated} samples | rounds averaged {averaged}, failed {failed}"
            )
        self.last_report = {
            "step": record.step,
            "loss": mean,
            "group_size": record.group_size,
            "samples_per_second": record.samples_per_second,
            "contribution": record.samples_accumulated,
            "rounds_averaged": averaged,
            "rounds_failed": failed,
            "rejoins": self.healing.rejoins if self.healing is not None else 0,
            "peer_id": record.peer_id,
            "time": record.time,
            "strategy": strategy.name,
            "inner_steps": record.inner_steps,
            "round_bytes": record.round_bytes,
            "rounds_caught_up": progress.rounds_caught_up,
            "logged": logged,
        }
        self._loss_sum, self._mini_steps = 0.0, 0
        return self.last_report

    def load_state_from_peers(self) -> bool:
        """Download the swarm's current state now (bounded by ``load_state_timeout``); True if newer."""
        before = self.global_step
        self.strategy.load_state_from_peers()
        self._last_epoch = self.global_step
        return self.global_step > before

    def adopt_swarm_state(self, floor: int = 0) -> None:
        """Back from being cut off: the swarm's state wins over what this peer did alone (not a state older
        than ``floor``, the step at which it was cut off)."""
        logger.info("Loading the swarm's current state after being cut off")
        adopted = self.strategy.adopt_swarm_state(self._stop.is_set, floor)
        if adopted:
            logger.info(f"Adopted the swarm's state at global step {self.global_step}")
        self.events("adopted", {"step": self.global_step, "loaded": adopted})
        self._last_epoch = self.global_step
        self._loss_sum, self._mini_steps = 0.0, 0

    def leave_final_state(self, timeout: float | None = None) -> bool:
        """Done training (--max-steps, an epoch limit): before leaving, make sure a monitor that keeps the
        swarm's checkpoints has this peer's final state (cotrain.engine.handover). Waits up to ``timeout``
        seconds (default: load_state_timeout + 30); returns whether a monitor has it."""

        return leave_final_state(self, self._stop, timeout)

    # --- checkpoints ------------------------------------------------------------------------------

    def load_checkpoint(self, path: str | Path, meta: dict) -> None:
        """Continue from a checkpoint (cotrain.checkpoints) of this run: model, optimizer, schedule, step."""

        with self.strategy.training_state() as (optimizer, scheduler, params):
            ck.load_into(
                path, self.model, optimizer, scheduler, meta=meta, params=params, inner=self.strategy.inner
            )
        self.strategy.resumed_at(int(meta["step"]))
        self._last_epoch = self.global_step

    def save_checkpoint(self, root: str | Path, config: dict, tokenizer: Any, keep: int, source: str) -> Path:
        """Save the swarm's state as this peer holds it (the averaged or global parameters, the optimizer and
        schedule, diloco's inner optimizer) as a checkpoint."""

        with self.strategy.checkpoint_state() as parts:
            return ck.save_checkpoint(
                root,
                self.global_step,
                self.model,
                parts.optimizer,
                parts.scheduler,
                config,
                tokenizer,
                keep=keep,
                source=source,
                params=parts.params,
                inner=parts.inner,
            )

    # --- the end ----------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Leave the swarm: cancel pending averaging rounds, stop the strategy's averagers, then the DHT."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        for part in self.parts:
            if part is not self.cores:  # the cores go last, after the strategy and the DHT
                part.close()
        self._finalizer()

    def __enter__(self) -> SwarmPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
