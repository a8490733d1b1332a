"""DiLoCo's outer rounds in one process, to screen settings of sparse rounds in minutes.

``--peers`` replicas of a preset's model (cotrain's own model, data, collator, inner optimizer and schedule)
each take ``--local-steps`` inner steps a round on micro-batches of ``--micro-batch`` from their own order of
a dataset prepared from WikiText-2's validation file (as ``convergence.py`` prepares it); their changes are
then averaged as a swarm would: densely, or through cotrain's top-k codec (``cotrain.algorithms.sparse.TopK``)
with error feedback, a butterfly's reducers (each span of chunks re-encoded by a reducer drawn at random,
``cotrain.hivemind_ext.reducers.RecordParts``, what its re-encoding leaves out kept in that reducer's buffer
times the group's size), and the outer step
(``--outer-lr``, no momentum). No network, no hivemind: what a real swarm's timing changes (groups, failed
rounds) is absent, so a setting screened here is then measured with ``convergence.py``. With the same
settings, on the tiny Llama (seed 0), the two ended 0.01-0.08 apart in held-out loss (docs/benchmarks.md).

An arm is ``dense`` or ``topk`` with ``:``-separated settings: ``decay=0.9`` (the error feedback's decay,
``--topk-feedback-decay``), ``density=0.03125``, ``bits=4``, ``union`` (reducers return the group's exact
mean of what was sent, every value any sender sent, instead of re-encoding it to k: a bound for larger
returns), ``exact=NAME`` (the parameters whose name holds NAME are sent exactly, the rest as records;
repeatable, ``,``-separated).

The vocabulary-sized matrices (a dimension the vocabulary's size: the embeddings, an untied output head) can
travel otherwise than the rest of the model, in their own error-feedback buffers: ``vdensity=D``, ``vbits=B``
and ``vdecay=X`` give them top-k records of their own settings; ``vshared`` sends, at ``vdensity``, the same
random subset of each chunk on every peer, drawn anew each round (no indices to send: at equal bytes about 5
times the values); ``vrows=F`` sends the share F of each matrix's rows of largest norm, each row in 2 bits
(a reducer per matrix re-encodes the mean); ``vrank=R`` sends each matrix's best rank-R approximation, the
mean of the peers' returned whole (a bound: no exchange of this form re-encodes its average); ``vdct=B``
sends top-k records of the matrices transformed along their rows by a DCT in blocks of B rows.

    python benchmarks/rounds_sim.py --arms dense topk topk:decay=0.9 topk:decay=0.9:exact=lm_head
    python benchmarks/rounds_sim.py --preset gpt2-tiny --seeds 2 --arms dense topk:decay=0.9

Per arm and seed: the held-out loss (128 examples of the validation split) every 5 rounds and at the end; the
last line is a JSON summary ``{"event": "rounds_sim_summary", "runs": [{"arm", "seed", "final",
"curve"}]}``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.netns import print_finished, print_started  # noqa: E402
from lib.roles import WIKITEXT, prepare_wikitext  # noqa: E402

HELD_OUT = 128  # validation examples in the held-out loss


@dataclass
class Arm:
    """How a round's changes are averaged: dense, or top-k records with the codec's settings."""

    name: str
    codec: dict = field(default_factory=dict)
    union: bool = False
    exact: tuple[str, ...] = ()
    vocab: dict = field(default_factory=dict)  # the vocabulary-sized matrices' own codec settings
    form: tuple[str, float] = ("records", 0.0)  # and how they travel (vocab_average)

    @classmethod
    def parse(cls, text: str) -> Arm:
        kind, *settings = text.split(":")
        if kind not in ("dense", "topk") or (kind == "dense" and settings):
            raise ValueError(f"an arm is dense or topk[:setting...], got {text!r}")
        arm = cls(text)
        for setting in settings:
            key, _, value = setting.partition("=")
            if key in ("decay", "density"):
                arm.codec[key] = float(value)
            elif key == "bits":
                arm.codec[key] = int(value)
            elif key == "union" and not value:
                arm.union = True
            elif key == "vshared" and not value:
                arm.form = ("shared", 0.0)
            elif key in ("vrank", "vrows", "vdct"):
                arm.form = (key[1:], float(value))
            elif key in ("vdensity", "vbits", "vdecay"):
                arm.vocab[key[1:]] = int(value) if key == "vbits" else float(value)
            elif key == "exact" and value:
                arm.exact += tuple(value.split(","))
            else:
                raise ValueError(f"unknown setting {setting!r} in arm {text!r}")
        return arm

    @property
    def sparse(self) -> bool:
        return not self.name.startswith("dense")


def spans(numel: int, chunk: int, parts: int) -> list[tuple[int, int]]:
    """The butterfly's spans: ``parts`` runs of whole chunks covering ``numel`` values."""
    chunks = math.ceil(numel / chunk)
    bounds = [min(numel, round(chunks * j / parts) * chunk) for j in range(parts + 1)]
    return list(zip(bounds, bounds[1:], strict=False))


