"""A third training strategy, a third aggregation and a fourth dense codec, written as a new module of
cotrain's would be: each a class on cotrain's interfaces (cotrain.strategies.base.Strategy,
cotrain.algorithms.aggregation.Aggregation, a hivemind compression declared by a
cotrain.algorithms.codecs.Codec) and one registry line, its parameters included. Nothing in the engine, the
healer or the NaN guard knows them, and nothing under src/ names them.

- ``model-averaging``: local SGD. Every peer steps its own optimizer on every micro-batch; every
  ``local_steps`` of its own steps it averages its parameters with the peers it is matched with (one
  all-reduce of the parameters themselves, combined by the run's aggregation). A global step is a round.
- ``trimmed-mean``: per coordinate, the mean of the contributions left once the lowest and highest ``trim``
  of them (a parameter, a quarter by default) are dropped (none of them where that share is under one).
- ``scaled-fp16``: values divided by ``scale`` (a parameter), sent in float16 with the scale beside them,
  in hivemind's mean-std format (which every peer decodes, whatever its own codec).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
from hivemind.compression import CompressionBase, CompressionInfo, ScaledFloat16Compression
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.proto import runtime_pb2

from cotrain.algorithms.aggregation import Aggregation
from cotrain.algorithms.codecs import Codec
from cotrain.algorithms.parameters import Parameter
from cotrain.hivemind_ext.hooks import Averager
from cotrain.hivemind_ext.hosting import ServedInThread
from cotrain.hivemind_ext.reducers import RobustAveraging
from cotrain.registry import register_aggregation, register_codec, register_strategy
from cotrain.strategies.base import Progress, Strategy
from cotrain.strategies.builds import aggregation_of, grad_compression_of


class TrimmedMean(Aggregation):
    name = "trimmed-mean"
    combined = (
        0  # parts combined in this process, and the trims they were combined with (the test reads them)
    )
    trims: set[float] = set()

    def combine(self, parts: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        TrimmedMean.combined += 1
        TrimmedMean.trims.add(self.options["trim"])
        cut = int(len(parts) * self.options["trim"])
        kept = parts.sort(dim=0).values[cut : len(parts) - cut]
        return kept.mean(dim=0), None


class ScaledFloat16(CompressionBase):
    """Values divided by ``scale`` in float16, written as hivemind's mean-std float16 (means 0, scales
    ``scale``), so that hivemind's own decoder reads them."""

    compression_type = runtime_pb2.CompressionType.MEANSTD_16BIT
    compressed = 0  # tensors compressed in this process, and the scales they were compressed with
    scales: set[float] = set()

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False):
        ScaledFloat16.compressed += 1
        ScaledFloat16.scales.add(self.scale)
        values = tensor.detach().cpu().float()
        stats = [*values.shape[:-1], 1] if values.dim() else [1]
        data = (values / self.scale).clamp(-65504, 65504).to(torch.float16)
        scales = torch.full(stats, self.scale, dtype=torch.float32)
        buffer = data.numpy().tobytes() + torch.zeros(stats).numpy().tobytes() + scales.numpy().tobytes()
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=buffer,
            size=values.shape if values.dim() else [1],
            dtype=tensor.detach().cpu().numpy().dtype.name,
            requires_grad=tensor.requires_grad,
        )

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        return ScaledFloat16Compression().extract(serialized_tensor)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return 0.5


class ParameterAverager(ServedInThread, RobustAveraging, Averager):
    """An averager of the model's parameters whose reducers use the run's aggregation; it serves its
    tensors and the round they belong to."""

    def __init__(self, tensors: list[torch.Tensor], dht: Any, *, aggregation: Aggregation, **kwargs: Any):
        self.aggregation, self.round = aggregation, 0
        super().__init__(tensors, dht, **kwargs)

    def get_current_state(self):
        _, tensors, infos = super().get_current_state()
        return {"round": self.round}, tensors, infos


