"""Two trainers of a family's CPU twin train together and the loss falls, then `cotrain export` writes a
folder that the family's Auto class loads: an encoder (bert, with whole-word masking) and a decoder (gpt2).
The swarm does not depend on the family; every family's twin trains a step and exports in
tests/unit/test_families.py."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest
import torch

from conftest import FAST, LOCALHOST, Role, alive, trainer_rows, wait_until
from cotrain import checkpoints as ck
from cotrain import cli
from cotrain import config as cfg
from cotrain.families import FAMILIES, tokenizer_type_for
from support.families import TWINS


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Tiny models run fastest on one thread (see conftest.one_torch_thread)."""


SLOW_STEPS = 6


@pytest.fixture(scope="module")
def prepared(small_corpus, tmp_path_factory):
    """`cotrain prepare --preset TWIN` once per (objective, tokenizer) pair, as a user runs it."""
    root = tmp_path_factory.mktemp("prepared")
    made: dict[tuple[str, str], Path] = {}

    def get(twin: str) -> Path:
        run = cfg.resolve(twin).run
        key = (run.objective, tokenizer_type_for(run.model_family, run.objective))
        if key not in made:
            out = root / twin
            argv = ["prepare", "--preset", twin, "--text-files", str(small_corpus), "--output", str(out)]
            assert cli.main([*argv, "--max-seq-length", "64", "--vocab-size", "1500"]) == 0
            made[key] = out
        return made[key]

    return get


@pytest.mark.slow
@pytest.mark.timeout(240)  # about 25 s on an idle machine; more when the cores are shared
@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_two_trainers_of_each_family_train_together_and_export(family, prepared, tmp_path):
    import transformers
    from transformers import AutoTokenizer

    twin = next(t for t in sorted(set(TWINS.values())) if cfg.resolve(t).run.model_family == family)
    data = prepared(twin)
    common = ["--preset", twin, "--run-id", f"family-{family}", "--host-maddrs", LOCALHOST, *FAST]
    common += ["--dataset-path", str(data), "--max-seq-length", "64", "--target-batch-size", "32"]
    common += ["--per-device-train-batch-size", "8", "--statistics-expiration", "20"]
    if family == "bert":  # the masked-LM option, in a real run
        common += ["--whole-word-mask"]
    roles: list[Role] = []
    try:
        first = Role(
            ["train", *common, "--seed", "1", "--output-dir", str(tmp_path / "a"), "--save-steps", "2"],
            tmp_path / "a.log",
        )
        roles.append(first)
        found = wait_until(
            lambda: re.search(r"join through this trainer: --initial-peers (.+)", first.text()),
            240,
            what="the first trainer's address",
        )
        initial = [a for a in found.group(1).split() if "/127.0.0.1/" in a]
        second = Role(
            [
                "train",
                *common,
                "--seed",
                "2",
                "--output-dir",
                str(tmp_path / "b"),
                "--initial-peers",
                *initial,
            ],
            tmp_path / "b.log",
        )
        roles.append(second)

        def done() -> bool:  # both trained a few steps, and at least one of them was averaged by the two
            rows = [trainer_rows(r) for r in roles]
            # 5 steps each: a newcomer's first global step is often taken alone, on its first micro-batch
            # (the other stepped without it), and at gpt2-tiny's learning rate (3e-3 after 2 warm-up steps)
            # one Adam step along 8 samples' gradient takes the loss from 6 to 9 until the next averaged step
            enough = all(len(s) >= 5 for s in rows) and max(r["step"] for r in rows[0]) >= SLOW_STEPS
            return enough and any(r["group_size"] == 2 for s in rows for r in s)

        try:
            wait_until(done, 300, what=f"{SLOW_STEPS} global steps")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{first.text()[-3000:]}\n{second.text()[-3000:]}") from None
        a, b = trainer_rows(first), trainer_rows(second)
        assert max(r["group_size"] for r in a + b) == 2, (a, b)  # the two averaged together
        assert {r["step"] for r in a} & {r["step"] for r in b}, (a, b)  # and shared global steps
        losses_a, losses_b = ([r["loss"] for r in rows if r["loss"] is not None] for rows in (a, b))
        start = sum(losses_a[:2]) / 2  # from scratch
        # the median of both trainers' later half: one step taken alone on a micro-batch (see above) can lift
        # the last two losses of a run this short above the first ones
        later = sorted(losses_a[len(losses_a) // 2 :] + losses_b[len(losses_b) // 2 :])
        end = later[len(later) // 2]
        assert end < start, (family, start, end, a, b)
        pids = [pid for r in roles for pid in r.tree()]
        for role in roles:  # both at once, as when a user stops the swarm
            role.proc.send_signal(signal.SIGTERM)
        for role in roles:
            role.proc.wait(timeout=40)
            role.stop()
            assert role.proc.returncode == 0, role.text()[-2000:]
        assert wait_until(lambda: not alive(pids), 20, what="every process of both trainers to exit") is True
    finally:
        for role in roles:
            if role.proc.poll() is None:
                role.kill_all()
    # export the first trainer's newest checkpoint: the family's Auto class loads it
    out = tmp_path / "export"
    assert cli.main(["export", str(tmp_path / "a" / "checkpoints"), str(out)]) == 0
    auto = FAMILIES[family].auto_class
    assert json.loads((out / "cotrain.json").read_text())["auto_class"] == auto
    model = getattr(transformers, auto).from_pretrained(out)
    assert type(model).__name__ == FAMILIES[family].model_class
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.get_input_embeddings().num_embeddings == len(tokenizer)
    # the same logits as the exported checkpoint's own model on a fixed batch
    exported = Path(json.loads((out / "cotrain.json").read_text())["checkpoint"])
    checkpoint_model, _ = ck.build_from_checkpoint(exported, ck.verify(exported))
    inputs = tokenizer(["the game was released in japan .", "it is a tactical game ."], padding=True)
    inputs = {k: torch.tensor(v) for k, v in inputs.items()}
    with torch.no_grad():
        logits = model(**inputs)[0]
        torch.testing.assert_close(logits, checkpoint_model(**inputs)[0])
    assert logits.shape[-1] == len(tokenizer) and torch.isfinite(logits).all()
