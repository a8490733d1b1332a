"""Strategies, aggregations and codecs are parts.

Here, with cotrain processes; the rest in tests/unit/strategies/test_parts.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import cotrain_env, wait_until

TESTS = Path(__file__).resolve().parents[1]


PEER = """
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
import torch
import toy_parts  # registers the toy strategy, aggregation and codec
import cotrain

seed, rounds, go = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.manual_seed(seed)
true_w = torch.arange(1.0, 9.0)[:, None] / 8
model = torch.nn.Linear(8, 1)
peer = cotrain.SwarmPeer(
    model, optimizer=lambda params: torch.optim.SGD(params, lr=0.05), run_id="toy-parts",
    target_batch_size=32,
    strategy="model-averaging", aggregation="trimmed-mean", aggregation_options={"trim": 0.2},
    grad_compression="scaled-fp16", grad_compression_options={"scale": 0.125}, local_steps=4,
    initial_peers=sys.argv[5:],
    host_maddrs=["/ip4/127.0.0.1/tcp/0"], matchmaking_time=2.0, averaging_timeout=15.0,
)
print(json.dumps({"event": "ready", "maddrs": peer.maddrs}), flush=True)
while not os.path.exists(go):  # both peers are up: the first's rounds are not over before the second's start
    time.sleep(0.1)
losses = []
while peer.global_step < rounds:
    x = torch.randn(16, 8)
    loss = torch.nn.functional.mse_loss(model(x), x @ true_w + 0.01 * torch.randn(16, 1))
    loss.backward()
    losses.append(loss.item())
    if peer.step(batch_size=16, loss=losses[-1]):
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        print(json.dumps({"event": "round", "step": peer.global_step, "loss": sum(losses) / len(losses),
                          "group": peer.last_group_size, "params": flat.tolist(),
                          "averaged": peer.strategy.last_average}), flush=True)
        losses.clear()
aggregation, codec = toy_parts.TrimmedMean, toy_parts.ScaledFloat16
print(json.dumps({"event": "done", "combined": aggregation.combined, "trims": sorted(aggregation.trims),
                  "compressed": codec.compressed, "scales": sorted(codec.scales),
                  "strategy": type(peer.strategy).__name__}), flush=True)
peer.shutdown()
"""


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_strategy_an_aggregation_and_a_codec_of_ones_own_train_a_live_swarm(tmp_path):
    rounds, procs, outs, go = 8, [], [], tmp_path / "go"

    def start(seed: int, initial: list[str]) -> Path:
        out = tmp_path / f"peer{seed}.log"
        with open(out, "w") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", PEER, str(TESTS), str(seed), str(rounds), str(go), *initial],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=cotrain_env(),
                )
            )
        outs.append(out)
        return out

    try:
        first = start(0, [])
        ready = wait_until(lambda: next((e for e in _events(first) if e["event"] == "ready"), None), 120)
        second = start(1, [m for m in ready["maddrs"] if "/127.0.0.1/" in m])
        wait_until(lambda: any(e["event"] == "ready" for e in _events(second)), 120)
        go.touch()
        for proc, out in zip(procs, outs, strict=True):
            proc.wait(timeout=180)
            assert proc.returncode == 0, out.read_text()[-3000:]
        runs = [_events(out) for out in outs]
        for events in runs:
            done = events[-1]
            assert done["event"] == "done" and done["strategy"] == "ModelAveraging", events[-1]
            assert done["combined"] > 0  # this process's reducer combined parts with the toy aggregation
            assert done["trims"] == [0.2]  # ... built with the run's value of its parameter, not its default
            assert done["compressed"] > 0 and done["scales"] == [0.125]  # it sent with the toy codec's value
            steps = [e for e in events if e["event"] == "round"]
            # a peer that joined after the first round catches up with the swarm's round (it downloads it)
            assert [e["step"] for e in steps] == list(range(steps[0]["step"], rounds + 1)) and len(steps) >= 5
            assert steps[-1]["loss"] < 0.5 * steps[0]["loss"], steps
        # the all-reduces of the two together: a group of two whose members sent the same round
        averaged = [
            {json.dumps(e["averaged"]["rounds"]): e["averaged"] for e in run if e.get("averaged")}
            for run in runs
        ]
        together = [
            (a, averaged[1][key])
            for key, a in averaged[0].items()
            if key in averaged[1] and len(a["rounds"]) == 2 and len(set(a["rounds"])) == 1
        ]
        assert together, "the two peers never averaged together"
        # right after an all-reduce together both hold the group's average, to the codec's float16 rounding (a
        # reducer averages its own part exact, the other's as it arrived); under load a round can end with a
        # part missing on one side, so one such round of the two suffices, not every one
        agree = [
            torch.allclose(torch.tensor(a["params"]), torch.tensor(b["params"]), rtol=2**-10, atol=1e-6)
            for a, b in together
        ]
        assert any(agree), together
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
