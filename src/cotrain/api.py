"""A Python API for training loops of one's own: ``SwarmPeer`` joins a swarm with any torch model.

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

It is cotrain's trainer minus its data and model: the DHT starts with cotrain's defaults (no port mapping,
signed and schema-checked metrics records), hivemind.Optimizer is cotrain's ``SwarmOptimizer`` (bounded
state downloads, no matchmaking while alone, fp16 on the wire but optimizer statistics in full precision),
a newcomer loads the swarm's current state before its first step, and one metrics record per global step
goes to the DHT, where a ``cotrain monitor`` of the same run id shows it beside the trainers'.

hivemind requires the peer to be created in the main thread of its process, and one peer per process.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from cotrain.config import PeerConfig, RunConfig
from cotrain.errors import UserError

logger = logging.getLogger(__name__)

CATCH_UP_WAIT = 5.0  # seconds a newcomer waits to see other peers before deciding it is the first


class SwarmPeer:
    """One peer of a collaborative run, stepped from a training loop of one's own.

    ``optimizer``: a function params -> torch optimizer (hivemind builds it on the averaged parameters);
    ``scheduler``: an optional function optimizer -> LR scheduler, stepped once per global step;
    ``params``: parameters or parameter groups to train (default: every parameter of ``model`` that
    requires a gradient). Every peer of a run must agree on ``run_id``, ``target_batch_size``, the model,
    the optimizer and the schedule.

    The other arguments are the per-peer and swarm settings of ``cotrain train`` with the same names:
    ``initial_peers`` (multiaddrs of peers in the swarm; none for the first peer), ``host_maddrs`` (where
    to listen), ``announce_maddrs``, ``client_mode`` (for peers that cannot accept connections),
    ``identity_path``, ``batch_size_per_step`` (the default for ``step``), ``matchmaking_time``,
    ``averaging_timeout``, ``grad_compression`` ("fp16" or "none"), ``load_state_timeout``,
    ``statistics_expiration``, ``startup_timeout``, ``bandwidth``, ``batch_size_lead``, ``nat_port_map``,
    ``use_ipfs``, ``verbose``. With ``load_state=False`` a newcomer keeps its own weights instead of
    loading the swarm's. Any other setting of ``cotrain train``'s swarm side goes by its config name
    (``cotrain.config.PeerConfig``), e.g. ``delay_optimizer_step=True``, ``offload_optimizer=True``,
    ``target_group_size=16``."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Callable[[Iterable], torch.optim.Optimizer],
        scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
        *,
        run_id: str,
        target_batch_size: int,
        initial_peers: Sequence[str] = (),
        host_maddrs: Sequence[str] = ("/ip4/0.0.0.0/tcp/0",),
        announce_maddrs: Sequence[str] = (),
        client_mode: bool = False,
        identity_path: str = "",
        params: Iterable | None = None,
        batch_size_per_step: int | None = None,
        matchmaking_time: float = 5.0,
        averaging_timeout: float = 60.0,
        grad_compression: str = "fp16",
        load_state: bool = True,
        load_state_timeout: float = 60.0,
        statistics_expiration: float = 600.0,
        startup_timeout: float = 20.0,
        bandwidth: float = 0.0,
        batch_size_lead: int = 0,
        nat_port_map: bool = False,
        use_ipfs: bool = False,
        verbose: bool = False,
        **settings: Any,
    ) -> None:
        if not callable(optimizer) or isinstance(optimizer, torch.optim.Optimizer):
            raise UserError(
                "optimizer must be a function params -> torch.optim.Optimizer, "
                "e.g. lambda params: torch.optim.AdamW(params, lr=1e-3)"
            )
        if scheduler is not None and not callable(scheduler):
            raise UserError("scheduler must be a function optimizer -> LR scheduler (or None)")
        problems = []
        if not run_id or "." in run_id or "/" in run_id:
            problems.append(f"run_id {run_id!r} must be non-empty and contain no '.' or '/'")
        if target_batch_size <= 0:
            problems.append(f"target_batch_size must be positive, got {target_batch_size}")
        if batch_size_per_step is not None and batch_size_per_step <= 0:
            problems.append(f"batch_size_per_step must be positive, got {batch_size_per_step}")
        if grad_compression not in ("fp16", "none"):
            problems.append(f"grad_compression must be fp16 or none, got {grad_compression!r}")
        if matchmaking_time <= 0 or averaging_timeout <= 0 or load_state_timeout <= 0:
            problems.append("matchmaking_time, averaging_timeout and load_state_timeout must be positive")
        known = {f.name for f in dataclasses.fields(PeerConfig)}
        for name in sorted(set(settings) - known):
            problems.append(f"unknown setting {name!r} (see cotrain.config.PeerConfig)")
        if problems:
            raise UserError("; ".join(problems))
        from cotrain.swarm.dht import create_dht, visible_maddrs
        from cotrain.swarm.logs import one_line_errors
        from cotrain.swarm.optimizer import build_optimizer
        from cotrain.swarm.records import make_validators

        self.model = model
        self.run = RunConfig(
            run_id=run_id,
            target_batch_size=target_batch_size,
            matchmaking_time=matchmaking_time,
            averaging_timeout=averaging_timeout,
            grad_compression=grad_compression,
        )
        self.peer_config = PeerConfig(
            initial_peers=list(initial_peers),
            host_maddrs=list(host_maddrs),
            announce_maddrs=list(announce_maddrs),
            client_mode=client_mode,
            identity_path=identity_path,
            nat_port_map=nat_port_map,
            use_ipfs=use_ipfs,
            load_state_timeout=load_state_timeout,
            statistics_expiration=statistics_expiration,
            startup_timeout=startup_timeout,
            bandwidth=bandwidth,
            batch_size_lead=batch_size_lead,
            verbose=verbose,
            **settings,
        )
        self.dht = None
        self.opt = None
        self.healer = None
        self._closed = False
        self._stop = threading.Event()
        self._loss_sum, self._mini_steps, self._contribution = 0.0, 0, 0
        if not verbose:  # hivemind's expected network failures (a peer left, no group) as one line each
            one_line_errors()
        validators, self._public_key = make_validators(run_id)
        from cotrain.swarm.auth import access_for  # access_token="FILE" joins a private swarm

        access = access_for(run_id, self.peer_config.access_token, "")
        self.dht = create_dht(self.peer_config, validators, access=access)
        try:
            if params is None:
                params = [p for p in model.parameters() if p.requires_grad]
            self.opt = build_optimizer(
                self.dht,
                self.run,
                self.peer_config,
                list(params),
                optimizer,
                scheduler,
                batch_size_per_step=batch_size_per_step,
            )
            # a peer left running at exit still stops its averagers and DHT processes in order
            self._finalizer = weakref.finalize(self, _shutdown, self.opt, self.dht)
            self.maddrs: list[str] = visible_maddrs(self.dht)
            logger.info(f"Peer {self.dht.peer_id} joined run {run_id!r}; others join with {self.maddrs}")
            if load_state:
                self._catch_up()
            from cotrain.swarm.healing import SwarmHealer

            # a peer cut off from the swarm for a while (a partition, a loaded machine) re-joins by itself
            self.healer = SwarmHealer(self.dht, self.peer_config.initial_peers, self._stop, self.opt)
            self.healer.start()
        except BaseException:
            self.shutdown()
            raise
        self._last_epoch = self.opt.local_epoch

    # --- what a loop reads ----------------------------------------------------------------------

    @property
    def global_step(self) -> int:
        """The swarm's global step this peer is at (its optimizer's epoch)."""
        return self.opt.local_epoch

    @property
    def peer_id(self) -> str:
        return str(self.dht.peer_id)

    @property
    def num_peers(self) -> int:
        """Peers training in this run, as hivemind's progress tracker last saw them (this one included)."""
        return int(self.opt.tracker.global_progress.num_peers)

    @property
    def last_group_size(self) -> int:
        """Peers in its last gradient-averaging group, itself included (1: it used local gradients)."""
        return int(self.opt.last_group_size)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer hivemind built from ``optimizer`` (it steps once per global step)."""
        return self.opt.state_averager.optimizer

    # --- what a loop calls ----------------------------------------------------------------------

    def step(self, batch_size: int | None = None, loss: float | None = None, zero_grad: bool = True) -> bool:
        """Hand this micro-batch's gradients (already in ``.grad``, from ``loss.backward()``) to the swarm.

        ``batch_size``: samples behind these gradients (default: ``batch_size_per_step``); ``loss``: their
        loss, for the metrics record published at each global step (``None``: nothing to report). When the
        swarm has accumulated ``target_batch_size`` samples, this call averages gradients with peers and steps
        the optimizer. Gradients are zeroed afterwards unless ``zero_grad=False``. Returns True when a global
        step happened (``global_step`` moved)."""
        if self._closed:
            raise UserError("this SwarmPeer was shut down")
        if batch_size is None and self.opt.batch_size_per_step is None:
            raise UserError("give step(batch_size=...) or SwarmPeer(batch_size_per_step=...)")
        samples = batch_size if batch_size is not None else self.opt.batch_size_per_step
        if self.healer is not None and self.healer.resync.is_set():
            self._adopt_swarm_state()
        if loss is not None and not math.isfinite(loss):
            logger.warning(
                "Non-finite loss on this micro-batch: its gradients are dropped, not sent to the swarm"
            )
            self.opt.zero_grad()
            return False
        self.opt.step(batch_size=samples)
        self._contribution += samples
        if loss is not None:
            self._loss_sum += float(loss)
            self._mini_steps += 1
        if zero_grad:
            self.opt.zero_grad()
        if self.opt.local_epoch == self._last_epoch:
            return False
        self._last_epoch = self.opt.local_epoch
        if self._mini_steps:
            self.publish_metrics()
        return True

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def publish_metrics(self, loss: float | None = None, mini_steps: int | None = None) -> None:
        """Publish this peer's signed metrics record for the current global step, as ``cotrain train`` does.

        ``loss``: mean loss per micro-batch since the last record (default: the mean of the losses given to
        ``step`` since then); ``mini_steps``: how many micro-batches it covers. ``step`` calls this at each
        global step when it was given losses."""
        from cotrain.swarm.records import LocalMetrics, publish_metrics

        if loss is None:
            mini_steps = self._mini_steps if mini_steps is None else mini_steps
            total = self._loss_sum
        else:
            mini_steps = 1 if mini_steps is None else mini_steps
            total = float(loss) * mini_steps
        sps = float(self.opt.tracker.performance_ema.samples_per_second)
        record = LocalMetrics(
            step=self.opt.local_epoch,
            samples_per_second=min(max(sps, 0.0), 1e5) if math.isfinite(sps) else 0.0,
            samples_accumulated=self._contribution,
            loss=float(total),
            mini_steps=int(mini_steps),
            group_size=max(1, self.last_group_size),
            client_mode=bool(self.peer_config.client_mode),
            time=time.time(),
            peer_id=self.peer_id[:128],
        )
        publish_metrics(
            self.dht, self.run.run_id, self._public_key, record, self.peer_config.statistics_expiration
        )
        mean = total / mini_steps if mini_steps else float("nan")
        logger.info(
            f"step {record.step} | loss {mean:.4f} | averaged with {record.group_size} peers | "
            f"{record.samples_per_second:.1f} samples/s | contribution {record.samples_accumulated} samples"
        )
        self._loss_sum, self._mini_steps = 0.0, 0

    def load_state_from_peers(self) -> bool:
        """Download the swarm's current state now (bounded by ``load_state_timeout``); True if newer."""
        before = self.opt.local_epoch
        self.opt.load_state_from_peers()
        self._last_epoch = self.opt.local_epoch
        return self.opt.local_epoch > before

    def _adopt_swarm_state(self) -> None:
        """Back from being cut off: the swarm's state wins over what this peer did alone."""
        from cotrain.swarm.healing import adopt_swarm_state

        self.healer.resync.clear()
        logger.info("Loading the swarm's current state after being cut off")
        if adopt_swarm_state(
            self.opt, self.run.run_id, self.peer_config.load_state_timeout, self._stop.is_set
        ):
            logger.info(f"Adopted the swarm's state at global step {self.opt.local_epoch}")
        self._last_epoch = self.opt.local_epoch
        self._loss_sum, self._mini_steps = 0.0, 0

    def _catch_up(self) -> None:
        """Load the swarm's state when others are already further along (as ``cotrain train`` does)."""
        from cotrain.swarm.keeper import served_epochs

        tracker = self.opt.tracker
        deadline = time.monotonic() + min(CATCH_UP_WAIT, self.peer_config.load_state_timeout)
        if self.peer_config.initial_peers:  # the first peer has nobody to wait for
            while tracker.global_progress.num_peers <= 1 and time.monotonic() < deadline:
                time.sleep(0.2)
        me = self.dht.peer_id.to_bytes()
        served = max((e for p, e in served_epochs(self.dht, self.run.run_id).items() if p != me), default=0)
        swarm_step = max(tracker.global_epoch, int(served))
        if swarm_step > self.opt.local_epoch:
            logger.info(f"The swarm is at step {swarm_step}: loading its current state")
            self.opt.load_state_from_peers()
            logger.info(f"Starting from global step {self.opt.local_epoch}")

    # --- the end ----------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Leave the swarm: cancel pending averaging rounds, stop the optimizer's averagers, then the DHT."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self.healer is not None:
            self.healer.close()
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()
        else:
            _shutdown(self.opt, self.dht)

    def __enter__(self) -> SwarmPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class _DroppedTasks(logging.Filter):
    """After a peer's shutdown, asyncio reports the network tasks still pending in this process when the
    interpreter exits; they were ended on purpose, so these lines are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Task was destroyed but it is pending")


def _quiet_exit_hook(previous: Callable) -> Callable:
    """sys.unraisablehook minus hivemind's futures that, collected at exit after their event loop closed,
    complain that it is closed; anything else goes to the previous hook."""

    def hook(unraisable: Any) -> None:
        exc = unraisable.exc_value
        if (
            isinstance(exc, RuntimeError)
            and "Event loop is closed" in str(exc)
            and "MPFuture" in repr(unraisable.object)
        ):
            return
        previous(unraisable)

    hook.cotrain_quiet = True
    return hook


def _shutdown(opt: Any, dht: Any) -> None:
    asyncio_logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _DroppedTasks) for f in asyncio_logger.filters):
        asyncio_logger.addFilter(_DroppedTasks())
    if not getattr(sys.unraisablehook, "cotrain_quiet", False):
        sys.unraisablehook = _quiet_exit_hook(sys.unraisablehook)
    if opt is not None:
        for control in (opt.scheduled_grads, opt.scheduled_state):
            try:
                if control is not None and not control.done():
                    control.cancel()
            except Exception as e:
                logger.debug(f"cancelling an averaging round: {e!r}")
        try:
            opt.shutdown()
        except Exception as e:
            logger.debug(f"optimizer shutdown: {e!r}")
    if dht is not None:
        try:
            dht.shutdown()
        except Exception as e:
            logger.debug(f"DHT shutdown: {e!r}")