class ModelAveraging(Strategy):
    name = "model-averaging"

    def __init__(self, dht, run, peer, params, optimizer, scheduler, batch_size_per_step, should_stop):
        self.params = [
            p for group in params for p in (group["params"] if isinstance(group, dict) else [group])
        ]
        self._optimizer = optimizer(params)
        self._scheduler = scheduler(self._optimizer) if scheduler is not None else None
        self.local_steps, self.timeout = run.local_steps, peer.averaging_timeout
        self._batch, self._client = batch_size_per_step, bool(dht.client_mode)
        self._lock = threading.Lock()
        self.averager = ParameterAverager(
            [p.detach().clone() for p in self.params],
            dht,
            aggregation=aggregation_of(run),
            compression=grad_compression_of(peer),
            prefix=f"{run.run_id}_params",
            target_group_size=peer.target_group_size,
            min_matchmaking_time=peer.matchmaking_time,
            request_timeout=max(1.0, peer.matchmaking_time / 2),
            client_mode=self._client,
            start=True,
        )
        self.tracker = ProgressTracker(dht, f"{run.run_id}_toy", run.target_batch_size, start=True)
        self.steps, self.samples, self.started = 0, 0, time.monotonic()
        self.group, self.averaged, self.failed = 1, 0, 0
        self.last_average: dict | None = None  # the rounds the group's members sent, the averaged parameters

    # progress
    @property
    def global_step(self) -> int:
        return self.averager.round

    @property
    def progress(self) -> Progress:
        return Progress(
            swarm_step=max(self.global_step, int(self.tracker.global_epoch)),
            swarm_samples=int(self.tracker.global_progress.samples_accumulated),
            num_peers=int(self.tracker.global_progress.num_peers),
            group_size=self.group,
            rounds_averaged=self.averaged,
            rounds_failed=self.failed,
            samples_per_second=self.samples / max(time.monotonic() - self.started, 1e-3),
        )

    @property
    def batch_size_per_step(self) -> int | None:
        return self._batch

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    @property
    def client_mode(self) -> bool:
        return self._client

    # a step
    def step(self, samples: int) -> None:
        with self._lock:
            self._optimizer.step()
            if self._scheduler is not None:
                self._scheduler.step()
        self.steps, self.samples = self.steps + 1, self.samples + samples
        self.tracker.report_local_progress(self.global_step, self.samples)
        if self.steps % self.local_steps == 0:
            self._average(samples)

    def _average(self, weight: int) -> None:
        with self.averager.get_tensors() as tensors, torch.no_grad():
            for tensor, param in zip(tensors, self.params, strict=True):
                tensor.copy_(param)
        try:  # each member sends its round: the test pairs the members of one all-reduce by it
            group = self.averager.step(weight=float(weight), timeout=self.timeout, gather=self.averager.round)
        except Exception:
            group = None
        self.group = len(group) if group else 1
        if group:
            self.averaged += 1
            with self.averager.get_tensors() as tensors, torch.no_grad(), self._lock:
                for tensor, param in zip(tensors, self.params, strict=True):
                    param.copy_(tensor)
                flat = torch.cat([p.detach().reshape(-1) for p in self.params]).tolist()
            self.last_average = {"rounds": sorted(group.values()), "params": flat}
        else:
            self.failed += 1
        self.averager.round += 1

    def zero_grad(self) -> None:
        self._optimizer.zero_grad()

    # the state
    @contextlib.contextmanager
    def training_state(self) -> Iterator[tuple[torch.optim.Optimizer, Any, list[torch.Tensor]]]:
        with self._lock:
            yield self._optimizer, self._scheduler, self.params

    def state_replaced(self) -> None:
        self.tracker.report_local_progress(self.global_step, 0)

    def resumed_at(self, step: int) -> None:
        self.averager.round = int(step)
        self.state_replaced()

    def load_state_from_peers(self) -> None:
        loaded = self.averager.load_state_from_peers(timeout=self.timeout)
        if loaded is None:
            return
        metadata, tensors = loaded
        with torch.no_grad(), self._lock:
            for param, tensor in zip(self.params, tensors, strict=True):
                param.copy_(tensor)
        self.averager.round = int(metadata["round"])

    def adopt_swarm_state(self, should_stop, floor: int = 0) -> bool:
        before = self.global_step
        self.load_state_from_peers()
        return self.global_step != before

    def share_state(self, on: bool) -> None:
        self.averager.allow_state_sharing = bool(on) and not self._client

    # the end
    def cancel_rounds(self) -> None:
        pass  # each round is awaited within its step

    def shutdown(self) -> None:
        self.tracker.shutdown()
        self.averager.shutdown()

    @staticmethod
    def state_holder(dht, run, peer, model):
        raise NotImplementedError("model-averaging keeps no monitor copy of the swarm's state")


def _share(value: float) -> str:
    return "" if 0 <= value < 0.5 else f"must be in [0, 0.5), got {value}"


def _positive(value: float) -> str:
    return "" if value > 0 else f"must be positive, got {value}"


register_strategy("model-averaging", ModelAveraging)
register_aggregation(
    "trimmed-mean", TrimmedMean, {"trim": Parameter(0.25, "share cut at each end", check=_share)}
)
register_codec(
    "scaled-fp16",
    Codec(
        "dense", 2, ScaledFloat16, {"scale": Parameter(1.0, "what values are divided by", check=_positive)}
    ),
)
