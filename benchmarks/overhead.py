"""Overhead of a lone cotrain peer: samples/s of `cotrain train` alone versus a plain PyTorch loop.

Both arms train the same tiny ALBERT (``cotrain.models.build_model``) on the same examples in the same order
(the prepared dataset read as `cotrain train` reads it, ``ExampleStream`` + ``AlbertCollator`` through
``cotrain.engine.batches``), with the same number of torch threads, and do the same work: micro-batches
of 8, forward, backward, ``loss.item()``, gradient clipping per micro-batch, gradients accumulated to the
target batch (64 in albert-tiny), then one LAMB step (``cotrain.optim.optimizer_factory``, its statistics
started the way hivemind starts them) and one LR-schedule step per target batch. Their losses agree.

- plain: a subprocess running that loop; the first ``--warmup-steps`` global steps are not timed.
- cotrain: the real CLI, ``python -m cotrain train --preset albert-tiny --host-maddrs /ip4/127.0.0.1/tcp/0
  ...`` with no initial peers: the code path of a swarm (hivemind.Optimizer, DHT, averager processes).
  Timed from the trainer's log line ``step W | ...`` (W = ``--warmup-steps``) to its last ``step N | ...``
  line; the samples are the difference of the lines' ``contribution`` counts (hivemind may end a lone
  peer's global step a little early), so start-up is excluded.

Arms alternate (plain, cotrain, plain, cotrain, ...) and the ratio is the median over pairs. Over each
timed window the script reads the CPU time of every process of the arm and of the whole machine: the
difference, "other load", is work by other programs, which on 2 cores decides the result. It waits for an
idle machine before each run and runs a pair again when other load showed up during it (``--retries``).

    python benchmarks/overhead.py [--repeats 3] [--steps 10] [--threads 2] [-- EXTRA COTRAIN TRAIN FLAGS]

On a GPU, the same comparison for a real model in mixed precision (both arms autocast, fp16 with loss
scaling; the plain loop keeps LAMB on the GPU, the peer steps hivemind's offloaded LAMB on the CPU as in a
swarm):

    python benchmarks/overhead.py --preset albert-large-v2 --device cuda --precision bf16 \
        --micro-batch 32 --accumulation 4 --steps 5 --warmup-steps 1 --threads 8 --dataset-path DATA
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

STEP_LINE = re.compile(
    r"step (\d+) \| loss (\S+) \| averaged with (\d+) peers \| (\S+) samples/s \| contribution (\d+) samples"
)
TIMING_STARTS = "timing starts"
GOAL = 0.95
NOISY = 0.15  # cores used by other processes during a timed window that make a pair unreliable


# --------------------------------------------------------------------------------------------- CPU accounting


@dataclass
class CpuSnapshot:
    """CPU seconds used so far by the machine and by each process of one arm's process tree."""

    wall: float
    machine: float
    procs: dict[int, tuple[str, float]] = field(default_factory=dict)  # pid -> (label, cpu seconds)


def busy_seconds() -> float:
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


def label_tree(root: psutil.Process, cli: bool) -> dict[int, str]:
    """Name the processes of an arm: supervisor, trainer (the worker), DHT (p2pd's parent), averagers, ..."""
    labels: dict[int, str] = {}
    try:
        for proc in [root, *root.children(recursive=True)]:
            labels[proc.pid] = proc.name()
        if not cli:
            labels[root.pid] = "plain loop"
            return labels
        labels[root.pid] = "supervisor"
        workers = root.children()
        if not workers:
            return labels
        worker = workers[0]
        labels[worker.pid] = "trainer (main process)"
        forked = sorted(
            (p for p in worker.children() if p.name().startswith("python")), key=lambda p: p.create_time()
        )
        averagers = []
        for proc in forked:
            if any(c.name() == "p2pd" for c in proc.children()):
                labels[proc.pid] = "DHT process"
            else:
                averagers.append(proc)
        names = ["state averager", "gradient averager"]
        if len(averagers) != len(names):
            names = [f"forked child {i}" for i in range(len(averagers))]
        for proc, name in zip(averagers, names, strict=True):
            labels[proc.pid] = name
    except psutil.Error:
        pass
    return labels


