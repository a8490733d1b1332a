"""`cotrain status` without a swarm.

Here, in the test process alone; the rest in tests/live/test_status.py."""

from __future__ import annotations

import pytest

from cotrain.status import describe


def test_status_needs_initial_peers(capsys):
    from cotrain.cli import main

    assert main(["status"]) == 2
    assert "--initial-peers is required" in capsys.readouterr().err


def test_describe_prints_the_step_progress_and_peers():
    state = {
        "run_id": "r",
        "global_step": 7,
        "num_peers": 1,
        "num_clients": 0,
        "samples_accumulated": 16,
        "target_batch_size": 64,
        "samples_per_second": 8.0,
        "eta_seconds": 6.0,
        "peers": [
            {
                "short_id": "...abcdefgh",
                "client_mode": False,
                "step": 7,
                "samples_per_second": 8.0,
                "contribution": 320,
                "seconds_ago": 1.0,
            }
        ],
    }
    text = describe(state)
    assert "run r: global step 7" in text and "16 of 64 samples (25%)" in text and "ETA 6 s" in text
    assert "...abcdefgh" in text and "320" in text


def test_status_shows_each_evaluation_peers_latest_result_newest_first():
    from cotrain.net.metrics import EvalMetrics
    from cotrain.snapshot import evaluation_rows

    def record(step: float, loss: float, peer: str, **extra) -> EvalMetrics:
        return EvalMetrics(
            step=step, loss=loss, perplexity=2.0, lm_loss=0.7, examples=64, tokens=900, time=100.0 + step,
            peer_id=peer, **extra,
        )  # fmt: skip

    rows = evaluation_rows(
        {
            b"a": record(3, 8.9, "12D3KooW" + "A" * 44),
            b"b": record(5, 8.6, "12D3KooW" + "B" * 44, mlm_accuracy=0.25, sop_accuracy=0.5),
        }
    )
    assert [r["step"] for r in rows] == [5, 3]
    state = {
        "run_id": "r", "global_step": 5, "num_peers": 0, "num_clients": 0, "samples_accumulated": 0,
        "target_batch_size": 64, "samples_per_second": 0.0, "eta_seconds": None, "peers": [],
        "evaluations": rows,
    }  # fmt: skip
    lines = describe(state).splitlines()
    assert lines[-2] == (
        "evaluation by ...BBBBBBBB at step 5: held-out loss 8.6000, perplexity 2.00, "
        "masked-token accuracy 0.250, sentence-order accuracy 0.500 (64 examples)"
    )
    assert lines[-1].startswith("evaluation by ...AAAAAAAA at step 3: held-out loss 8.9000")


def test_status_ages_out_a_trainer_that_left():
    """Two trainers train; a third left 96 s ago. Its metrics record is still in the DHT (metrics are kept
    600 s by default) but its progress record is gone (hivemind clears it on shutdown, and it expires
    60 s after the last refresh otherwise): it is no peer and adds no throughput."""
    from hivemind.optim.progress_tracker import LocalTrainingProgress

    from cotrain.net.metrics import LocalMetrics
    from cotrain.snapshot import snapshot

    now = 1_000.0

    def metrics(step: int, sps: float, t: float, peer: str) -> LocalMetrics:
        return LocalMetrics(
            step=step, samples_per_second=sps, samples_accumulated=64, loss=3.0, mini_steps=8, group_size=3,
            time=t, peer_id="12D3KooW" + peer * 44,
        )  # fmt: skip

    def progress(epoch: int, sps: float, t: float) -> LocalTrainingProgress:
        return LocalTrainingProgress(
            peer_id=b"\x00", epoch=epoch, samples_accumulated=8, samples_per_second=sps, time=t,
            client_mode=False,
        )  # fmt: skip

    records = {
        b"a": metrics(9, 10.0, now - 5, "A"),
        b"b": metrics(9, 12.0, now - 5, "B"),
        b"gone": metrics(8, 30.0, now - 96, "G"),
    }
    live = {b"a": progress(10, 10.0, now - 2), b"b": progress(10, 12.0, now - 3)}
    state = snapshot("r", 64, records, live, now=now)
    assert state["num_peers"] == 2 and state["departed_peers"] == 1
    assert {p["peer_id"][-1] for p in state["peers"]} == {"A", "B"}
    assert state["samples_per_second"] == pytest.approx(22.0)
    assert state["global_step"] == 10 and state["samples_accumulated"] == 16
    assert "peers: 2 (0 in client mode; 1 left recently)" in describe(state)

    everyone_left = snapshot("r", 64, records, {}, now=now + 60)
    assert everyone_left["num_peers"] == 0 and everyone_left["samples_per_second"] == 0.0
    assert everyone_left["departed_peers"] == 3 and everyone_left["eta_seconds"] is None
    assert everyone_left["global_step"] == 9  # the last step any trainer reported


