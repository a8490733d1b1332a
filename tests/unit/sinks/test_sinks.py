"""Metric sinks, the swarm snapshot, the dashboard server and the demo's loss curve, without a swarm."""

from __future__ import annotations

import json
import urllib.request

import pytest

from cotrain.net.metrics import LocalMetrics
from cotrain.sinks import JsonlSink, build_sinks
from cotrain.snapshot import snapshot

ROWS = [
    {
        "step": s,
        "loss": 6.0 - 0.5 * s,
        "alive_peers": 2,
        "samples": 64 * s,
        "samples_per_second": 20.0 + s,
        "max_group_size": 2,
        "client_peers": 0,
        "time": 1.0e9 + s,
    }
    for s in range(1, 6)
]


def test_jsonl_sink_appends_one_object_per_step(tmp_path):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    for row in ROWS:
        sink.write(row["step"], row)
    sink.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == ROWS


def test_tensorboard_sink_writes_events_tensorboard_reads(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sinks = build_sinks(tmp_path / "out", "tb-run", tensorboard_dir=str(tmp_path / "tb"))
    assert len(sinks.sinks) == 2, "the TensorBoard sink did not start"
    for row in ROWS:
        sinks.write(row["step"], row)
    sinks.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"swarm/loss", "swarm/samples_per_second", "swarm/alive_peers"} <= set(tags), tags
    loss = events.Scalars("swarm/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4, 5]
    assert [round(e.value, 4) for e in loss] == [r["loss"] for r in ROWS]
    assert "swarm/time" not in tags and "swarm/step" not in tags


def test_prometheus_sink_text_parses():
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from cotrain.sinks.prometheus import PrometheusSink

    sink = PrometheusSink("prom-run")
    sink.write(5, ROWS[-1])
    values = {
        s.name: s.value
        for family in text_string_to_metric_families(sink.text().decode())
        for s in family.samples
    }
    assert values["cotrain_global_step"] == 5
    assert values["cotrain_loss"] == pytest.approx(3.5)
    assert values["cotrain_alive_peers"] == 2


def _progress(peer_id: bytes, epoch: int, samples: int, sps: float, t: float, client: bool = False):
    from hivemind.optim.progress_tracker import LocalTrainingProgress

    return LocalTrainingProgress(
        peer_id=peer_id,
        epoch=epoch,
        samples_accumulated=samples,
        samples_per_second=sps,
        time=t,
        client_mode=client,
    )


def test_snapshot_joins_metrics_and_progress_and_estimates_the_eta():
    from hivemind.p2p import PeerID

    ids = [PeerID.from_base58("12D3KooWLtHHSrzMTcRbxEGb9yJoRn1SZoxdpCGQoCSqovNfATSa"), None]
    metrics = {
        b"a": LocalMetrics(
            step=7,
            samples_per_second=10.0,
            samples_accumulated=300,
            loss=1.0,
            mini_steps=1,
            group_size=2,
            time=99.0,
            peer_id=ids[0].to_base58(),
        )
    }
    progress = {
        b"a": _progress(ids[0].to_bytes(), 8, 16, 10.0, 100.0),
        b"b": _progress(b"\x00\x01", 8, 8, 6.0, 100.0, client=True),
        b"c": _progress(b"\x00\x02", 7, 40, 4.0, 100.0),  # behind: counts for throughput, not for samples
    }
    state = snapshot("r", 64, metrics, progress, now=101.0)
    assert state["global_step"] == 8
    assert state["num_peers"] == 3 and state["num_clients"] == 1
    assert state["samples_accumulated"] == 24
    assert state["samples_per_second"] == pytest.approx(20.0)
    # hivemind's estimate: 24 reported + 1 s x 16 samples/s since then; 24 remain at 20 samples/s
    assert state["eta_seconds"] == pytest.approx(1.2)
    row = next(p for p in state["peers"] if p["peer_id"] == ids[0].to_base58())
    assert row["contribution"] == 300 and row["step"] == 8 and row["short_id"].endswith("NfATSa")


def test_the_dashboard_answers_only_requests_for_its_own_address():
    """DNS rebinding: a page from another name re-pointed at 127.0.0.1 gets 400, not the swarm's state."""
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    import http.client

    from cotrain.dashboard import server as dashboard
    from cotrain.dashboard.view import SwarmView

    server = dashboard.DashboardServer(
        SwarmView("host-run", "cotrain train ...", 64), lambda: "", "127.0.0.1", 0
    )
    try:

        def status(host: str) -> int:
            connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
            try:
                connection.request("GET", "/api/state", headers={"Host": host})
                response = connection.getresponse()
                response.read()
                return response.status
            finally:
                connection.close()

        assert status("evil.example") == 400
        assert status(f"evil.example:{server.port}") == 400
        assert status(f"127.0.0.1.evil.example:{server.port}") == 400
        for host in (
            f"127.0.0.1:{server.port}",
            "127.0.0.1",
            f"localhost:{server.port}",
            f"[::1]:{server.port}",
        ):
            assert status(host) == 200, host
    finally:
        server.close()
    hosts = dashboard.allowed_hosts
    assert hosts("0.0.0.0") == ["*"] and hosts("::") == ["*"]  # every interface: any name
    assert hosts("192.168.1.5") == ["192.168.1.5"] and hosts("::1") == ["[::1]", "localhost", "127.0.0.1"]


def test_dashboard_server_serves_page_state_and_metrics(tmp_path):
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    from prometheus_client.parser import text_string_to_metric_families

    from cotrain.dashboard.server import DashboardServer
    from cotrain.dashboard.view import SwarmView
    from cotrain.sinks.prometheus import PrometheusSink

    view = SwarmView("dash-run", "cotrain train --run-id dash-run ...", 64)
    sink = PrometheusSink("dash-run")
    for row in ROWS:
        view.add_step(row)
        sink.write(row["step"], row)
    server = DashboardServer(view, sink.text, "127.0.0.1", 0)
    try:
        assert server.port > 0 and server.url.startswith("http://127.0.0.1:")

        def get(path: str) -> bytes:
            with urllib.request.urlopen(server.url + path, timeout=10) as response:
                return response.read()

        assert b'id="chart-loss-step"' in get("")
        assert b"function lineChart" in get("static/app.js")
        assert b".chart" in get("static/style.css")
        state = json.loads(get("api/state"))
        assert state["run_id"] == "dash-run" and len(state["steps"]) == 5
        assert state["checkpoint"] is None  # the card says "none yet"
        view.record_checkpoint(4, str(tmp_path / "checkpoints" / "step-000004"))
        view.record_checkpoint(2, str(tmp_path / "checkpoints" / "step-000002"))  # older: not shown
        shown = json.loads(get("api/state"))["checkpoint"]
        assert shown["step"] == 4 and shown["path"].endswith("step-000004")
        assert b"data.checkpoint" in get("static/app.js")  # the card reads it
        families = {f.name: f for f in text_string_to_metric_families(get("metrics").decode())}
        assert families["cotrain_loss"].samples[0].value == pytest.approx(3.5)
    finally:
        server.close()
    assert not server.thread.is_alive()


def test_demo_loss_curve_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from cotrain.plots import plot_loss

    path = plot_loss(ROWS, tmp_path / "loss.png", "test")
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_loss([], tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()


def test_trainer_progress_bar_follows_the_swarm_and_is_off_without_a_tty(capsys):
    from cotrain.progressbar import StepProgress

    assert StepProgress(64).bar.disable  # pytest's stderr is not a terminal
    bar = StepProgress(64, enabled=True)
    bar.update(3, 40, 2)
    bar.update(3, 40, 2)
    assert bar.bar.n == 40 and bar.micro_steps == 2
    bar.close()
    assert "step 4" in capsys.readouterr().err