def snapshot(root_pid: int, cli: bool) -> CpuSnapshot:
    snap = CpuSnapshot(wall=time.perf_counter(), machine=busy_seconds())
    try:
        root = psutil.Process(root_pid)
    except psutil.Error:
        return snap
    for pid, label in label_tree(root, cli).items():
        try:
            t = psutil.Process(pid).cpu_times()
            snap.procs[pid] = (label, t.user + t.system)
        except psutil.Error:
            pass
    return snap


@dataclass
class Window:
    seconds: float
    samples: int
    loss: float
    cores: dict[str, float]  # label -> cores used during the window (CPU seconds / wall seconds)
    other: float  # cores used by processes outside this arm

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds


def wait_for_quiet(max_wait: float, threshold: float = 0.25) -> float:
    """Wait (up to max_wait seconds) until the machine is idle: other work on a 2-core machine would decide
    the result. Returns the load (busy cores) last seen."""
    deadline = time.monotonic() + max_wait
    quiet_for = 0
    while True:
        before, t0 = busy_seconds(), time.perf_counter()
        time.sleep(1.0)
        load = (busy_seconds() - before) / (time.perf_counter() - t0)
        quiet_for = quiet_for + 1 if load < threshold else 0
        if quiet_for >= 2 or time.monotonic() > deadline:
            return load


def window(start: CpuSnapshot, end: CpuSnapshot, samples: int, loss: float) -> Window:
    seconds = end.wall - start.wall
    cores: dict[str, float] = {}
    for pid, (label, cpu) in end.procs.items():
        if pid in start.procs:
            cores[label] = cores.get(label, 0.0) + (cpu - start.procs[pid][1]) / seconds
    other = (end.machine - start.machine) / seconds - sum(cores.values())
    return Window(seconds, samples, loss, cores, max(0.0, other))


# --------------------------------------------------------------------------------------------------- the arms


def join_articles(text_file: str, out_file: Path) -> Path:
    """A WikiText file with each article's paragraphs joined into one line (headings left out): WikiText-2's
    paragraphs average about 200 tokens, whole articles fill examples of 512, the large presets' length."""
    from cotrain.data.corpus import wikitext_articles

    out_file.write_text("\n\n".join(wikitext_articles(text_file)) + "\n", encoding="utf-8")
    return out_file


def prepare(out_dir: Path, text_file: str | None, max_length: int, whole_articles: bool = False) -> None:
    from cotrain.data import prepare_from_source

    if text_file and whole_articles:
        text_file = str(join_articles(text_file, out_dir.parent / "articles.txt"))
    prepare_from_source(
        demo=text_file is None,
        text_files=[text_file] if text_file else None,
        out_dir=str(out_dir),
        max_length=max_length,
        seed=0,
        tokenizer_path=None,
        vocab_size=8000,
        progress=False,
    )


def run_config(args: argparse.Namespace):
    """The run settings both arms use: the preset's, with --target-batch-size when given."""
    from cotrain.config import resolve

    overrides = {"run": {"target_batch_size": args.target_batch_size}} if args.target_batch_size else None
    return resolve(preset=args.preset, overrides=overrides).run


