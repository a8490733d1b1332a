"""DiLoCo's lineages, which decide when a round's all-reduce (cotrain.hivemind_ext.outer) also averages the
outer state (cotrain.strategies.diloco_rounds).

Peers that diverged (a round alone, another group, a fresh download) must step from the same outer state
again. Each peer keeps a *lineage*: a digest that all members of a group derive alike from the group's
members and their previous lineages after averaging together, that a round alone replaces with a fresh random
one, and that a download takes from its donor where the donor vouches for the state it served (else a fresh
one: cotrain.strategies.diloco_rounds). A peer starts with the digest of its initial global parameters' exact
bytes (``initial_lineage``; the outer momentum is zero then): peers that start from the same weights, as a
preset's seeded initialization gives them, share their first round's lineage. Peers of the same lineage
hold the same global parameters and momentum (up to the rounding of the compressed averages), so their
all-reduce carries the pseudo-gradients alone; when a group's lineages differ, and every
``OUTER_STATE_EVERY``-th round (rounds 9, 19, ...: against the slow drift of that rounding, which the first
rounds have not had time for), the same all-reduce also averages the outer state. The choice is made in the
all-reduce itself from what the members sent at matchmaking (hivemind's gathered data), so all members of a
group make the same one.

A member that shows a fresh lineage every round would make every round of its groups carry the outer state:
in sparse rounds, float32 state 200-400 times the records' bytes, for the whole group. So each peer watches
the others (``LineageWatch``): a member of a round that was whole here should show, in its next round, the
lineage that round gave the group; one that shows another in ``LINEAGE_BREAKS`` of the last ``LINEAGE_WINDOW``
rounds this peer expected it in is *struck* by this peer, with one log line. Honest peers break their
lineage only when their own side of a round failed (a round alone, a partial all-reduce, a non-finite
average) or they downloaded the state. At matchmaking every member sends the peers it strikes, and a group
leaves out of its choice the lineage of each member that a strict majority of the other members strike
(``discounted``): again the same choice on every member. A struck peer still averages its changes; of the
rounds it is watched in, at most ``LINEAGE_BREAKS`` in ``LINEAGE_WINDOW`` carry the outer state for its sake
(a break is noted when its round ends, so the one that strikes it has carried the state). A peer that
changes groups every round is not watched (nobody expects it), and in a pair one member's word decides: a
liar paired with a diverged honest peer can keep their round from carrying the state.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from cotrain.algorithms.fingerprint import sampled_values

logger = logging.getLogger(__name__)

LINEAGE_BYTES = 8  # a lineage's length
OUTER_STATE_EVERY = 10  # rounds: the outer state rides along at least this often (see the module's doc)
ROUND_BITS = 8  # low bits of the round in the matchmaking key: peers average only with peers of their round
LINEAGE_BREAKS = 2  # rounds, among a peer's last LINEAGE_WINDOW watched ones, with another lineage: struck
LINEAGE_WINDOW = 20
MAX_STRUCK = 32  # peers one member names as struck in what it sends at matchmaking (the rest are ignored)


def fresh_lineage() -> bytes:
    """The lineage of a peer whose outer state no other peer is known to share (a start, a round alone, a
    download)."""
    return os.urandom(LINEAGE_BYTES)


def initial_lineage(global_parameters: Iterable[torch.Tensor]) -> bytes:
    """The lineage of a peer before its first outer step: a digest of its global parameters (shapes and exact
    bytes), so that peers that start from the same weights share it (see the module's doc)."""
    digest = hashlib.blake2b(digest_size=LINEAGE_BYTES, person=b"cotrain-start")
    digest_tensors(digest, global_parameters)
    return digest.digest()


def digest_tensors(digest: Any, tensors: Iterable[torch.Tensor]) -> None:
    """Feed ``digest`` (a hashlib object) every tensor's shape, type and exact bytes, in order."""
    for tensor in tensors:
        flat = tensor.detach().cpu().contiguous()
        digest.update(f"{tuple(flat.shape)}{flat.dtype}".encode())
        digest.update(flat.reshape(-1).view(torch.uint8).numpy())


def periodic_round(round_: Any) -> bool:
    """Whether a dense round carries the outer state whatever the lineages (see the module's doc)."""
    return not isinstance(round_, int) or round_ % OUTER_STATE_EVERY == OUTER_STATE_EVERY - 1


def carries_outer_state(gathered: Mapping[Any, Any] | Iterable[Any], periodic: bool = True) -> bool:
    """Whether a group's all-reduce also averages the outer state: when its members' lineages differ (or one
    is missing), and (``periodic``: rounds whose averages reach each member with its own rounding) at every
    ``OUTER_STATE_EVERY``-th round. ``gathered``: what each member sent at matchmaking (``{"lineage": bytes,
    "round": int, "struck": [peer id bytes]}``), by member (a mapping: the members that most others strike do
    not count, ``discounted``) or not."""
    if isinstance(gathered, Mapping):
        skip = discounted(gathered)
        gathered = [item for peer, item in gathered.items() if peer not in skip]
    lineages, rounds = set(), set()
    for item in gathered:
        if not isinstance(item, dict) or not isinstance(item.get("lineage"), bytes):
            return True
        lineages.add(item["lineage"])
        rounds.add(item.get("round"))
    if len(lineages) > 1:
        return True
    return periodic and any(periodic_round(r) for r in rounds)


def _peer_bytes(peer: Any) -> Any:
    return peer.to_bytes() if hasattr(peer, "to_bytes") else peer


def discounted(gathered: Mapping[Any, Any]) -> set:
    """The members of a group (``gathered``: member -> what it sent at matchmaking) whose lineage does not
    count in ``carries_outer_state``: those that a strict majority of the other members name as struck
    (``"struck"``: peer ids as bytes, at most ``MAX_STRUCK`` read; see the module's doc)."""
    votes = dict.fromkeys(gathered, 0)
    names = {peer: _peer_bytes(peer) for peer in gathered}
    for voter, item in gathered.items():
        struck = item.get("struck") if isinstance(item, dict) else None
        if not isinstance(struck, list | tuple):
            continue
        named = {name for name in struck[:MAX_STRUCK] if isinstance(name, bytes)}
        for peer, name in names.items():
            if peer != voter and name in named:
                votes[peer] += 1
    others = len(gathered) - 1
    return {peer for peer, count in votes.items() if 2 * count > others}


class LineageWatch:
    """Which other peers this peer strikes for showing, round after round, a lineage other than the one their
    last round with it gave them (see the module's doc). Holds the lineage it expects of each member of its
    last whole round, and the outcomes of each peer's last ``window`` watched rounds where one was a break."""

    def __init__(self, breaks: int = LINEAGE_BREAKS, window: int = LINEAGE_WINDOW) -> None:
        self.breaks, self.window = breaks, window
        self.expected: dict[Any, tuple[int, bytes]] = {}  # peer -> (round, lineage) it should show then
        self.history: dict[Any, deque[bool]] = {}  # peer -> its last watched rounds (True: a break)

    def observe(self, me: Any, round_: int, gathered: Mapping[Any, Any], lineage: bytes | None) -> list:
        """After this peer's (``me``) all-reduce of round ``round_`` with the group that sent ``gathered``:
        note whether each member it expected in this round showed the lineage expected, then expect every
        other member to show ``lineage`` (the group's next one; None after a round that was partial here) in
        the next round. Returns the members struck from this round on."""
        newly = []
        for peer, item in gathered.items():
            expected = self.expected.get(peer)
            if peer == me or expected is None or expected[0] != round_:
                continue
            shown = item.get("lineage") if isinstance(item, dict) else None
            was = self.strikes(peer)
            history = self.history.setdefault(peer, deque(maxlen=self.window))
            history.append(shown != expected[1])
            if not any(history):  # only a break is worth remembering
                del self.history[peer]
            if not was and self.strikes(peer):
                newly.append(peer)
        self.expected = {peer: e for peer, e in self.expected.items() if e[0] > round_}
        if lineage is not None:
            self.expected.update({peer: (round_ + 1, lineage) for peer in gathered if peer != me})
        return newly

    def strikes(self, peer: Any) -> bool:
        """Whether this peer strikes ``peer`` now."""
        return sum(self.history.get(peer, ())) >= self.breaks

    def struck(self) -> list:
        """The peers this peer strikes, as bytes (what it sends at matchmaking), at most ``MAX_STRUCK``."""
        return [_peer_bytes(peer) for peer in self.history if self.strikes(peer)][:MAX_STRUCK]


def round_bits(round_: int) -> str:
    """The group bits of a round's matchmaking key (its ROUND_BITS low bits)."""
    return format(int(round_) % 2**ROUND_BITS, f"0{ROUND_BITS}b")


def next_lineage(round_: int, gathered: dict[Any, Any]) -> bytes:
    """The lineage every member of a group that averaged in round ``round_`` takes: a digest of the round, the
    members and their lineages, the same on each of them (``gathered``: member's peer id -> what it sent)."""
    digest = hashlib.blake2b(str(int(round_)).encode(), digest_size=LINEAGE_BYTES)
    for peer_id in sorted(gathered, key=lambda p: p.to_bytes()):
        item = gathered[peer_id]
        lineage = item.get("lineage") if isinstance(item, dict) else None
        digest.update(peer_id.to_bytes())
        digest.update(lineage if isinstance(lineage, bytes) else b"?")
    return digest.digest()


class Voucher:
    """The lineage a DiLoCo peer serves with its state. The peer vouches for its global parameters as they are
    after a round's outer step, a download or a resume: a newcomer that downloads them in that round takes
    the peer's lineage too, so that its first round with the group need not carry the outer state. Kept with
    their sampled values (cotrain.algorithms.fingerprint): a served state whose values differ (an outside
    write since) is served without a lineage, as is one of another round."""

    def __init__(self, parameters: int) -> None:
        self.parameters = parameters  # how many global parameters lead a served state's tensors
        self.vouched: tuple[int, bytes, torch.Tensor] | None = None

    def vouch(self, epoch: int, lineage: bytes, global_parameters: Sequence[torch.Tensor]) -> None:
        """Vouch for ``global_parameters`` at round ``epoch`` (the caller holds the state's lock)."""
        self.vouched = (epoch, lineage, sampled_values(global_parameters, epoch))

    def withdraw(self) -> None:
        self.vouched = None

    def served(self, epoch: Any, tensors: list[torch.Tensor]) -> bytes | None:
        """The lineage to serve with a state of round ``epoch`` whose first tensors are the global parameters
        (the caller holds the state's lock): the one vouched for, where the round and the values are the
        same."""
        vouched = self.vouched
        if vouched is None or vouched[0] != epoch or len(tensors) < self.parameters:
            return None
        if not torch.equal(sampled_values(tensors[: self.parameters], epoch), vouched[2]):
            return None
        return vouched[1]
