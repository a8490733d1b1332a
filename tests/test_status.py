"""`cotrain status` without a swarm: an unreachable peer is one line, exit status 2, nothing left."""

from __future__ import annotations

import pytest

from conftest import LOCALHOST, Role, alive
from cotrain.status import describe

NOBODY = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWLtHHSrzMTcRbxEGb9yJoRn1SZoxdpCGQoCSqovNfATSa"


@pytest.mark.timeout(120)
def test_status_of_an_unreachable_swarm_is_one_line(tmp_path):
    role = Role(
        ["status", "--initial-peers", NOBODY, "--host-maddrs", LOCALHOST, "--startup-timeout", "10"],
        tmp_path / "status.log",
    )
    role.proc.wait(timeout=100)
    pids = role.tree()
    lines = role.text().strip().splitlines()
    assert role.proc.returncode == 2, lines
    assert lines[-1].startswith("cotrain status: error: no initial peer could be reached"), lines
    assert "Traceback" not in role.text()
    assert not alive(pids), alive(pids)


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
    from cotrain.swarm.records import EvalMetrics
    from cotrain.swarm.state import evaluation_rows

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

    from cotrain.swarm.records import LocalMetrics
    from cotrain.swarm.state import snapshot

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