def plain_worker(args: argparse.Namespace) -> None:
    """The baseline loop (runs in a subprocess); prints TIMING_STARTS after warm-up, then one JSON line.

    It runs what `cotrain train` runs for each step of its engine (the engine's own micro-steps:
    --accumulation micro-batches under autocast, loss scaling in fp16, unscale; then the engine's clip and
    its check for a non-finite step) with none of the swarm: the gradients are accumulated on the training
    device and LAMB steps there once per target batch."""
    import torch
    from hivemind.optim.state_averager import initialize_optimizer_state_

    from cotrain.data import AlbertCollator, ExampleStream
    from cotrain.engine import accumulate_gradients, batches, gradient_norm
    from cotrain.host.hardware import Precision
    from cotrain.models import build_model, forward_loss
    from cotrain.optim import optimizer_factory, parameter_groups, scheduler_factory

    torch.set_num_threads(args.threads)
    run = run_config(args)
    device = torch.device(args.device)
    precision = Precision(device, fp16=args.precision == "fp16", bf16=args.precision == "bf16")
    micro, accumulation = args.micro_batch, args.accumulation
    per_update = run.target_batch_size // (micro * accumulation)
    if per_update * micro * accumulation != run.target_batch_size:
        raise SystemExit("the target batch size must be a multiple of --micro-batch x --accumulation")
    data = ExampleStream(args.dataset_path, seed=args.seed)  # what `cotrain train` reads, in its order
    model = build_model(run, vocab_size=len(data.tokenizer), pad_token_id=data.tokenizer.pad_token_id)
    model.to(device).train()
    opt = optimizer_factory(run)(parameter_groups(model, run.weight_decay))
    # hivemind.Optimizer starts its optimizer's statistics with one zero-gradient step (LAMB's step count then
    # starts at 1, which changes its bias correction): do the same, so that both arms compute the same thing
    initialize_optimizer_state_(opt)
    scheduler = scheduler_factory(run)(opt)
    params = list(model.parameters())
    accumulators = [torch.zeros_like(p) for p in params]
    collator = AlbertCollator(data.tokenizer, mlm_probability=run.mlm_probability, seed=args.seed)
    stream = batches(data, micro, collator, args.seed)

    def global_step() -> float:
        loss_sum, steps = 0.0, 0
        for _ in range(per_update):
            step_loss = accumulate_gradients(model, stream, accumulation, device, precision, forward_loss)
            grad_norm = gradient_norm(params, run.max_grad_norm)
            # a non-finite step (an fp16 overflow) is skipped, as cotrain does
            if math.isfinite(step_loss) and math.isfinite(grad_norm):
                with torch.no_grad():
                    for acc, p in zip(accumulators, params, strict=True):
                        acc.add_(p.grad)
                loss_sum, steps = loss_sum + step_loss, steps + 1
            opt.zero_grad()
        with torch.no_grad():
            for acc, p in zip(accumulators, params, strict=True):
                p.grad = acc.div_(max(steps, 1))
        opt.step()
        scheduler.step()
        for acc, p in zip(accumulators, params, strict=True):
            p.grad = None
            acc.zero_()
        return loss_sum / max(steps, 1)

    for _ in range(args.warmup_steps):
        global_step()
    print(TIMING_STARTS, flush=True)
    for _ in range(args.steps - args.warmup_steps):
        loss = global_step()
    samples = (args.steps - args.warmup_steps) * run.target_batch_size
    print(json.dumps({"samples": samples, "loss": loss}), flush=True)


