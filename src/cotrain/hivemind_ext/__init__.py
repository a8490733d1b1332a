"""The wall around hivemind: everything in cotrain that subclasses a hivemind class, imports a hivemind module
beyond its public API (``manifest.PUBLIC``), or replaces, overrides, copies, calls or reads a hivemind name
starting with ``_`` is in this package, and nothing outside it does
(tests/unit/hivemind_ext/test_internals.py checks all three, and that each override and copy is in the
manifest).

- ``manifest``: each hivemind function touched, how, by what in cotrain, why, and the hash of the source it
  was written against; ``changed()`` turns a hivemind upgrade into a checklist; ``PUBLIC``: the modules
  code elsewhere may import;
- ``hooks``: hivemind's private methods under public names (the bases ``Averager``, ``Optimizer``,
  ``Tracker``, ``Runner``, ``DHT``, ``Authorizer``, and helpers for private calls); cotrain's averagers,
  optimizer and tracker override those;
- ``unexported``: the hivemind names that no hivemind package exports but code elsewhere uses;
- ``fixes``: corrections to hivemind's behaviour, installed by ``install()``;
- ``hosting``: hivemind's DHT and averagers served from threads of the peer's process;
- ``requestpipe``: the DHT's request pipe without a handshake per request; ``dht``: the DHT cotrain starts
  (cotrain.net.dht.create_dht) and its record validator; ``validators``: cotrain's own record validators;
- the averagers (``averaging``, ``outer``: DiLoCo's round, ``statecheck``, ``diloco_state``, ``auxiliary``,
  ``direct``, ``liveness``), the optimizer, the progress tracker, the all-reduce runner and reducers, and a
  private swarm's authorizer and guard.

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
        from cotrain.hivemind_ext import fixes  # deferred: read once hivemind is checked

        fixes.apply()
        _done.append(True)
