"""Checkpoints in one process.

Here, in the test process alone; the rest in tests/live/test_checkpoints.py."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest
import torch

from cotrain import checkpoints as ck
from cotrain.models import build_model
from cotrain.optim import optimizer_factory, parameter_groups, scheduler_factory
from support.checkpoints import fixed_batch, save, trained_state


def test_save_then_load_restores_weights_moments_and_schedule(tmp_path, tokenizer):
    state = trained_state(tokenizer)
    config, model, optimizer, scheduler = state
    path = save(tmp_path, 7, tokenizer, state)
    assert path.name == "step-000007" and not list(tmp_path.glob(".step-*"))
    meta = json.loads((path / "checkpoint.json").read_text())
    assert meta["step"] == 7 and meta["config"]["run"]["run_id"] == "ck-test"
    assert set(meta["files"]) >= {"model.safetensors", "optimizer.safetensors", "tokenizer/tokenizer.json"}

    fresh = build_model(config.run, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    fresh_opt = optimizer_factory(config.run)(parameter_groups(fresh, config.run.weight_decay))
    fresh_sched = scheduler_factory(config.run)(fresh_opt)
    ck.load_into(path, fresh, fresh_opt, fresh_sched)
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    names = ck.parameter_names(model, optimizer)
    old_state, new_state = optimizer.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert old_state.keys() == new_state.keys()
    for i in old_state:
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(old_state[i][key], new_state[i][key]), names[i]
        assert old_state[i]["step"] == new_state[i]["step"]
    assert fresh_sched.state_dict()["last_epoch"] == scheduler.state_dict()["last_epoch"] == 3
    assert fresh_opt.param_groups[0]["lr"] == pytest.approx(optimizer.param_groups[0]["lr"])
    _, opt_tensors = ck.read_tensors(path)
    sq = [t for k, t in opt_tensors.items() if k.startswith("exp_avg_sq/")]
    assert sq and all(t.dtype == torch.float32 for t in sq)
    assert sum(int((t != 0).sum()) for t in sq) / sum(t.numel() for t in sq) > 0.5


def test_keeps_the_last_k(tmp_path, tokenizer):
    state = trained_state(tokenizer, steps=1)
    for step in (2, 4, 6, 8):
        save(tmp_path, step, tokenizer, state, keep=2)
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step-000006", "step-000008"]


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "bad-json"])
def test_a_bad_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, tokenizer, damage, caplog):
    state = trained_state(tokenizer, steps=1)
    save(tmp_path, 2, tokenizer, state)
    newest = save(tmp_path, 4, tokenizer, state)
    weights = newest / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "flip":
        data = bytearray(weights.read_bytes())
        data[-10] ^= 0xFF
        weights.write_bytes(bytes(data))
    elif damage == "delete":
        (newest / "optimizer.safetensors").unlink()
    else:
        (newest / "checkpoint.json").write_text('{"format": "cotrain-checkp')
    with pytest.raises(ck.CheckpointError) as err:
        ck.verify(newest)
    assert "step-000004" in str(err.value)
    with caplog.at_level(logging.WARNING, logger="cotrain.checkpoints"):
        path, meta = ck.latest_good(tmp_path)
    assert path.name == "step-000002" and meta["step"] == 2
    assert "Skipping a bad checkpoint" in caplog.text and "step-000004" in caplog.text


def test_no_good_checkpoint_is_none(tmp_path):
    assert ck.latest_good(tmp_path / "missing") is None
    (tmp_path / "step-000001").mkdir()
    assert ck.latest_good(tmp_path) is None


def test_a_leftover_temp_folder_is_ignored_and_removed_by_the_next_save(tmp_path, tokenizer):
    state = trained_state(tokenizer, steps=1)
    save(tmp_path, 2, tokenizer, state)
    leftover = tmp_path / ".step-000004.tmp-999"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"partial")
    assert ck.latest_good(tmp_path)[0].name == "step-000002"
    save(tmp_path, 6, tokenizer, state)
    assert not leftover.exists()


def test_export_loads_with_from_pretrained_and_gives_the_same_logits(tmp_path, tokenizer):
    from transformers import AlbertForPreTraining, AutoModelForPreTraining, AutoTokenizer

    state = trained_state(tokenizer)
    _, model, _, _ = state
    path = save(tmp_path / "checkpoints", 3, tokenizer, state)
    out = ck.export(path, tmp_path / "hf")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    batch = fixed_batch(tokenizer)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
    model.eval()
    with torch.no_grad():
        expected = model(**inputs)
        for cls in (AlbertForPreTraining, AutoModelForPreTraining):
            loaded = cls.from_pretrained(str(out)).eval()
            got = loaded(**inputs)
            torch.testing.assert_close(got.prediction_logits, expected.prediction_logits)
            torch.testing.assert_close(got.sop_logits, expected.sop_logits)
    exported_tok = AutoTokenizer.from_pretrained(str(out))
    assert exported_tok("hello world")["input_ids"] == tokenizer("hello world")["input_ids"]
    # a checkpoints folder exports its newest good checkpoint
    assert (
        json.loads((ck.export(tmp_path / "checkpoints", tmp_path / "hf2") / "cotrain.json").read_text())[
            "step"
        ]
        == 3
    )


def test_export_command_line(tmp_path, tokenizer, capsys):
    from cotrain.cli import main

    path = save(tmp_path / "checkpoints", 5, tokenizer, trained_state(tokenizer, steps=1))
    assert main(["export", str(path), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    (path / "model.safetensors").write_bytes(b"")
    assert main(["export", str(path), str(tmp_path / "hf3")]) == 2
    err = capsys.readouterr().err
    assert "cotrain export: error:" in err and "truncated or corrupted" in err and "Traceback" not in err


def test_export_replaces_only_a_folder_that_holds_nothing_but_an_export(tmp_path, tokenizer, capsys):
    from cotrain.cli import main

    path = save(tmp_path / "checkpoints", 5, tokenizer, trained_state(tokenizer, steps=1))
    out = ck.export(path, tmp_path / "hf")
    written = sorted(p.name for p in out.iterdir())
    # a user's folder that holds a cotrain.json (here an export's own) beside a file of theirs is refused
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / ck.EXPORT_MARKER).write_bytes((out / ck.EXPORT_MARKER).read_bytes())
    (mine / "thesis.tex").write_text("a user's file")
    capsys.readouterr()
    assert main(["export", str(path), str(mine)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "not a cotrain export (it holds 'thesis.tex'" in err[0], err
    assert sorted(f.name for f in mine.iterdir()) == [ck.EXPORT_MARKER, "thesis.tex"]
    assert (mine / "thesis.tex").read_text() == "a user's file"
    assert sorted(f.name for f in tmp_path.iterdir()) == ["checkpoints", "hf", "mine"]  # no temp folder
    # so is an export folder that someone added a file, a folder or a link to
    added = {"notes.txt": lambda p: p.write_text("mine"), "sub": Path.mkdir}
    added["link"] = lambda p: p.symlink_to(mine / "thesis.tex")
    for name, make in added.items():
        make(out / name)
        with pytest.raises(ck.UserError, match=f"it holds '{name}'"):
            ck.export(path, out)
        assert sorted(p.name for p in out.iterdir()) == sorted([*written, name])
        (out / name).rmdir() if name == "sub" else (out / name).unlink()
    # its own folder is replaced, and so is one made before cotrain.json named its files
    marker = json.loads((out / ck.EXPORT_MARKER).read_text())
    assert marker["files"] == written
    del marker["files"]
    (out / ck.EXPORT_MARKER).write_text(json.dumps(marker))
    ck.export(path, out)
    assert sorted(p.name for p in out.iterdir()) == written
    assert (mine / "thesis.tex").read_text() == "a user's file"


def test_checkpoints_never_replace_or_prune_a_folder_they_did_not_write(tmp_path, tokenizer):
    state = trained_state(tokenizer, steps=1)
    foreign = ck.step_dir(tmp_path, 4)
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(ck.CheckpointError, match="is not a checkpoint"):
        save(tmp_path, 4, tokenizer, state)
    for step in (6, 8, 10):
        save(tmp_path, step, tokenizer, state, keep=2)
    assert (foreign / "notes.txt").read_text() == "keep me"
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step-000004", "step-000008", "step-000010"]
    assert ck.latest_good(tmp_path)[0].name == "step-000010"


class FakeUpload:
    """Records each upload (the folder's files at call time); fails the first ``failures`` calls."""

    def __init__(self, failures: int = 0):
        self.failures = failures
        self.calls: list[tuple[str, int, list[str]]] = []
        self.done = threading.Event()

    def __call__(self, folder: Path, repo: str, message: str) -> None:
        files = sorted(p.name for p in Path(folder).iterdir())
        step = json.loads((Path(folder) / "cotrain.json").read_text())["step"]
        self.calls.append((repo, step, files))
        if len(self.calls) <= self.failures:
            raise ConnectionError("no network here")
        self.done.set()


def test_hub_uploader_pushes_the_newest_export_and_retries_with_backoff(tmp_path, tokenizer, caplog):
    from cotrain.hub import HubUploader

    state = trained_state(tokenizer, steps=1)
    root = tmp_path / "checkpoints"
    save(root, 2, tokenizer, state)
    save(root, 4, tokenizer, state)
    upload = FakeUpload(failures=2)
    stop = threading.Event()
    uploader = HubUploader(
        root, "me/albert", every=0.2, work_dir=tmp_path / "hub", stop=stop, upload=upload, backoff=0.05
    )
    with caplog.at_level(logging.INFO, logger="cotrain.hub"):
        uploader.start()
        assert upload.done.wait(30), upload.calls
        assert uploader.uploaded_step == 4
        save(root, 6, tokenizer, state)  # the next interval pushes the new one, and only once
        deadline = threading.Event()
        for _ in range(100):
            if uploader.uploaded_step == 6:
                break
            deadline.wait(0.1)
        deadline.wait(0.6)  # more intervals pass: nothing new, nothing pushed
        stop.set()
        uploader.join(10)
    assert not uploader.is_alive()
    assert [c[1] for c in upload.calls] == [4, 4, 4, 6], upload.calls
    assert all(c[0] == "me/albert" for c in upload.calls)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(upload.calls[0][2])
    assert caplog.text.count("Upload to me/albert failed") == 2
    assert "retrying in" in caplog.text


class FakeHfApi:
    """Stands in for ``huggingface_hub.HfApi`` (no network here): records what would be sent."""

    def __init__(self):
        self.created: list[tuple[str, dict]] = []
        self.uploads: list[dict] = []
        self.done = threading.Event()

    def create_repo(self, repo_id: str, **options) -> None:
        self.created.append((repo_id, options))

    def upload_folder(self, **options) -> None:
        folder = Path(options["folder_path"])
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
        self.uploads.append({**options, "files": files})
        self.done.set()


def test_hub_repositories_are_created_private_and_uploads_carry_no_local_path(
    tmp_path, tokenizer, monkeypatch
):
    import huggingface_hub

    from cotrain.cli import parse
    from cotrain.hub import HubUploader, hf_upload

    api = FakeHfApi()
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda: api)
    root = tmp_path / "checkpoints"
    save(root, 2, tokenizer, trained_state(tokenizer, steps=1))
    stop = threading.Event()
    uploader = HubUploader(root, "me/albert", every=0.1, work_dir=tmp_path / "hub", stop=stop)
    uploader.start()
    assert api.done.wait(60)
    stop.set()
    uploader.join(10)
    assert api.created == [("me/albert", {"exist_ok": True, "private": True})]
    sent = api.uploads[0]
    assert sent["repo_id"] == "me/albert" and "model.safetensors" in sent["files"]
    local = str(tmp_path).encode()
    leaks = [name for name, data in sent["files"].items() if local in data or b"/tmp/" in data]
    assert not leaks and local.decode() not in sent["commit_message"], leaks
    assert json.loads(sent["files"]["cotrain.json"])["checkpoint"] == "step-000002"
    # --hub-public creates a public one
    hf_upload(tmp_path / "hub" / "export", "me/open", "m", private=False, api=api)
    assert api.created[-1] == ("me/open", {"exist_ok": True, "private": False})
    _, config = parse(["monitor", "--push-to-hub", "me/open", "--hub-public"])
    assert config.peer.hub_public and not parse(["monitor", "--push-to-hub", "me/x"])[1].peer.hub_public


def test_hub_uploader_waits_for_the_interval(tmp_path, tokenizer):
    from cotrain.hub import HubUploader

    root = tmp_path / "checkpoints"
    save(root, 2, tokenizer, trained_state(tokenizer, steps=1))
    upload = FakeUpload()
    stop = threading.Event()
    uploader = HubUploader(root, "me/albert", every=60, work_dir=tmp_path / "hub", stop=stop, upload=upload)
    uploader.start()
    stop.wait(1.0)
    stop.set()
    uploader.join(10)
    assert upload.calls == []  # the first upload comes one interval after start
