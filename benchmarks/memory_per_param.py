"""Bytes per parameter: the host (and, where a GPU is used, device) memory a lone peer of a preset holds per
parameter of its model, for each strategy.

Each (preset, strategy) runs in its own process, which builds the preset's model, joins a swarm of its own on
127.0.0.1 as ``cotrain train`` does (``SwarmPeer`` with the preset's optimizer, schedule and parameter groups,
the peer settings' defaults), and trains until the optimizers hold their state: a sync peer two global steps
(target batch of 2 samples, micro-batches of 1 x ``--seq`` tokens), a DiLoCo peer two outer rounds
(``local_steps`` 2), then computes one more micro-batch's gradients. It then reports, divided by the
model's parameter count N:

- ``host``: the PSS of the peer's whole process tree (the Python process, its averagers' and DHT's children,
  the libp2p daemon) minus that tree's PSS right after the imports (torch, transformers, hivemind: what every
  Python process using them holds whatever the model). The fixed costs of a peer (its DHT, daemon and
  averager processes, some tens of MiB) are in it: they weigh little at N of 100M and more;
- ``tensors``: the bytes of the tensors the peer's process holds, each storage counted once, by role: the
  model's parameters, their gradients, the statistics of an optimizer of the model's own parameters
  (DiLoCo's inner one), the other optimizers' statistics (hivemind's offloaded optimizer, DiLoCo's outer
  momentum), the optimizers' own copies of the parameters (hivemind's offloaded parameters; DiLoCo's global
  parameters), the NaN guard's backup, and the rest (the averagers' buffers: gradient accumulators, averaged
  gradients, DiLoCo's changes and outer state for the all-reduce);
- ``host tensors, model on a GPU``: the same less the roles that live where the model does (its parameters,
  their gradients, the inner optimizer's statistics): what a GPU peer keeps in host memory;
- ``device``: with ``--device cuda``, torch's peak of allocated CUDA memory (the model, its gradients and
  activations at micro-batch 1; hivemind's offloaded optimizer keeps its state on the host).

    python benchmarks/memory_per_param.py [--presets llama-tiny llama-150m] [--strategies sync diloco]
        [--outer-momentum 0.9 0] [--seq 16] [--device cpu]

A table, then a JSON line per run (``{"event": "bytes_per_param", ...}``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROLES = (
    "parameters",
    "gradients",
    "inner optimizer statistics",
    "optimizer statistics",
    "parameter copies",
    "NaN guard backup",
    "averagers' buffers",
)
DEVICE_ROLES = ("parameters", "gradients", "inner optimizer statistics")  # on the GPU where the model is


def tree_pss() -> int:
    """PSS in bytes of this process and all its descendants."""
    import psutil

    me = psutil.Process()
    total = 0
    for proc in [me, *me.children(recursive=True)]:
        try:
            total += proc.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def tensor_bytes_by_role(model) -> dict[str, int]:
    """The bytes of every tensor storage this process's Python objects reach, each counted once, by role."""
    import torch

    def key(t: torch.Tensor) -> tuple[int, str]:
        return t.untyped_storage().data_ptr(), t.device.type

    gc.collect()
    objects = gc.get_objects()

    # a tensor's Python object is not always tracked by gc itself (a gradient's is made on access): the
    # tensors held in tracked containers are collected too
    # (types are compared, not isinstance: an attribute lookup on some lazily importing objects imports)
    def is_tensor(x) -> bool:
        return issubclass(type(x), torch.Tensor)

    tensors = [o for o in objects if is_tensor(o)]
    for o in objects:
        if type(o) in (list, tuple):
            tensors += [x for x in o if is_tensor(x)]
        elif type(o) is dict:
            tensors += [x for x in o.values() if is_tensor(x)]
    # hivemind.Optimizer (cotrain's subclass too) is a torch optimizer whose state is its offloaded
    # optimizer's, counted there
    import hivemind

    optimizers = [
        o
        for o in objects
        if issubclass(type(o), torch.optim.Optimizer) and not issubclass(type(o), hivemind.Optimizer)
    ]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors = [t for t in tensors if t.device.type != "meta"]
    role: dict[tuple[int, str], str] = {}
    params = list(model.parameters())
    for p in params:
        role[key(p)] = "parameters"
    for p in params:
        if p.grad is not None:
            role.setdefault(key(p.grad), "gradients")
    on_model = {id(p) for p in params}
    for optimizer in optimizers:
        # an optimizer of the model's own parameters (DiLoCo's inner one) keeps its statistics where they are
        inner = all(id(p) in on_model for g in optimizer.param_groups for p in g["params"])
        for state in optimizer.state.values():
            for value in state.values() if isinstance(state, dict) else ():
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    kind = "inner optimizer statistics" if inner else "optimizer statistics"
                    role.setdefault(key(value), kind)
        for group in optimizer.param_groups:
            for p in group["params"]:
                role.setdefault(key(p), "parameter copies")
    from hivemind.utils.nested import nested_flatten

    from cotrain.engine.backup import BackupGuard

    for guard in (o for o in objects if issubclass(type(o), BackupGuard)):
        for t in [*guard.params, *nested_flatten(guard.optimizer_state or {})]:
            if is_tensor(t):
                role.setdefault(key(t), "NaN guard backup")
    sizes: dict[tuple[int, str], int] = {}
    for t in tensors:
        try:
            sizes[key(t)] = max(sizes.get(key(t), 0), t.untyped_storage().nbytes())
        except RuntimeError:  # a tensor without storage (a sparse or nested one)
            continue
    out = dict.fromkeys(ROLES, 0)
    for k, size in sizes.items():
        out[role.get(k, "averagers' buffers")] += size
    return out


