"""Corrections to hivemind 1.1.12 that cotrain's peers need; ``apply()`` installs them (idempotent).

- ``DecentralizedAverager._shutdown`` calls ``finalize`` on the futures of its running all-reduce groups
  instead of on the runners they hold, so a peer stopped in the middle of an averaging round ended its
  averager process with an AttributeError traceback. The replacement cancels what is still pending and
  finalizes the runners that exist.
- After ``load_state_from_peers``, ``TrainingStateAverager`` steps a newcomer's LR scheduler forward to the
  swarm's epoch before its optimizer ever stepped, and PyTorch warns ("lr_scheduler.step() before
  optimizer.step()") with a source line. The schedule it reaches is right; the warning is dropped for that
  module only, so a user's own misuse elsewhere still warns.
"""

from __future__ import annotations

import asyncio
import logging
import warnings

from hivemind.averaging.averager import DecentralizedAverager

logger = logging.getLogger(__name__)


async def _shutdown(self: DecentralizedAverager, timeout: float | None) -> None:
    if not self.client_mode:
        await self.remove_p2p_handlers(self._p2p, namespace=self.prefix)
    for future in list(self._running_groups.values()):
        if not future.done():
            future.cancel()
        elif not future.cancelled() and future.exception() is None:
            future.result().finalize(cancel=True)
    await asyncio.sleep(0)  # let the cancelled rounds see it before the process ends


def apply() -> None:
    warnings.filterwarnings(
        "ignore",
        message=r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`",
        category=UserWarning,
        module=r"hivemind\.optim\.state_averager",
    )
    if DecentralizedAverager._shutdown is not _shutdown:
        DecentralizedAverager._shutdown = _shutdown
        logger.debug("hivemind averager shutdown replaced")