def plain_command(args: argparse.Namespace, dataset: Path) -> list[str]:
    """The plain loop's process: this script with ``--plain-worker`` and the same work as the peer's."""
    cmd = [sys.executable, __file__, "--plain-worker", "--dataset-path", str(dataset)]
    cmd += ["--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps)]
    cmd += ["--threads", str(args.threads), "--micro-batch", str(args.micro_batch)]
    cmd += ["--preset", args.preset, "--device", args.device, "--precision", args.precision]
    cmd += ["--accumulation", str(args.accumulation), "--target-batch-size", str(args.target_batch_size)]
    return cmd


def run_plain(args: argparse.Namespace, dataset: Path) -> Window:
    cmd = plain_command(args, dataset)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    start = result = None
    for line in proc.stdout:
        if line.startswith(TIMING_STARTS):
            start = snapshot(proc.pid, cli=False)
        elif line.startswith("{"):
            end = snapshot(proc.pid, cli=False)
            result = json.loads(line)
    if proc.wait() != 0 or start is None or result is None:
        raise RuntimeError(f"the plain loop failed (exit code {proc.returncode}): {' '.join(cmd)}")
    return window(start, end, result["samples"], result["loss"])


def cotrain_command(args: argparse.Namespace, dataset: Path, output_dir: Path, run_id: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "cotrain",
        "train",
        "--preset",
        args.preset,
        "--run-id",
        run_id,
        "--host-maddrs",
        "/ip4/127.0.0.1/tcp/0",
        "--dataset-path",
        str(dataset),
        "--output-dir",
        str(output_dir),
        "--torch-threads",
        str(args.threads),
        "--per-device-train-batch-size",
        str(args.micro_batch),
        "--max-steps",
        str(args.steps),
        "--gradient-accumulation-steps",
        str(args.accumulation),
        "--devices",
        args.device,
        *([f"--{args.precision}"] if args.precision != "fp32" else []),
        *(["--target-batch-size", str(args.target_batch_size)] if args.target_batch_size else []),
        *args.cotrain_args,
    ]


def run_cotrain(args: argparse.Namespace, dataset: Path, output_dir: Path, run_id: str) -> Window:
    """Run a lone `cotrain train` peer; time its per-global-step log lines as they arrive."""
    cmd = cotrain_command(args, dataset, output_dir, run_id)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    start = end = None
    first_contribution = last_contribution = 0
    loss, steps, log = float("nan"), [], []
    try:
        for line in proc.stdout:
            log.append(line)
            m = STEP_LINE.search(line)
            if not m:
                continue
            step = int(m.group(1))
            steps.append(step)
            if step == args.warmup_steps:
                start, first_contribution = snapshot(proc.pid, cli=True), int(m.group(5))
            elif step > args.warmup_steps and start is not None:
                end, last_contribution, loss = (
                    snapshot(proc.pid, cli=True),
                    int(m.group(5)),
                    float(m.group(2)),
                )
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    if rc != 0 or start is None or end is None:
        sys.stderr.write("".join(log[-30:]))
        raise RuntimeError(f"cotrain train exited with {rc} after logging steps {steps}: {' '.join(cmd)}")
    return window(start, end, last_contribution - first_contribution, loss)


# ----------------------------------------------------------------------------------------------------- report


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = psutil.virtual_memory().total / 2**30
    return f"{os.cpu_count()} cores ({cpu}), {memory:.0f} GiB, {platform.platform()}"


def device_name(device: str) -> str:
    import torch

    if not device.startswith("cuda"):
        return "the CPU"
    props = torch.cuda.get_device_properties(torch.device(device))
    return f"{props.name} ({props.total_memory / 2**30:.0f} GiB), torch {torch.__version__}"


def print_report(args: argparse.Namespace, rows: list[tuple[Window, Window]], seconds: float) -> float:
    """Print the table (Markdown) and what each process of the lone peer used; return the median ratio."""
    now = datetime.datetime.now().astimezone()
    print()
    print(f"machine: {machine()}")
    print(f"date: {now:%Y-%m-%d %H:%M %Z}; python {platform.python_version()}")
    print(
        f"{args.preset} ({run_config(args).target_batch_size} samples per global step), {args.precision} on "
        f"{device_name(args.device)}, micro-batch {args.micro_batch} x {args.accumulation} accumulated, "
        f"{args.threads} torch threads, global steps {args.warmup_steps + 1}..{args.steps} timed in each run"
    )
    print()
    print(
        "| pair | plain samples/s | cotrain samples/s | ratio | other load, cores (plain / cotrain) "
        "| final loss (plain / cotrain) |"
    )
    print("|---|---|---|---|---|---|")
    for i, (plain, lone) in enumerate(rows, 1):
        noisy = " (other load)" if max(plain.other, lone.other) > NOISY else ""
        print(
            f"| {i}{noisy} | {plain.samples_per_s:.1f} | {lone.samples_per_s:.1f} "
            f"| {lone.samples_per_s / plain.samples_per_s:.3f} | {plain.other:.2f} / {lone.other:.2f} "
            f"| {plain.loss:.3f} / {lone.loss:.3f} |"
        )
    clean = [(p, c) for p, c in rows if max(p.other, c.other) <= NOISY] or rows
    median = statistics.median(c.samples_per_s / p.samples_per_s for p, c in clean)
    plain_median = statistics.median(p.samples_per_s for p, _ in clean)
    lone_median = statistics.median(c.samples_per_s for _, c in clean)
    which = "median" if len(clean) == len(rows) else f"median of the {len(clean)} pairs without other load"
    print(f"| {which} | {plain_median:.1f} | {lone_median:.1f} | **{median:.3f}** | | |")
    print()
    labels = sorted({k for _, c in clean for k in c.cores}, key=lambda k: -clean[0][1].cores.get(k, 0.0))
    print("CPU used during the timed windows (cores, median over those pairs):")
    print(f"  plain loop: {statistics.median(p.cores.get('plain loop', 0.0) for p, _ in clean):.2f}")
    for label in labels:
        print(f"  cotrain, {label}: {statistics.median(c.cores.get(label, 0.0) for _, c in clean):.2f}")
    print()
    verdict = "met" if median >= GOAL else "NOT met"
    print(f"goal: ratio >= {GOAL}: {verdict} (median {median:.3f}; the benchmark took {seconds:.0f} s)")
    return median


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="pairs of runs (plain, cotrain), alternating")
    parser.add_argument("--steps", type=int, default=10, help="global steps per run (the peer's --max-steps)")
    parser.add_argument("--warmup-steps", type=int, default=2, help="global steps excluded from the timing")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in both arms")
    parser.add_argument("--micro-batch", type=int, default=8, help="samples per micro-batch in both arms")
    parser.add_argument(
        "--accumulation", type=int, default=1, help="micro-batches per optimizer.step (both arms)"
    )
    parser.add_argument("--preset", default="albert-tiny", help="the model and run settings (both arms)")
    parser.add_argument(
        "--target-batch-size", type=int, default=0, help="samples per global step (default: the preset's)"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (both arms)")
    parser.add_argument("--precision", choices=("fp32", "fp16", "bf16"), default="fp32", help="both arms")
    parser.add_argument(
        "--quiet-wait", type=float, default=20.0, help="seconds to wait for an idle machine before each run"
    )
    parser.add_argument(
        "--retries", type=int, default=2, help="pairs run again (in all) when other processes used the CPU"
    )
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--dataset-path", help="a prepared dataset (default: the demo corpus, prepared here)")
    parser.add_argument("--text-file", help="prepare this text file (e.g. WikiText-2), not the demo corpus")
    parser.add_argument(
        "--whole-articles",
        action="store_true",
        help="with --text-file (WikiText): one document per article rather than per paragraph, so that "
        "examples fill the preset's sequence length",
    )
    parser.add_argument("--plain-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("cotrain_args", nargs="*", help="extra flags for `cotrain train` (after --)")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.steps <= args.warmup_steps and not args.plain_worker:
        parser.error("--steps must exceed --warmup-steps")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plain_worker:
        plain_worker(args)
        return 0

    started = time.monotonic()
    rows: list[tuple[Window, Window]] = []
    with tempfile.TemporaryDirectory(prefix="cotrain-overhead-") as tmp:
        dataset = Path(args.dataset_path) if args.dataset_path else Path(tmp) / "data"
        if not args.dataset_path:
            print(f"preparing {args.text_file or 'the demo corpus'} ...", flush=True)
            prepare(dataset, args.text_file, run_config(args).max_seq_length, args.whole_articles)
        retries = args.retries
        while len(rows) < args.repeats:
            r = len(rows) + 1
            wait_for_quiet(args.quiet_wait)
            plain = run_plain(args, dataset)
            print(f"run {r} plain:   {plain.samples_per_s:6.1f} samples/s", end="", flush=True)
            wait_for_quiet(args.quiet_wait)
            lone = run_cotrain(args, dataset, Path(tmp) / f"out{r}", run_id=f"overhead{os.getpid()}r{r}")
            print(f", cotrain: {lone.samples_per_s:6.1f} samples/s", flush=True)
            if max(plain.other, lone.other) > NOISY and retries > 0:
                retries -= 1
                print(f"  other processes used {max(plain.other, lone.other):.2f} cores meanwhile: again")
                continue
            rows.append((plain, lone))
    print_report(args, rows, time.monotonic() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