def one_run(preset: str, strategy: str, seq: int, device: str, outer_momentum: float | None = None) -> dict:
    """Build a peer of ``preset`` with ``strategy``, train it until its optimizers hold their state, and
    measure it (see the module's doc)."""
    import torch

    import cotrain
    from cotrain import config as cfg
    from cotrain.models import build_model, parameter_count
    from cotrain.optim import optimizer_factory, parameter_groups, scheduler_factory

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    base = tree_pss()
    config = cfg.resolve(
        preset,
        overrides={
            "run": {
                "run_id": f"bytes-{os.getpid()}",
                "strategy": strategy,
                "target_batch_size": 2,
                "local_steps": 2,
                "warmup_steps": 1,
                **({} if outer_momentum is None else {"outer_momentum": outer_momentum}),
            },
            "peer": {
                "host_maddrs": ["/ip4/127.0.0.1/tcp/0"],
                "matchmaking_time": 1.0,
                "per_device_train_batch_size": 1,
            },
        },
    )
    run, peer_config = config.run, config.peer
    vocab = config.prepare.vocab_size or 8000
    model = build_model(run, vocab_size=vocab).to(device)
    model.train()
    n = parameter_count(model)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    peer = cotrain.SwarmPeer(
        model,
        optimizer_factory(run),
        scheduler_factory(run),
        config=(run, peer_config),
        params=parameter_groups(model, run.weight_decay),
        batch_size_per_step=1,
    )
    try:
        generator = torch.Generator().manual_seed(0)
        steps = 0
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            ids = torch.randint(3, vocab, (1, seq), generator=generator).to(device)
            loss = model(input_ids=ids, labels=ids).loss  # as a language model: memory, not learning
            loss.backward()
            if peer.global_step >= 2:  # measured with a step's gradients held, as at every step's peak
                break
            peer.step(batch_size=1, loss=float(loss))
            steps += 1
        tensors = tensor_bytes_by_role(model)
        beside = sum(v for k, v in tensors.items() if k not in DEVICE_ROLES)
        host = tree_pss() - base
        device_peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
        return {
            "event": "bytes_per_param",
            "preset": preset,
            "strategy": strategy,
            "parameters": n,
            "steps": steps,
            "global_step": int(peer.global_step),
            "host_bytes_per_param": round(host / n, 2),
            "tensor_bytes_per_param": round(sum(tensors.values()) / n, 2),
            # with the model on a GPU: what stays in host memory (the tensors of every other role)
            "host_tensor_bytes_per_param_gpu_model": round(beside / n, 2),
            "outer_momentum": run.outer_momentum if strategy == "diloco" else None,
            "by_role": {k: round(v / n, 2) for k, v in tensors.items()},
            "device": device,
            "device_peak_bytes_per_param": round(device_peak / n, 2),
        }
    finally:
        peer.shutdown()


def table(results: list[dict]) -> str:
    head = ["preset", "strategy", "parameters", "host B/param (PSS)", "tensors B/param"]
    head += ["host tensors B/param, model on a GPU", *ROLES]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [
            r["preset"],
            r["strategy"]
            + ("" if r.get("outer_momentum") is None else f", momentum {r['outer_momentum']:g}"),
            f"{r['parameters'] / 1e6:.1f}M",
            f"{r['host_bytes_per_param']:.1f}",
            f"{r['tensor_bytes_per_param']:.1f}",
            f"{r['host_tensor_bytes_per_param_gpu_model']:.1f}",
            *(f"{r['by_role'][role]:.1f}" for role in ROLES),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def one_command(preset: str, strategy: str, momentum: float | None, args: argparse.Namespace) -> list[str]:
    """One measurement's process: this script with ``--one PRESET STRATEGY``."""
    command = [sys.executable, str(Path(__file__).resolve()), "--one", preset, strategy]
    command += ["--seq", str(args.seq), "--device", args.device]
    return command + ([] if momentum is None else ["--outer-momentum", str(momentum)])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["llama-tiny", "llama-150m"])
    parser.add_argument("--strategies", nargs="+", default=["sync", "diloco"], choices=["sync", "diloco"])
    parser.add_argument("--seq", type=int, default=16, help="tokens per micro-batch of 1 sample")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--outer-momentum", type=float, nargs="+", help="DiLoCo runs: one run per outer momentum given"
    )
    parser.add_argument("--one", nargs=2, metavar=("PRESET", "STRATEGY"), help=argparse.SUPPRESS)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one:
        momentum = None if args.outer_momentum is None else args.outer_momentum[0]
        print(json.dumps(one_run(*args.one, args.seq, args.device, momentum)), flush=True)
        return 0
    results = []
    for preset in args.presets:
        runs = [(strategy, None) for strategy in args.strategies if strategy != "diloco"]
        if "diloco" in args.strategies:
            runs += [("diloco", m) for m in (args.outer_momentum or [None])]
        for strategy, momentum in runs:
            done = subprocess.run(
                one_command(preset, strategy, momentum, args), capture_output=True, text=True
            )
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode != 0 or not lines:
                print(f"{preset} {strategy}: failed (exit {done.returncode})\n{done.stderr[-3000:]}")
                return 1
            results.append(json.loads(lines[-1]))
            print(lines[-1], flush=True)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
