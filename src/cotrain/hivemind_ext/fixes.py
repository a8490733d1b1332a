"""Corrections to hivemind 1.1.12 that cotrain's peers need; ``apply()`` installs them (idempotent).

- ``DecentralizedAverager._shutdown`` calls ``finalize`` on the futures of its running all-reduce groups
  instead of on the runners they hold, so a peer stopped in the middle of an averaging round ended its
  averager process with an AttributeError traceback. The replacement cancels what is still pending and
  finalizes the runners that exist.
- A servicer (the DHT's protocol, an averager) removes its handlers from the ``p2pd`` daemon when it shuts
  down (``ServicerBase.remove_p2p_handlers``); a daemon that already ended (Ctrl+C reaches a script's whole
  process group) never answers, and the shutdown waited for it forever. The replacement gives up after
  ``HANDLER_REMOVAL_TIMEOUT`` seconds: the handlers went with the daemon.
- A peer looking for an averaging group reads the would-be leaders from the DHT again as soon as its queue
  of them runs empty (``PotentialLeaders._update_queue_periodically``): a peer waiting as the leader of its
  group read them without pause, measured at 228 reads a second (each a search across the DHT) in the demo's
  swarm. The replacement reads at most every ``POLL_FRACTION`` of the matchmaking time (at most
  ``MAX_POLL_INTERVAL`` s).
- An averager declares that it serves its state (``{prefix}.all_averagers``) whenever ``_state_updated`` is
  set, and an all-reduce sets it once per tensor it updates: a dozen stores a second of the same record. The
  replacement of ``_declare_for_download_periodically`` stores it again only when what it says (sharing on
  or off, the priority) changed, or before it expires.
- After ``load_state_from_peers``, ``TrainingStateAverager`` steps a newcomer's LR scheduler forward to the
  swarm's epoch before its optimizer ever stepped, and PyTorch warns ("lr_scheduler.step() before
  optimizer.step()") with a source line. The schedule it reaches is right; the warning is dropped for that
  module only, so a user's own misuse elsewhere still warns.
"""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from math import isfinite

from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.matchmaking import PotentialLeaders
from hivemind.p2p import P2P
from hivemind.p2p.servicer import ServicerBase
from hivemind.utils import get_dht_time
from hivemind.utils.timed_storage import MAX_DHT_TIME_DISCREPANCY_SECONDS as DISCREPANCY

logger = logging.getLogger(__name__)

POLL_FRACTION = 0.1  # of the matchmaking time: the least time between two reads of the would-be leaders
MAX_POLL_INTERVAL = 1.0  # seconds
HANDLER_REMOVAL_TIMEOUT = 2.0  # seconds a shutdown waits for the daemon to drop a servicer's handlers
_hivemind_remove_handlers = ServicerBase.remove_p2p_handlers
_hivemind_update_queue = PotentialLeaders._update_queue_periodically  # what apply() replaces (for its test)


async def _shutdown(self: DecentralizedAverager, timeout: float | None) -> None:
    if not self.client_mode:
        await self.remove_p2p_handlers(self._p2p, namespace=self.prefix)
    for future in list(self._running_groups.values()):
        if not future.done():
            future.cancel()
        elif not future.cancelled() and future.exception() is None:
            future.result().finalize(cancel=True)
    await asyncio.sleep(0)  # let the cancelled rounds see it before the process ends


async def _remove_p2p_handlers(self: ServicerBase, p2p: P2P, *, namespace: str | None = None) -> None:
    try:
        await asyncio.wait_for(
            _hivemind_remove_handlers(self, p2p, namespace=namespace), HANDLER_REMOVAL_TIMEOUT
        )
    except (TimeoutError, OSError) as e:
        logger.debug(f"{type(self).__name__}'s handlers were not removed (has p2pd ended?): {e!r}")


async def _update_queue_periodically(self: PotentialLeaders, key_manager: GroupKeyManager) -> None:
    interval = min(MAX_POLL_INTERVAL, POLL_FRACTION * self.min_matchmaking_time)
    while get_dht_time() < self.search_end_time:
        read_at = time.monotonic()  # the pace is kept on the monotonic clock (the host may step wall time)
        new_peers = await key_manager.get_averagers(key_manager.current_key, only_active=True)
        self.max_assured_time = max(
            self.max_assured_time,
            get_dht_time() + self.min_matchmaking_time - DISCREPANCY,
        )
        self.leader_queue.clear()
        for peer, peer_expiration_time in new_peers:
            if peer == self.peer_id or (peer, peer_expiration_time) in self.past_attempts:
                continue
            self.leader_queue.store(peer, peer_expiration_time, peer_expiration_time)
            self.max_assured_time = max(self.max_assured_time, peer_expiration_time - DISCREPANCY)
        self.update_finished.set()

        waits = {asyncio.create_task(self.running.wait()), asyncio.create_task(self.update_triggered.wait())}
        remaining = self.search_end_time - get_dht_time()
        _, pending = await asyncio.wait(
            waits, return_when=asyncio.ALL_COMPLETED, timeout=remaining if isfinite(remaining) else None
        )
        for task in pending:
            task.cancel()
        self.update_triggered.clear()
        pause = read_at + interval - time.monotonic()
        if pause > 0:
            await asyncio.sleep(min(pause, max(0.0, self.search_end_time - get_dht_time())))
            # the search's end is wall-clock time: slept to it on the monotonic clock, it may not have come
            # yet, and the next read still waits for the rest of the interval
            rest = read_at + interval - time.monotonic()
            if rest > 0 and get_dht_time() < self.search_end_time:
                await asyncio.sleep(rest)


def _declared(averager: DecentralizedAverager) -> float | None:
    """What an averager's record under ``{prefix}.all_averagers`` says: its priority, or None (no sharing)."""
    return averager.state_sharing_priority if averager.allow_state_sharing else None


async def _declare_for_download_periodically(self: DecentralizedAverager) -> None:
    download_key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
    sharing_was_allowed = self.allow_state_sharing
    while True:
        expiration_time = get_dht_time() + self.declare_state_period
        declared = _declared(self)
        if self.allow_state_sharing or sharing_was_allowed:
            # also when sharing was just switched off (the None overwrites the last record)
            asyncio.create_task(
                asyncio.wait_for(
                    self.dht.store(
                        download_key,
                        subkey=self.peer_id.to_bytes(),
                        value=declared,
                        expiration_time=expiration_time,
                        return_future=True,
                    ),
                    timeout=expiration_time - get_dht_time(),
                )
            )
            sharing_was_allowed = self.allow_state_sharing
        while True:  # again before the record expires, or once what it says changed
            self._state_updated.clear()
            try:
                await asyncio.wait_for(
                    self._state_updated.wait(), timeout=max(0.0, expiration_time - get_dht_time())
                )
            except TimeoutError:
                break
            if _declared(self) != declared:
                break


def apply() -> None:
    warnings.filterwarnings(
        "ignore",
        message=r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`",
        category=UserWarning,
        module=r"hivemind\.optim\.state_averager",
    )
    if DecentralizedAverager._shutdown is not _shutdown:
        DecentralizedAverager._shutdown = _shutdown
        DecentralizedAverager._declare_for_download_periodically = _declare_for_download_periodically
        PotentialLeaders._update_queue_periodically = _update_queue_periodically
        ServicerBase.remove_p2p_handlers = _remove_p2p_handlers
        logger.debug(
            "hivemind averager shutdown, handler removal, state declarations and leader search replaced"
        )