def _diloco_records(now: float):
    from hivemind.optim.progress_tracker import LocalTrainingProgress

    from cotrain.net.metrics import LocalMetrics

    def metrics(peer: str, inner: int, sent: int) -> LocalMetrics:
        return LocalMetrics(
            step=4, samples_per_second=10.0, samples_accumulated=640, loss=16.0, mini_steps=8, group_size=2,
            time=now - 3, peer_id="12D3KooW" + peer * 44, inner_steps=inner, round_bytes=sent,
        )  # fmt: skip

    def progress(samples: int) -> LocalTrainingProgress:
        return LocalTrainingProgress(
            peer_id=b"\x00", epoch=4, samples_accumulated=samples, samples_per_second=10.0, time=now,
            client_mode=False,
        )  # fmt: skip

    records = {b"a": metrics("A", 20, 3_500_000), b"b": metrics("B", 20, 3_400_000)}
    return records, {b"a": progress(40), b"b": progress(40)}


def test_a_diloco_swarm_shows_outer_rounds_inner_steps_and_bytes_per_round():
    """With diloco a global step is an outer round of local_steps x target_batch_size samples: the snapshot's
    progress and ETA count toward it, and the view carries the inner steps and the bytes each peer sent."""
    from cotrain.snapshot import snapshot

    now = 1_000.0
    records, live = _diloco_records(now)
    state = snapshot("r", 64, records, live, now=now, strategy="diloco", local_steps=5)
    assert state["strategy"] == "diloco" and state["local_steps"] == 5
    assert state["step_samples"] == 320 and state["target_batch_size"] == 64
    assert state["samples_accumulated"] == 80 and state["eta_seconds"] == pytest.approx(12.0)  # 240 / 20
    assert state["inner_steps"] == 20
    assert state["round_bytes"] == 3_500_000 and state["round_bytes_total"] == 6_900_000
    assert {(p["inner_steps"], p["round_bytes"]) for p in state["peers"]} == {
        (20, 3_500_000),
        (20, 3_400_000),
    }
    text = describe(state)
    assert text.splitlines()[0] == "run r: outer round 4 (strategy diloco)"
    assert (
        "a round every 5 target batches (5 x 64 samples of the swarm), 20 inner steps so far (the most"
        in text
    )
    assert "last round sent 3.5 MB per peer (6.9 MB in all)" in text
    assert "next round: 80 of 320 samples (25%)" in text
    assert "sent/round" in text and "3.4 MB" in text and "sparse rounds" not in text
    topk = {"outer_compression": "topk", "topk_density": 1 / 64, "topk_bits": 2, "topk_feedback_decay": 0.9}
    sparse = describe({**state, **topk})
    assert "sparse rounds: the top 1.56% of each chunk in 2 bits, error feedback x 0.9" in sparse

    sync = snapshot("r", 64, records, live, now=now)  # the same records read as a sync run's
    assert sync["strategy"] == "sync" and sync["step_samples"] == 64
    assert "inner_steps" not in sync and "round_bytes" not in sync
    assert all("round_bytes" not in p for p in sync["peers"])
    text = describe(sync)
    assert text.splitlines()[0] == "run r: global step 4 (strategy sync)"
    assert "next step: 80 of 64 samples" in text and "sent/round" not in text and "MB" not in text


def test_the_monitor_rows_and_the_dashboard_json_name_the_strategy():
    from cotrain.dashboard.view import SwarmView
    from cotrain.roles.monitor import aggregate, step_log_line

    records, _ = _diloco_records(1_000.0)
    line = aggregate(4, records, "diloco")
    assert line["strategy"] == "diloco" and line["inner_steps"] == 20
    assert line["round_bytes"] == 3_500_000 and line["round_bytes_total"] == 6_900_000
    assert line["loss"] == pytest.approx(2.0) and line["max_group_size"] == 2
    assert step_log_line(line).endswith(
        "| 20 inner steps (most of a peer) | last round sent 3.5 MB per peer, 6.9 MB in all"
    )
    sync = aggregate(4, records)
    assert sync["strategy"] == "sync" and "inner_steps" not in sync and "round_bytes" not in sync
    assert step_log_line(sync).endswith("samples/s")

    view = SwarmView("r", "cotrain train ...", 64, "diloco", 5)
    view.add_step(line)
    data = view.to_json()
    assert (data["strategy"], data["local_steps"], data["step_samples"]) == ("diloco", 5, 320)
    assert data["steps"][0]["round_bytes"] == 3_500_000
    data = SwarmView("r", "cotrain train ...", 64).to_json()
    assert (data["strategy"], data["local_steps"], data["step_samples"]) == ("sync", 1, 64)
