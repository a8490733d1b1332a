"""One vote per participant in a private swarm (cotrain.access.voters).

Here, in the test process alone; the rest in tests/swarm/test_voters.py."""

from __future__ import annotations

import dataclasses
import time

import torch

from cotrain.access import AccessControl, issue_token, revoke_tokens
from cotrain.access.voters import (
    VoterRecord,
    make_voter_record,
    one_vote_each,
    verify_voter,
)
from cotrain.algorithms.fingerprint import fingerprint, verdict
from cotrain.config import RunConfig
from cotrain.net.configrecord import make_record, swarm_record
from support.voters import RUN, signer


def voters(swarm: dict) -> dict[bytes, str]:
    return {k: who for k, r in swarm["records"].items() if (who := verify_voter(swarm["reader"], k, r))}


def test_a_voter_record_proves_its_own_key_for_a_valid_token_only(swarm, tmp_path):
    found = voters(swarm)
    assert len(found) == 7 and len(set(found.values())) == 3  # seven keys, three participants
    alice = swarm["keys"]["alice"]
    assert len({found[k] for k in alice}) == 1
    copied = swarm["records"][alice[0]]
    assert verify_voter(swarm["reader"], signer(), copied) is None  # a record copied under another key
    issued = issue_token(tmp_path / "other.key", "mallory", 1, tmp_path / "mallory.token")
    foreign = AccessControl.for_token(RUN, str(issued.path))
    mallory = signer()
    assert verify_voter(swarm["reader"], mallory, make_voter_record(foreign, mallory)) is None
    garbage = VoterRecord(token=b"\x01junk", proof=copied.proof)
    assert verify_voter(swarm["reader"], alice[0], garbage) is None
    other_run = AccessControl(
        f"{RUN}-2", swarm["reader"].authority_public_key, authority=swarm["reader"].authority
    )
    assert verify_voter(other_run, alice[0], copied) is None  # the proof names its run


def test_many_keys_of_one_token_holder_count_as_one_vote(swarm):
    found = voters(swarm)
    mine = dataclasses.asdict(RunConfig(run_id=RUN))
    theirs = {**mine, "learning_rate": 1.0}
    records = {k: make_record(theirs, "trainer") for k in swarm["keys"]["alice"]}
    records |= {k: make_record(mine, "trainer") for name in ("bob", "carol") for k in swarm["keys"][name]}
    counted_by_key = swarm_record(records)
    assert counted_by_key[0].fields()["learning_rate"] == 1.0 and counted_by_key[1] == 5  # one key, one vote
    best, participants = swarm_record(records, found)
    assert best.fields() == mine and participants == 2
    # a key without a voter record counts for nothing
    assert one_vote_each({signer(): "x"}, found) == {}

    # the state check: alice's five keys publish the fingerprint of a poisoned state and serve it
    torch.manual_seed(0)
    honest = [torch.randn(64, 64), torch.randn(64)]
    poisoned = [-t for t in honest]
    at_step = {k: fingerprint(poisoned, 7) for k in swarm["keys"]["alice"]}
    at_step |= {k: fingerprint(honest, 7) for name in ("bob", "carol") for k in swarm["keys"][name]}
    donor = {swarm["keys"]["alice"][0]}
    assert verdict(fingerprint(poisoned, 7), at_step, donor).accepted  # by keys: her other keys vouch
    votes = one_vote_each(at_step, found)
    donor_votes = {found[k] for k in donor}
    assert not verdict(fingerprint(poisoned, 7), votes, donor_votes).accepted
    assert verdict(fingerprint(honest, 7), votes, {found[swarm["keys"]["bob"][0]]}).accepted


def test_a_revoked_holders_keys_stop_counting(swarm):
    before = voters(swarm)
    assert revoke_tokens(swarm["key"], "carol").now == 1
    time.sleep(0.01)  # the registry's new mtime
    after = voters(swarm)
    assert set(before) - set(after) == set(swarm["keys"]["carol"])