def average(arm: Arm, codec, changes: list, feedback: list, exact, generator, mask=None):
    """The group's average of ``changes`` (flat vectors), as the arm's swarm computes it; ``feedback``
    (one buffer per peer) is updated in place."""
    import torch

    if not arm.sparse:
        return torch.stack(changes).mean(0)
    from cotrain.hivemind_ext.reducers import RecordParts
    from cotrain.strategies.overlap import add_feedback

    sent = []
    for change, buffer in zip(changes, feedback, strict=True):
        whole = add_feedback(codec, change, buffer)
        chosen = whole if mask is None else whole * mask
        decoded = codec.decode(codec.encode(chosen), whole.numel())
        decoded[exact] = whole[exact]
        buffer.copy_(whole - decoded)
        sent.append(decoded)
    mean = torch.stack(sent).mean(0)
    if arm.union:
        return mean
    n, out = len(changes), torch.empty_like(mean)
    records = torch.empty(codec.encoded_size(mean.numel()), dtype=torch.uint8)  # the parts' storage
    reducers = torch.randperm(n, generator=generator).tolist()
    for (a, b), reducer in zip(spans(mean.numel(), codec.chunk, n), reducers, strict=True):
        # the swarm's reducer of this span: re-encodes the average, keeps n times what that leaves out
        part = records[a // codec.chunk * codec.record : math.ceil(b / codec.chunk) * codec.record]
        parts = RecordParts([codec], [part], [records], feedback[reducer])
        span, keep = mean[a:b], exact[a:b]
        whole = torch.zeros(part.numel() // codec.record * codec.chunk)  # a part is whole records
        whole[: b - a] = span
        decoded = codec.decode(parts.reduced(0, whole, n), b - a)
        out[a:b] = torch.where(keep, span, decoded)
        feedback[reducer][a:b][keep] -= n * (span - decoded)[keep]  # sent exactly: nothing left out
    return out


def quantize_rows(rows):
    """Each row in 2 bits: a sign and one of two levels, the means of its magnitudes below and above their
    midpoint (the codec's 2-bit levels, one pair per row)."""
    import torch

    mag = rows.abs()
    upper = mag > ((mag.amin(1) + mag.amax(1)) / 2)[:, None]
    hi = (mag * upper).sum(1) / upper.sum(1).clamp(min=1)
    lo = (mag * ~upper).sum(1) / (~upper).sum(1).clamp(min=1)
    return torch.where(upper, hi[:, None], lo[:, None]) * rows.sign()


def top_rows(share: float):
    """A matrix's rows of largest norm (``share`` of them), each in 2 bits; the others zero."""
    import torch

    def approximate(matrix):
        keep = matrix.norm(dim=1).topk(max(1, round(share * matrix.shape[0]))).indices
        out = torch.zeros_like(matrix)
        out[keep] = quantize_rows(matrix[keep])
        return out

    return approximate


def low_rank(rank: int):
    """A matrix's best approximation of rank ``rank`` (its SVD's first terms)."""
    import torch

    def approximate(matrix):
        u, s, v = torch.linalg.svd(matrix, full_matrices=False)
        return (u[:, :rank] * s[:rank]) @ v[:rank]

    return approximate


def dct_rows(flat, shapes, block: int, inverse: bool = False):
    """The matrices of ``shapes``, laid end to end in ``flat``, transformed along their rows in blocks of
    ``block`` rows by the orthonormal DCT-II (or its inverse)."""
    import torch

    t = torch.arange(block, dtype=torch.float64)
    d = torch.cos(math.pi * (t[None, :] + 0.5) * t[:, None] / block) * math.sqrt(2 / block)
    d[0] /= math.sqrt(2)
    d = (d.T if inverse else d).float()
    out, at = torch.empty_like(flat), 0
    for shape in shapes:
        n = shape.numel()
        out[at : at + n] = torch.einsum(
            "ij,bjc->bic", d, flat[at : at + n].view(shape[0] // block, block, -1)
        ).reshape(-1)
        at += n
    return out


def per_matrix(approximate, shapes, parts, feedback, decay, generator, reencode: bool):
    """The average of the matrices of ``shapes`` (laid end to end in each peer's ``parts``), each peer
    sending ``approximate`` of its change plus its feedback; with ``reencode`` a reducer drawn at random per
    matrix sends back ``approximate`` of the mean and keeps n times what that leaves out, without it the
    mean of what was sent comes back whole (a bound)."""
    import torch

    n, update, at = len(parts), torch.zeros(parts[0].numel()), 0
    for shape in shapes:
        lo, hi = at, at + shape.numel()
        at = hi
        sent = []
        for part, buffer in zip(parts, feedback, strict=True):
            whole = (part[lo:hi] + decay * buffer[lo:hi]).view(shape[0], -1)
            approx = approximate(whole)
            buffer[lo:hi] = (whole - approx).reshape(-1)
            sent.append(approx)
        mean = torch.stack(sent).mean(0)
        update[lo:hi] = mean.reshape(-1)
        if reencode:
            back = approximate(mean)
            reducer = int(torch.randint(n, (1,), generator=generator))
            feedback[reducer][lo:hi] += n * (mean - back).reshape(-1)
            update[lo:hi] = back.reshape(-1)
    return update


def vocab_average(arm: Arm, codec, shapes, parts, feedback, generator, draw):
    """The average of the vocabulary-sized matrices (``shapes``, laid end to end in ``parts``) in the arm's
    form for them: their own top-k records, at a shared random subset, low rank, top rows, or DCT records."""
    import torch

    form, size = arm.form
    none = torch.zeros(parts[0].numel(), dtype=torch.bool)  # none of them sent exactly
    if form == "rank":
        return per_matrix(low_rank(int(size)), shapes, parts, feedback, codec.decay, generator, False)
    if form == "rows":
        return per_matrix(top_rows(size), shapes, parts, feedback, codec.decay, generator, True)
    if form == "dct":
        parts = [dct_rows(part, shapes, int(size)) for part in parts]
        update = average(arm, codec, parts, feedback, none, generator)
        return dct_rows(update, shapes, int(size), inverse=True)
    mask = None
    if form == "shared":  # the same random k of each chunk on every peer, drawn anew each round
        rows = codec.chunks(parts[0].numel())
        pick = torch.rand(rows, codec.chunk, generator=draw).topk(codec.k, dim=1).indices
        mask = torch.zeros(rows, codec.chunk).scatter_(1, pick, 1.0).reshape(-1)[: parts[0].numel()]
    return average(arm, codec, parts, feedback, none, generator, mask)


def run_arm(arm: Arm, seed: int, args, data: Path) -> dict:
    import torch

    from cotrain.algorithms.sparse import TopK
    from cotrain.config import resolve
    from cotrain.data.tokenizer import load_tokenizer
    from cotrain.models import collator_for_run, forward_loss, model_for_tokenizer
    from cotrain.optim import optimizer_factory, scheduler_factory

    run = {"max_seq_length": args.seq_length, "warmup_steps": args.warmup_steps, "total_steps": args.steps}
    config = resolve(args.preset, overrides={"run": run})
    import datasets

    tokenizer = load_tokenizer(data / "tokenizer", config.run.objective)
    train = datasets.load_dataset("parquet", data_dir=str(data / "train"), split="train")
    valid = datasets.load_dataset("parquet", data_dir=str(data / "validation"), split="train")
    collate = collator_for_run(config.run, tokenizer, seed=0)
    held_out = [collate([valid[i] for i in range(j, j + 8)]) for j in range(0, min(HELD_OUT, len(valid)), 8)]
    base = model_for_tokenizer(config.run, tokenizer)
    names = [name for name, _ in base.named_parameters()]
    sizes = [p.numel() for p in base.parameters()]
    exact = torch.cat(
        [torch.full((n,), any(s in name for s in arm.exact)) for name, n in zip(names, sizes, strict=True)]
    )
    flat = lambda model: torch.cat([p.detach().reshape(-1) for p in model.parameters()])  # noqa: E731
    glob = flat(base).clone()
    peers = []
    for i in range(args.peers):
        model = model_for_tokenizer(config.run, tokenizer)
        opt = optimizer_factory(config.run)(model.parameters())
        order = torch.Generator().manual_seed(1000 * seed + i)
        peers.append({"model": model, "opt": opt, "sched": scheduler_factory(config.run)(opt), "gen": order})
        peers[-1]["collate"] = collator_for_run(config.run, tokenizer, seed=1000 * seed + i)
        peers[-1]["order"], peers[-1]["pos"] = torch.randperm(len(train), generator=order).tolist(), 0
    vocab_size = base.get_input_embeddings().num_embeddings  # vocabulary-sized: a dimension of this size
    wide = torch.cat([torch.full((p.numel(),), vocab_size in p.shape) for p in base.parameters()])
    shapes = [p.shape for p in base.parameters() if vocab_size in p.shape]
    split = arm.sparse and (arm.vocab or arm.form[0] != "records")
    groups = [wide.nonzero().squeeze(1), (~wide).nonzero().squeeze(1)] if split else [None]
    codecs = [TopK(**{**arm.codec, **arm.vocab}), TopK(**arm.codec)] if split else [TopK(**arm.codec)]
    if not arm.sparse:
        codecs = [None]
    feedback = [
        [torch.zeros(glob.numel() if g is None else g.numel()) for _ in peers] if arm.sparse else []
        for g in groups
    ]
    generator = torch.Generator().manual_seed(seed)

    def load(model, values):
        with torch.no_grad():
            for p, v in zip(model.parameters(), values.split(sizes), strict=True):
                p.copy_(v.view_as(p))

    def held_out_loss() -> float:
        load(base, glob)
        with torch.no_grad():
            return sum(float(forward_loss(base, b)) for b in held_out) / len(held_out)

    curve, began = [], time.monotonic()
    rounds = args.steps // args.local_steps
    for r in range(rounds):
        changes = []
        for peer in peers:
            model, opt = peer["model"], peer["opt"]
            for _ in range(args.local_steps):
                if peer["pos"] + args.micro_batch > len(peer["order"]):
                    peer["order"], peer["pos"] = torch.randperm(len(train), generator=peer["gen"]).tolist(), 0
                rows = peer["order"][peer["pos"] : peer["pos"] + args.micro_batch]
                peer["pos"] += args.micro_batch
                forward_loss(model, peer["collate"]([train[i] for i in rows])).backward()
                if config.run.max_grad_norm > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), config.run.max_grad_norm)
                opt.step()
                peer["sched"].step()
                opt.zero_grad()
            changes.append(glob - flat(model))
        for j, (group, codec) in enumerate(zip(groups, codecs, strict=True)):
            if group is None:
                glob.sub_(average(arm, codec, changes, feedback[j], exact, generator), alpha=args.outer_lr)
            elif j == 0:  # the vocabulary-sized matrices
                parts, draw = [c[group] for c in changes], torch.Generator().manual_seed(10_000 * seed + r)
                update = vocab_average(arm, codec, shapes, parts, feedback[j], generator, draw)
                glob[group] -= args.outer_lr * update
            else:
                parts = [c[group] for c in changes]
                glob[group] -= args.outer_lr * average(
                    arm, codec, parts, feedback[j], exact[group], generator
                )
        for peer in peers:
            load(peer["model"], glob)
        if (r + 1) % 5 == 0 or r + 1 == rounds:
            curve.append((r + 1, held_out_loss()))
            print(f"  {arm.name}, seed {seed}: round {r + 1}, held-out {curve[-1][1]:.4f}", flush=True)
    print(f"{arm.name}, seed {seed}: {curve[-1][1]:.4f} in {time.monotonic() - began:.0f} s", flush=True)
    return {"arm": arm.name, "seed": seed, "final": curve[-1][1], "curve": curve}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", nargs="+", default=["dense", "topk"], help="dense, topk[:decay=D:...] (doc)")
    ap.add_argument("--preset", default="llama-tiny")
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--local-steps", type=int, default=10, help="inner steps per round (H)")
    ap.add_argument("--steps", type=int, default=300, help="inner steps per peer (the schedule)")
    ap.add_argument("--warmup-steps", type=int, default=10)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-length", type=int, default=64)
    ap.add_argument("--valid-fraction", type=float, default=0.05)
    ap.add_argument("--outer-lr", type=float, default=1.0)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--data", help="a dataset prepared from WikiText-2 valid (default: prepare one)")
    ap.add_argument("--json", help="write the summary here too")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    arms = [Arm.parse(a) for a in args.arms]

    import torch

    torch.set_num_threads(args.threads)
    started = print_started()
    with tempfile.TemporaryDirectory(prefix="cotrain-rounds-sim-") as tmp:
        data = Path(args.data) if args.data else Path(tmp) / "data"
        if not args.data:
            if not WIKITEXT.exists():
                sys.exit(f"{WIKITEXT} not found (give --data)")
            prepare_wikitext(data, args)
        seeds = range(args.first_seed, args.first_seed + args.seeds)
        runs = [run_arm(arm, seed, args, data) for seed in seeds for arm in arms]
    summary = {"event": "rounds_sim_summary", "runs": runs}
    if args.json:
        Path(args.json).write_text(json.dumps(summary))
    print_finished(started)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
