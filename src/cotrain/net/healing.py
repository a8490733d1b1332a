"""Self-healing membership: a peer cut off from the swarm finds its way back without a restart.

hivemind's DHT contacts its initial peers only at start-up, and removes a peer from its routing table when a
request to it fails. A peer whose links fail for a while (a network partition, a dropped Wi-Fi link, a router
restarting) therefore ends up with an empty routing table while the others drop it from theirs: when the
links come back nobody contacts anybody, and the peer trains alone for good.

``SwarmHealer`` is a background thread that watches for this. Every few seconds it pings a few peers of the
DHT's routing table (inside the DHT process, through ``DHT.run_coroutine``). When none has answered for a
while, the peer counts as cut off: it stops serving its state to others (it is diverging from the swarm's)
and, each period, dials its initial peers again (``p2pd``'s connect with their addresses) and pings every
peer it knew (libp2p still knows their addresses), until one answers; it then refills its routing table
from them (a lookup of its own DHT id, as at start-up). Peers it reaches add it back to their tables.

Whatever the peer did while cut off (it may have taken optimizer steps alone), its state is no longer the
swarm's, and the swarm's state wins: the healer sets ``resync``, and the training loop calls
``adopt_swarm_state`` between two steps, which loads the swarm's current state even when its step number is
lower than the peer's own, and only then serves the peer's state to others again. Not lower than the step at
which the peer was cut off, though: the swarm had that step when they parted, and a state from before it is a
laggard's (a peer that joined just before the cut and could not download the state since), not the swarm's;
with no other state as recent, the peer goes on with its own, which the laggard then loads.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from typing import TYPE_CHECKING, Any

import hivemind
from hivemind.p2p import PeerID

from cotrain.hivemind_ext.hooks import p2p_client
from cotrain.hivemind_ext.hosting import join_at_exit
from cotrain.hivemind_ext.optimizer import load_state_bounded
from cotrain.hivemind_ext.unexported import Multiaddr
from cotrain.net.served import served_epochs

if TYPE_CHECKING:
    from cotrain.hivemind_ext.optimizer import SwarmOptimizer

logger = logging.getLogger(__name__)

CHECK_PERIOD = 5.0  # seconds between two checks of the peer's links
ISOLATED_AFTER = 15.0  # seconds without an answer from any peer before the peer counts as cut off
REJOIN_PERIOD = 2.0  # seconds between two attempts to re-join while cut off
PING_SAMPLE = 3  # peers of the routing table pinged at each check
CALL_TIMEOUT = 5.0  # seconds for one round of pings, dials or the routing-table lookup
REMEMBERED_PEERS = 64  # peers it knew that are tried again when cut off (the most recently seen)


async def probe_links(dht: hivemind.DHT, node, sample: int, timeout: float) -> tuple[int, int, list[str]]:
    """Run in the DHT process: ping up to ``sample`` peers of the routing table.

    Returns (peers that answered, size of the routing table, base58 ids of the peers in the table)."""
    table = node.protocol.routing_table
    peers = [p for p in table.peer_id_to_uid if p != node.peer_id]
    random.shuffle(peers)
    answered = 0
    if peers:
        tasks = [asyncio.create_task(node.protocol.call_ping(p)) for p in peers[:sample]]
        done, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:
            task.cancel()
        answered = sum(1 for t in done if t.exception() is None and t.result() is not None)
    return answered, len(peers), [p.to_base58() for p in peers]


async def rejoin(dht: hivemind.DHT, node, initial_peers: list[str], known: list[str], timeout: float) -> int:
    """Run in the DHT process: dial the initial peers and ping every peer known before; when any answers,
    refill the routing table from it. Returns the number of peers that answered."""
    addresses: dict[str, list[Multiaddr]] = {}
    for maddr in initial_peers:
        base, _, peer = maddr.partition("/p2p/")
        if peer:
            addresses.setdefault(peer.split("/")[0], []).append(Multiaddr(base))
    for peer in known:
        addresses.setdefault(peer, [])
    node.blacklist.clear()  # peers that failed while the links were down would be skipped for minutes

    async def reach(peer_b58: str, maddrs: list[Multiaddr]) -> bool:
        peer_id = PeerID.from_base58(peer_b58)
        if peer_id == node.peer_id:
            return False
        if maddrs:
            try:
                await asyncio.wait_for(p2p_client(node.p2p).connect(peer_id, maddrs), timeout)
            except Exception as e:  # the ping below still tries the addresses libp2p remembers
                logger.debug(f"dialing {peer_b58} failed: {e!r}")
        try:
            return await asyncio.wait_for(node.protocol.call_ping(peer_id), timeout) is not None
        except Exception:
            return False

    results = await asyncio.gather(*(reach(p, a) for p, a in addresses.items()), return_exceptions=True)
    answered = sum(1 for r in results if r is True)
    if answered:
        try:
            await asyncio.wait_for(node.find_nearest_nodes([node.node_id]), timeout)
        except Exception as e:
            logger.debug(f"refilling the routing table: {e!r}")
    return answered


class SwarmHealer(threading.Thread):
    """Watches this peer's links to the swarm and re-joins it after they were lost (see the module doc)."""

    def __init__(
        self,
        dht: hivemind.DHT,
        initial_peers: list[str],
        stop: threading.Event,
        strategy: Any = None,
        *,
        check_period: float = CHECK_PERIOD,
        isolated_after: float = ISOLATED_AFTER,
        timeout: float = CALL_TIMEOUT,
    ):
        super().__init__(daemon=True, name="swarm-healer")
        # the peer's training strategy (cotrain.strategies.base.Strategy): None when nothing trains here
        self.dht, self.initial_peers, self.strategy = dht, list(initial_peers), strategy
        self.check_period, self.isolated_after, self.timeout = check_period, isolated_after, timeout
        self.stop = stop
        self._closed = threading.Event()
        self.known: dict[str, float] = {}  # base58 peer id -> last time it was in the routing table
        self.last_contact = time.monotonic()
        self.ever_connected = False  # a first peer alone from the start is not cut off: nobody is there yet
        self.isolated_since: float | None = None
        self.epoch_when_isolated = 0
        self.isolations = 0
        self.rejoins = 0
        self.resync = threading.Event()  # set: back from a partition, the peer must adopt the swarm's state

    @property
    def isolated(self) -> bool:
        return self.isolated_since is not None

    def close(self) -> None:
        self._closed.set()
        join_at_exit(self)  # it may be loading the swarm's state

    def _stopping(self) -> bool:
        return self.stop.is_set() or self._closed.is_set()

    def run(self) -> None:
        while not (self.stop.wait(self._period()) or self._closed.is_set()):
            try:
                self.check()
            except Exception as e:  # the DHT shutting down, a busy machine: try again next period
                if self._stopping():
                    return
                logger.debug(f"checking the swarm links: {e!r}")

    def _period(self) -> float:
        return min(self.check_period, REJOIN_PERIOD) if self.isolated else self.check_period

    def check(self) -> None:
        from functools import partial

        answered, table_size, table = self.dht.run_coroutine(
            partial(probe_links, sample=PING_SAMPLE, timeout=self.timeout)
        )
        now = time.monotonic()
        for peer in table:
            self.known[peer] = now
        if len(self.known) > REMEMBERED_PEERS:
            for peer in sorted(self.known, key=self.known.get)[: len(self.known) - REMEMBERED_PEERS]:
                del self.known[peer]
        if answered:
            self.last_contact, self.ever_connected = now, True
            if self.isolated:
                self._back(now, answered)
            return
        if not (self.ever_connected or self.initial_peers):
            self.last_contact = now
            return
        if not self.isolated and now - self.last_contact >= self.isolated_after:
            self._cut_off(now, table_size)
        if self.isolated:
            t = self.timeout
            reached = self.dht.run_coroutine(
                partial(rejoin, initial_peers=self.initial_peers, known=list(self.known), timeout=t)
            )
            if reached and not self._stopping():
                self.last_contact = time.monotonic()
                self._back(self.last_contact, reached)

    def _cut_off(self, now: float, table_size: int) -> None:
        self.isolated_since = now
        self.isolations += 1
        self.epoch_when_isolated = self.strategy.global_step if self.strategy is not None else 0
        if self.strategy is not None:
            self.strategy.share_state(False)  # its state is diverging from the swarm's
        logger.warning(
            f"No other peer has answered for {now - self.last_contact:.0f} s ({table_size} in the routing "
            f"table): this peer is cut off from the swarm. Contacting its {len(self.initial_peers)} initial "
            f"peers and the {len(self.known)} peers it knew until one answers"
        )

    def _back(self, now: float, answered: int) -> None:
        alone = now - (self.isolated_since or now)
        self.isolated_since = None
        self.rejoins += 1
        strategy = self.strategy
        steps_alone = (strategy.global_step - self.epoch_when_isolated) if strategy is not None else 0
        logger.info(
            f"Back in the swarm after {alone:.0f} s cut off: {answered} peers answered"
            + (f"; {steps_alone} global steps were taken alone meanwhile" if steps_alone > 0 else "")
        )
        if self.strategy is not None:
            self.resync.set()  # the training loop adopts the swarm's state, then shares its own again


