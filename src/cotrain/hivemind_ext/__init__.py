"""The one door to hivemind's private internals: everything in cotrain that replaces, overrides, copies, calls
or reads a hivemind name starting with ``_`` is in this package, and nothing outside it uses one
(tests/test_internals.py checks both).

- ``manifest``: each hivemind function touched, how, by what in cotrain, why, and the hash of the source it
  was written against; ``changed()`` turns a hivemind upgrade into a checklist;
- ``hooks``: hivemind's private methods under public names (the bases ``Averager``, ``Optimizer``,
  ``Tracker``, ``Runner``, ``DHT``, ``Authorizer``, and helpers for private calls); cotrain's averagers,
  optimizer and tracker override those;
- ``fixes``: corrections to hivemind's behaviour, installed by ``install()``;
- ``hosting``: hivemind's DHT and averagers served from threads of the peer's process;
- ``requestpipe``: the DHT's request pipe without a handshake per request.

``install()`` is called before any swarm object is built (by the optimizers and the state keeper); it checks
the hivemind version and that every function the manifest names still exists, then installs ``fixes``.
"""

from __future__ import annotations

import logging
import threading

import hivemind

from cotrain.hivemind_ext.manifest import HIVEMIND_VERSION, MANIFEST, Touch, changed, missing

__all__ = ["HIVEMIND_VERSION", "MANIFEST", "Touch", "changed", "install", "missing"]

logger = logging.getLogger(__name__)

_installed = threading.Lock()
_done: list[bool] = []


def install() -> None:
    """Check hivemind against the manifest and install the fixes (idempotent, thread-safe)."""
    with _installed:
        if _done:
            return
        if hivemind.__version__ != HIVEMIND_VERSION:
            logger.warning(
                f"cotrain was written for hivemind {HIVEMIND_VERSION}, found {hivemind.__version__}: "
                f"functions to re-read: {', '.join(changed()) or 'none changed'}"
            )
        gone = missing()
        if gone:
            raise RuntimeError(
                f"hivemind {hivemind.__version__} lacks what cotrain overrides or reads: {', '.join(gone)} "
                f"(install hivemind=={HIVEMIND_VERSION})"
            )
        from cotrain.hivemind_ext import fixes

        fixes.apply()
        _done.append(True)
