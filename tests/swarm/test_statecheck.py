"""State downloads that a malicious donor cannot poison (cotrain.hivemind_ext.statecheck).

Here, with hivemind in the test process; the rest in tests/live/test_statecheck.py and
tests/unit/hivemind_ext/test_statecheck.py."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from conftest import state_holder, wait_until
from cotrain.hivemind_ext import statecheck as sc


@pytest.mark.timeout(90)
def test_a_holder_publishes_signed_fingerprints_that_peers_read():
    """A real state holder on a DHT on 127.0.0.1 publishes its fingerprint; the schema refuses a bad one."""
    import hivemind

    from cotrain.keys import state_fingerprints_key
    from cotrain.net.metrics import make_validators

    run_id = "statecheck-records"
    validators, public_key = make_validators(run_id)
    dht = hivemind.DHT(
        host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=validators, nat_port_map=False, start=True
    )
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    holder = sc.CheckedTrainingStateAverager(
        dht=dht,
        prefix=f"{run_id}_state_averager",
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        params=model.parameters(),
        start=True,
    )
    try:
        holder.local_epoch = 4
        holder.fingerprints.publish(force=True)
        key = state_fingerprints_key(run_id)
        deadline = time.monotonic() + 30
        found = sc.read_fingerprints(dht, key)
        while not found and time.monotonic() < deadline:
            time.sleep(0.2)
            found = sc.read_fingerprints(dht, key)
        mine = found[public_key]
        with holder.lock_averaged_tensors:
            expected = sc.fingerprint(holder.fingerprinted_tensors(), 4)
        assert mine.peer_id == str(dht.peer_id) and list(mine.steps) == [4]
        assert sc.distance(mine.steps[4], expected) < 1e-6
        # the schema refuses a record whose fingerprint does not match its layout, even under one's own key
        bad = sc.FingerprintRecord(states=[sc.step_record(expected)], peer_id="QmPeer").dict()
        bad["states"][0]["values"] = bad["states"][0]["values"][:-4]
        from hivemind.utils import get_dht_time

        assert not dht.store(key, bad, get_dht_time() + 30, subkey=public_key)
    finally:
        holder.shutdown()
        dht.shutdown()


@pytest.mark.timeout(120)
def test_a_newcomer_takes_the_witnessed_step_not_a_lone_peer_far_ahead():
    """Real holders on DHTs on 127.0.0.1: an honest one at step 16 and one at step 19 that no other peer's
    progress reaches (a liar that ran ahead), both reporting their progress. A newcomer that counts progress
    robustly (``progress_key``) loads step 16; one that does not takes the highest priority, 19."""
    from hivemind.utils import get_dht_time

    from cotrain.keys import progress_key

    run_id = "statecheck-witnessed"
    dhts, holders = [], []

    def holder(epoch: int | None, **kwargs) -> sc.CheckedTrainingStateAverager:
        made = state_holder(dhts, run_id, epoch, **kwargs)
        holders.append(made)
        if epoch is not None:
            made.fingerprints.publish(force=True)
            peer_id = dhts[-1].peer_id.to_bytes()
            progress = dict(
                peer_id=peer_id, epoch=epoch, samples_accumulated=8, samples_per_second=1.0,
                time=get_dht_time(), client_mode=False,
            )  # fmt: skip
            assert dhts[-1].store(progress_key(run_id), progress, get_dht_time() + 60, subkey=peer_id)
        return made

    try:
        holder(16)
        holder(19)
        offered = f"{run_id}_state_averager.all_averagers"
        wait_until(
            lambda: len((dhts[0].get(offered, latest=True) or [{}])[0]) == 2, 30, what="both holders to serve"
        )
        robust = holder(None, progress_key=progress_key(run_id))
        robust.load_state_from_peers(timeout=30)
        assert robust.local_epoch == 16
        plain = holder(None)
        plain.load_state_from_peers(timeout=30)
        assert plain.local_epoch == 19  # hivemind's order: the highest priority first
    finally:
        for made in holders:
            made.shutdown()
        for dht in dhts:
            dht.shutdown()


def test_a_donor_that_cannot_be_reached_is_asked_last_for_a_while(capfd):
    """A donor declared at the highest step whose peer nobody can dial (its daemon is gone) is given up
    within OPEN_TIMEOUT, the state comes from a donor that answers, and the next download asks it last (it
    is not tried again while the one that answers serves; the averager's process logs each try)."""
    import logging

    import hivemind
    from hivemind.utils import get_dht_time

    from cotrain.algorithms import donors

    run_id = "statecheck-unreachable"
    dhts, holders = [], []
    try:
        holders.append(state_holder(dhts, run_id, 16))
        gone = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, start=True)
        gone_id = gone.peer_id
        gone.shutdown()
        offered = f"{run_id}_state_averager.all_averagers"
        assert dhts[0].store(offered, 40.0, get_dht_time() + 120, subkey=gone_id.to_bytes())
        wait_until(
            lambda: len((dhts[0].get(offered, latest=True) or [{}])[0]) == 2, 30, what="both donors declared"
        )
        # the averager's process (forked next) logs each try to its stderr
        logger = logging.getLogger(sc.__name__)
        handler = logging.StreamHandler(sys.stderr)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        newcomer = state_holder(dhts, run_id, None)
        holders.append(newcomer)
        tried = []
        for attempt in range(2):
            capfd.readouterr()
            started = time.monotonic()
            newcomer.load_state_from_peers(timeout=60)
            took = time.monotonic() - started
            assert newcomer.local_epoch == 16, attempt
            assert took < donors.OPEN_TIMEOUT + 10, f"attempt {attempt}: {took:.1f} s"
            tried.append(f"Could not reach peer {gone_id}" in capfd.readouterr().err)
            newcomer.local_epoch = 0
        assert tried == [True, False], tried
        order = sc.donor_order({"gone": 40.0, "live": 16.0}, {}, {"gone": time.monotonic() + 60})
        assert [donor for donor, _ in order] == ["live", "gone"]
    finally:
        logging.getLogger(sc.__name__).handlers[:] = []
        for made in holders:
            made.shutdown()
        for dht in dhts:
            dht.shutdown()
