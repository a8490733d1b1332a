"""What a user sees when a role cannot start.

Here, in the test process alone; the rest in tests/live/test_roles_errors.py."""

from __future__ import annotations

import pytest

from support.roles_errors import _dataset_for


def test_a_monitor_takes_the_preset_of_its_dataset_or_checkpoint_when_none_is_named(tmp_path):
    import json

    import cotrain.config as cfg
    from cotrain.errors import UserError
    from cotrain.preflight import monitor_preset

    data = _dataset_for(tmp_path, "albert-tiny")
    unnamed = cfg.resolve(overrides={"peer": {"dataset_path": str(data)}})
    assert unnamed.run.preset == "albert-large-v2" and "preset" not in unnamed.run_given
    assert monitor_preset(unnamed) == ("albert-tiny", f"the dataset at {data}")
    same = cfg.resolve("albert-tiny", overrides={"peer": {"dataset_path": str(data)}})
    assert monitor_preset(same) is None
    # the same dataset served over HTTP (127.0.0.1): its manifest is read before anything starts
    import functools
    import http.server
    import threading

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(data))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        served = cfg.resolve(overrides={"peer": {"dataset_url": url}})
        assert monitor_preset(served) == ("albert-tiny", f"the dataset at {url}")
        with pytest.raises(UserError, match="prepared for preset albert-tiny, this monitor runs preset gpt2"):
            monitor_preset(cfg.resolve("gpt2-tiny", overrides={"peer": {"dataset_url": url}}))
    finally:
        server.shutdown()
        server.server_close()
    # --resume: the newest checkpoint's config names the preset (a folder that says nothing is passed over)
    out = tmp_path / "out"
    for step, preset in ((3, "gpt2-tiny"), (6, None)):
        folder = out / "checkpoints" / f"step-{step:06d}"
        folder.mkdir(parents=True)
        meta = {"config": {"run": {"preset": preset}}} if preset else {"step": step}
        (folder / "checkpoint.json").write_text(json.dumps(meta))
    resume = {"peer": {"resume": True, "output_dir": str(out)}}
    assert monitor_preset(cfg.resolve(overrides=resume))[0] == "gpt2-tiny"
    with pytest.raises(UserError, match="made with preset gpt2-tiny, this monitor runs preset albert-tiny"):
        monitor_preset(cfg.resolve("albert-tiny", overrides=resume))