def adopt_swarm_state(opt: SwarmOptimizer, run_id: str, timeout: float, should_stop, floor: int = 0) -> bool:
    """Replace this peer's state with the swarm's current one, even when the swarm's step number is lower
    than this peer's (after training alone, its own steps are not the swarm's), but not lower than ``floor``
    (the step at which this peer was cut off: see the module's doc). Call it from the training thread, between
    two optimizer steps. Tries the peers that serve the state until one delivers, for up to ``timeout``
    seconds. Returns True if the swarm's state was loaded."""

    averager = opt.state_averager
    me = opt.dht.peer_id.to_bytes()

    def others_serve() -> bool:
        return any(peer != me and epoch >= floor for peer, epoch in served_epochs(opt.dht, run_id).items())

    if not others_serve():
        logger.info(
            f"No other peer serves the swarm's state at step {floor} or later (where this peer left it): "
            "this peer goes on with its own"
        )
        averager.allow_state_sharing = not opt.client_mode  # as hivemind.Optimizer sets it
        return False
    if opt.scheduled_grads is not None and not opt.scheduled_grads.done():
        opt.tag_along_with_zero_weight(opt.scheduled_grads)  # as hivemind does: others' round goes on
        opt.scheduled_grads = None
    averager.step(wait_for_delayed_updates=True)
    own_epoch = opt.local_epoch
    averager.allow_state_sharing = False
    averager.local_epoch = floor  # hivemind refuses a state whose step is lower than the peer's own
    loaded = False
    deadline = time.monotonic() + timeout
    try:
        # hivemind gives up after one failed download (a busy peer): try again until the deadline
        while not loaded and not should_stop() and (remaining := deadline - time.monotonic()) > 0:
            loaded = load_state_bounded(opt, remaining, should_stop)
            if not loaded:
                logger.info(f"The swarm's state did not arrive; trying again ({remaining:.0f} s left)")
                time.sleep(1.0)
                if not others_serve():
                    break
    finally:
        if not loaded:
            logger.warning("Could not load the swarm's state; this peer goes on with its own")
            averager.local_epoch = own_epoch
            opt.tracker.report_local_progress(local_epoch=own_epoch, samples_accumulated=0)
        if not opt.client_mode:
            averager.state_sharing_priority = opt.local_epoch
        averager.allow_state_sharing = not opt.client_mode  # as hivemind.Optimizer sets it
    return loaded
