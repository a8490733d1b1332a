"""A model's layout without its code (cotrain.host.layout).

Here, with cotrain processes; the rest in tests/unit/data/test_layout.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cotrain import checkpoints as ck
from cotrain.config import resolve
from cotrain.errors import UserError
from cotrain.host.layout import SavedTokenizer, describe, run_state_layout
from cotrain.models import build_model

MONITOR_STATE = """
import json, sys, threading
from pathlib import Path
from cotrain.host.deferred import defer_all
defer_all()  # as cotrain._worker does
from cotrain import checkpoints as ck
from cotrain.config import resolve
from cotrain.host.layout import run_state_layout
from cotrain.roles.keeper import StateKeeper
from cotrain.net.dht import create_dht
out = Path(sys.argv[1])
config = resolve(overrides={"run": {"preset": "albert-tiny", "run_id": "layout"},
                            "peer": {"tokenizer_path": str(out / "given")}})
tokenizer, layout = run_state_layout(config, out / "checkpoints", out / "tokenizer")
dht = create_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
keeper = StateKeeper(dht, config, tokenizer, out / "checkpoints", threading.Event(), model=layout)
averager = keeper.averager
with averager.get_tensors() as averaged:
    shared = [a.data_ptr() == p.data_ptr() for a, p in zip(averaged, averager.main_parameters)]
with averager.lock_averaged_tensors:
    path = ck.save_checkpoint(out / "checkpoints", 1, keeper.model, averager.optimizer, averager.scheduler,
                              config.to_dict(), tokenizer, params=averager.main_parameters)
ck.load_into(path, keeper.model, averager.optimizer, averager.scheduler, params=averager.main_parameters)
keeper.shutdown()
dht.shutdown()
heavy = ("transformers", "tokenizers", "pyarrow", "torch._dynamo", "scipy.optimize._linprog")
print(json.dumps({"imported": sorted(m for m in heavy if m in sys.modules), "shared": all(shared),
                  "reuse": averager.reuse_tensors, "hash": tokenizer.content_hash}))
"""


@pytest.mark.slow
def test_the_monitors_state_keeper_imports_no_model_code_tokenizer_nor_torch_compile(tmp_path):
    from cotrain.data import demo_corpus, load_tokenizer, tokenizer_hash, train_albert_tokenizer

    train_albert_tokenizer(demo_corpus()[:300], 300, tmp_path / "given")
    done = subprocess.run(
        [sys.executable, "-c", MONITOR_STATE, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["imported"] == [], seen
    # hivemind's averager holds no second copy of the parameters: it averages the keeper's own tensors
    assert seen["reuse"] and seen["shared"]
    given = load_tokenizer(tmp_path / "given")
    assert seen["hash"] == tokenizer_hash(given) == tokenizer_hash(load_tokenizer(tmp_path / "tokenizer"))
    checkpoint = tmp_path / "checkpoints" / "step-000001"
    meta = ck.verify(checkpoint)
    assert meta["tokenizer_hash"] == seen["hash"]
    assert tokenizer_hash(ck.checkpoint_tokenizer(checkpoint, meta)) == seen["hash"]
    weights, _ = ck.read_tensors(checkpoint)
    real = build_model(resolve("albert-tiny").run, vocab_size=len(given), pad_token_id=0)
    assert {k: list(t.shape) for k, t in weights.items()} == {
        k: list(t.shape) for k, t in real.state_dict().items() if k in weights
    }


@pytest.mark.slow
def test_the_runs_tokenizer_is_found_as_the_monitor_finds_it(tmp_path):
    from cotrain.data import demo_corpus, prepare_dataset

    data = tmp_path / "data"
    prepare_dataset(demo_corpus()[:400], str(data), vocab_size=300, max_length=64)
    none = resolve(overrides={"run": {"preset": "gpt2-tiny"}})
    assert run_state_layout(none, tmp_path / "checkpoints", tmp_path / "t0") is None
    assert not (tmp_path / "t0").exists()

    config = resolve(overrides={"run": {"preset": "albert-tiny"}, "peer": {"dataset_path": str(data)}})
    tokenizer, layout = run_state_layout(config, tmp_path / "checkpoints", tmp_path / "t1")
    from cotrain.data import load_tokenizer, tokenizer_hash

    real_tokenizer = load_tokenizer(data / "tokenizer")
    assert isinstance(tokenizer, SavedTokenizer) and tokenizer.content_hash == tokenizer_hash(real_tokenizer)
    real = build_model(config.run, vocab_size=len(real_tokenizer), pad_token_id=real_tokenizer.pad_token_id)
    assert describe(layout) == describe(real)

    wrong = resolve(overrides={"run": {"preset": "albert-tiny"}, "peer": {"dataset_path": str(tmp_path)}})
    with pytest.raises(UserError) as e:
        run_state_layout(wrong, tmp_path / "checkpoints", tmp_path / "t2")
    assert "manifest" in str(e.value) and "\n" not in str(e.value) and "Traceback" not in str(e.value)
    assert not (tmp_path / "t2").exists()


@pytest.mark.slow
def test_the_monitors_layout_of_a_run_started_from_a_pretrained_folder(tmp_path):
    from cotrain.data import demo_corpus, train_albert_tokenizer

    tokenizer = train_albert_tokenizer(demo_corpus()[:300], 300, tmp_path / "tokenizer")
    small = resolve(overrides={"run": {"preset": "albert-tiny", "model": {"num_hidden_layers": 1}}}).run
    build_model(small, vocab_size=len(tokenizer), pad_token_id=0).save_pretrained(tmp_path / "albert")
    config = resolve(
        overrides={
            "run": {"preset": "albert-tiny", "init_from": str(tmp_path / "albert")},
            "peer": {"tokenizer_path": str(tmp_path / "tokenizer")},
        }
    )
    _, layout = run_state_layout(config, tmp_path / "checkpoints", tmp_path / "saved")
    real = build_model(config.run, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    assert describe(layout) == describe(real)


@pytest.mark.slow
def test_the_monitor_finds_the_tokenizer_of_a_dataset_it_reads_by_url(tmp_path):
    import functools
    import http.server
    import threading

    from cotrain.data import demo_corpus, load_tokenizer, prepare_dataset, tokenizer_hash

    data = tmp_path / "data"
    prepare_dataset(demo_corpus()[:400], str(data), vocab_size=300, max_length=64)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(data))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/"
        peer = {"dataset_url": url, "cache_dir": str(tmp_path / "cache")}
        config = resolve(overrides={"run": {"preset": "albert-tiny"}, "peer": peer})
        tokenizer, _ = run_state_layout(config, tmp_path / "checkpoints", tmp_path / "saved")
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert tokenizer.content_hash == tokenizer_hash(load_tokenizer(data / "tokenizer"))
    assert tokenizer_hash(load_tokenizer(tmp_path / "saved")) == tokenizer.content_hash


def test_a_model_the_child_cannot_build_gives_one_clear_error(tmp_path):
    from cotrain.data import demo_corpus, train_albert_tokenizer

    train_albert_tokenizer(demo_corpus()[:300], 300, tmp_path / "given")
    config = resolve(
        overrides={
            "run": {"preset": "albert-tiny", "model": {"no_such_key": 1}},
            "peer": {"tokenizer_path": str(tmp_path / "given")},
        }
    )
    with pytest.raises(UserError, match=r"^cannot read the model's layout: .*no_such_key"):
        run_state_layout(config, tmp_path / "checkpoints", tmp_path / "saved")
    assert not (tmp_path / "saved").exists()  # nothing half-saved
