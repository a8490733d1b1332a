"""The DHT process's request pipe.

Here, in the test process alone; the rest in tests/live/test_dht.py and tests/swarm/test_dht.py."""

import itertools
import multiprocessing as mp

import pytest

from cotrain.hivemind_ext.dht import _TolerantRequests
from support.dht import _own_daemons


def test_a_closed_pipe_still_ends_the_loop():
    inner, outer = mp.Pipe(duplex=False)
    outer.close()
    with pytest.raises(EOFError):
        _TolerantRequests(inner).poll(1.0)


def _leader_search(update_queue, seconds: float) -> list[float]:
    """The monotonic times of the reads of the would-be leaders that ``update_queue`` (a
    ``_update_queue_periodically``) makes in ``seconds`` of a search that finds none, its queue emptied at
    once each time (as ``pop_next_leader`` does while this peer waits as the leader of its group)."""
    import asyncio
    import time

    from hivemind.averaging.matchmaking import PotentialLeaders
    from hivemind.p2p import PeerID
    from hivemind.utils import get_dht_time

    reads = []

    class KeyManager:
        current_key = "run_grad_averager.0b"

        async def get_averagers(self, key, only_active):
            reads.append(time.monotonic())
            return []

    async def scenario():
        leaders = PotentialLeaders(PeerID(b"me"), min_matchmaking_time=2.0, target_group_size=None)
        leaders.running.set()
        leaders.search_end_time = get_dht_time() + seconds
        task = asyncio.create_task(update_queue(leaders, KeyManager()))
        while not task.done():
            finished = asyncio.create_task(leaders.update_finished.wait())
            await asyncio.wait({finished, task}, return_when=asyncio.FIRST_COMPLETED)
            finished.cancel()
            leaders.update_finished.clear()
            leaders.update_triggered.set()  # the queue is empty: pop_next_leader asks for another read
        await task

    asyncio.run(scenario())
    return reads


def test_a_peer_waiting_for_its_group_reads_the_leaders_a_few_times_a_second_not_without_pause():
    from cotrain.hivemind_ext import fixes

    hivemind_reads = len(_leader_search(fixes._hivemind_update_queue, 0.5))
    # at most every 0.1 x the matchmaking time of 2 s (measured on the monotonic clock: the search's end is
    # wall-clock time, which the host may step)
    reads = _leader_search(fixes._update_queue_periodically, 1.0)
    gaps = [later - earlier for earlier, later in itertools.pairwise(reads)]
    assert len(reads) >= 3, f"{len(reads)} reads of the leaders in 1 s"
    assert min(gaps) >= 0.19, f"reads of the leaders {min(gaps):.3f} s apart"
    assert hivemind_reads > 10 * len(reads), f"hivemind's own search read {hivemind_reads} times in 0.5 s"


def test_an_averager_declares_its_state_again_when_its_priority_changes_not_per_averaged_tensor():
    import asyncio
    from types import SimpleNamespace

    from cotrain.hivemind_ext import fixes

    stores = []

    async def store(key, subkey, value, expiration_time, return_future):
        stores.append((key, value))
        return True

    async def scenario():
        averager = SimpleNamespace(
            _matchmaking=SimpleNamespace(group_key_manager=SimpleNamespace(prefix="run_state_averager")),
            allow_state_sharing=True,
            state_sharing_priority=3.0,
            declare_state_period=30.0,
            dht=SimpleNamespace(store=store),
            peer_id=SimpleNamespace(to_bytes=lambda: b"me"),
            _state_updated=asyncio.Event(),
        )
        task = asyncio.create_task(fixes._declare_for_download_periodically(averager))
        for _ in range(30):  # an all-reduce of 30 tensors sets the event after each one
            await asyncio.sleep(0.005)
            averager._state_updated.set()
        await asyncio.sleep(0.05)
        averager.state_sharing_priority = 4.0  # the next global step
        averager._state_updated.set()
        await asyncio.sleep(0.05)
        averager.allow_state_sharing = False
        averager._state_updated.set()
        await asyncio.sleep(0.05)
        task.cancel()

    asyncio.run(scenario())
    assert stores == [("run_state_averager.all_averagers", v) for v in (3.0, 4.0, None)]


def test_the_dht_process_checks_each_record_once_and_again_after_a_validator_is_added():
    from hivemind.dht.validation import CompositeValidator, DHTRecord, RecordValidatorBase

    from cotrain.hivemind_ext.dht import RememberedVerdicts

    checked = []

    class Counting(RecordValidatorBase):
        def validate(self, record):
            checked.append(record)
            return record.value != b"forged"

    verdicts = RememberedVerdicts(CompositeValidator([Counting()]), size=2)
    honest, forged = DHTRecord(b"k", b"s", b"v", 10.0), DHTRecord(b"k", b"s", b"forged", 10.0)
    assert [verdicts.validate(r) for r in (honest, honest, forged, forged)] == [True, True, False, False]
    assert len(checked) == 2
    assert verdicts.validate(DHTRecord(b"k", b"s", b"v", 11.0)) and len(checked) == 3  # a newer record
    assert verdicts.validate(DHTRecord(b"k", b"sv", b"", 10.0)) and len(checked) == 4  # fields apart
    verdicts.validate(honest)  # the oldest verdicts were forgotten (size 2)
    assert len(checked) == 5
    verdicts.extend([Counting()])
    verdicts.validate(honest)
    assert len(checked) == 7  # checked again, by both validators


@pytest.mark.parametrize("given", [{}, {"GOGC": "200"}, {"GOMEMLIMIT": "1GiB"}])
def test_the_libp2p_daemon_collects_its_garbage_early_unless_the_user_says_otherwise(monkeypatch, given):
    from cotrain.net.dht import P2PD_GOGC, create_dht

    for name in ("GOGC", "GOMEMLIMIT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in given.items():
        monkeypatch.setenv(name, value)
    dht = create_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        environment = max(_own_daemons(), key=lambda p: p.create_time()).environ()
    finally:
        dht.shutdown()
    expected = given or {"GOGC": P2PD_GOGC}
    assert {n: environment.get(n) for n in ("GOGC", "GOMEMLIMIT")} == {
        n: expected.get(n) for n in ("GOGC", "GOMEMLIMIT")
    }


def test_an_initial_peer_that_is_not_there_fails_at_once(caplog):
    import socket
    import time

    from cotrain.errors import UserError
    from cotrain.net.dht import create_dht

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nobody = f"/ip4/127.0.0.1/tcp/{port}/p2p/12D3KooWAxZjUFwp32ZGSeRZ6WVxZfgJcxqrkbZ7LPtTeZRYQjZA"
    started = time.monotonic()
    with pytest.raises(UserError, match="no initial peer could be reached"):
        create_dht(initial_peers=[nobody], host_maddrs=["/ip4/127.0.0.1/tcp/0"], wait_timeout=5.0)
    assert time.monotonic() - started < 15 and "trying again" not in caplog.text
