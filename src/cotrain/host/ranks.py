"""The ranks of a peer of several GPUs: read from torchrun's environment, or launched by cotrain itself.

- Under ``torchrun --nproc-per-node N cotrain train ...`` every rank is a ``cotrain train`` of its own and
  torchrun's agent stops them all when one fails; cotrain launches nothing (``rank_env``).
- ``cotrain train --nproc-per-node N`` (or ``--devices`` listing several GPUs, with DiLoCo): the worker is
  rank 0 and starts the N-1 others as processes of the same worker (``Ranks``), with torchrun's
  variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), in its process group: the supervisor's stop, and
  its kill after the grace period, reach them too. A launched rank watches rank 0 as a worker watches its
  supervisor, so it stops when rank 0's process is gone, however it went. Rank 0 watches the others: when
  one ends before it was told to, the peer stops with one line naming that rank (``failure``), and if rank
  0 is stuck in a collective, the group is killed after the grace period.

The ranks cotrain launches meet in a private rendezvous: a ``torch.distributed.FileStore`` inside a folder
that rank 0 creates with mode 0700 (``tempfile.mkdtemp``) and removes at the end, whose path the ranks get in
their environment (``COTRAIN_NODE_RENDEZVOUS``, never on a command line). Every rank checks that the folder
is its own user's and closed to everyone else before it opens the store, so a process of another user of the
machine can neither read the store's keys (the ranks' addresses) nor write its own, and cannot join the
process group. (A ``TCPStore`` on a loopback port would let any local user connect, list its keys and
overwrite them.) The collectives' own sockets are still TCP on the loopback interface.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from cotrain.config import Config
from cotrain.errors import UserError
from cotrain.host.procs import GRACE_SECONDS, SUPERVISOR_ENV, kill_group, start_worker

logger = logging.getLogger(__name__)

# set for the ranks cotrain launched: the private folder of the store they meet in
RENDEZVOUS = "COTRAIN_NODE_RENDEZVOUS"
STORE_FILE = "store"
IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
RENDEZVOUS_TIMEOUT = timedelta(minutes=5)  # every rank joins within this (importing torch, reading data)
# a rank waits for rank 0 through a whole swarm round (matchmaking, averaging, a download): gloo and NCCL
# give up on a collective after this long
COLLECTIVE_TIMEOUT = timedelta(hours=6)


def rank_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when this process is one rank of several, else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    world = int(os.environ["WORLD_SIZE"])
    if world <= 1:
        return None
    rank = int(os.environ["RANK"])
    return rank, world, int(os.environ.get("LOCAL_RANK", rank))


def private_folder() -> str:
    """A new folder for a node's rendezvous: an unpredictable name, created exclusively, mode 0700."""
    return tempfile.mkdtemp(prefix="cotrain-ranks-")


def rendezvous_problem(folder: str) -> str | None:
    """Why the ranks must not meet in ``folder``, in a few words; None when it is a folder (not a link) that
    this process's user owns and that no other user may enter, read or write."""
    try:
        info = os.lstat(folder)
    except OSError as e:
        return f"it cannot be opened ({e.strerror})"
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a folder"
    if info.st_uid != os.getuid():
        return "another user owns it"
    if info.st_mode & 0o077:
        return f"other users may open it (mode {stat.filemode(info.st_mode)})"
    return None


def node_store(world: int) -> dist.Store:
    """The store that the ranks cotrain launched meet in (see the module's doc), after checking its folder."""
    folder = os.environ.get(RENDEZVOUS, "")
    problem = rendezvous_problem(folder) if folder else "none was given"
    if problem is not None:
        raise UserError(
            f"the ranks of this peer cannot meet in their rendezvous folder {folder!r}: {problem}"
        )
    store = dist.FileStore(os.path.join(folder, STORE_FILE), world)
    store.set_timeout(RENDEZVOUS_TIMEOUT)
    return store


def loopback_interface() -> str:
    """The name of this machine's loopback interface (lo on Linux, lo0 on macOS)."""
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    return names[0] if names else "lo"


def init_ranks(device: torch.device) -> None:
    """Join this node's process group. Ranks cotrain launched (RENDEZVOUS in the environment) meet in its
    private store (``node_store``), and the collectives' sockets are on the loopback interface. Under
    torchrun: its rendezvous (env://)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not os.environ.get(RENDEZVOUS):
        dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)
        return
    for name in IFNAME_VARIABLES:
        os.environ.setdefault(name, loopback_interface())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = node_store(world)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)


def leave_ranks() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as e:  # a failed node: the others are gone already
            logger.debug(f"destroy_process_group: {e!r}")


def exit_reason(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


class Ranks:
    """Rank 0's launch of ranks 1..world-1 of this peer (see the module's doc)."""

    def __init__(self, config: Config, world: int, stop: threading.Event) -> None:
        self.world, self.stop = world, stop
        self.failure: str | None = None
        self._closing = False
        self.rendezvous = private_folder()  # the process group's store, this user's only
        common = {"WORLD_SIZE": str(world), RENDEZVOUS: self.rendezvous}
        common.update(dict.fromkeys(IFNAME_VARIABLES, loopback_interface()))
        os.environ.update(common, RANK="0", LOCAL_RANK="0")
        command = [sys.executable, "-m", "cotrain._worker", "train", "--resolved-config", "-"]
        env = dict(os.environ, **{SUPERVISOR_ENV: str(os.getpid())})  # each watches rank 0 as its supervisor
        self.procs: dict[int, subprocess.Popen] = {}
        try:
            for rank in range(1, world):
                rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
                self.procs[rank] = start_worker(command, config, env=rank_env)
        except BaseException:
            self.close(timeout=1.0)
            raise
        threading.Thread(target=self._watch, daemon=True, name="rank-watch").start()

    def stopping(self) -> None:
        """Rank 0 is about to tell the others to stop: their exits are expected from now on."""
        self._closing = True

    def failed_rank(self, wait: float = 2.0) -> str | None:
        """Which rank stopped, waiting up to ``wait`` seconds for its exit to show (a collective can fail a
        moment before the process is gone)."""
        deadline = time.monotonic() + wait
        while self.failure is None and time.monotonic() < deadline:
            for rank, proc in self.procs.items():
                rc = proc.poll()
                if rc is not None:
                    self.failure = f"rank {rank} of this peer stopped ({exit_reason(rc)})"
                    break
            else:
                time.sleep(0.1)
        return self.failure

    def _watch(self) -> None:
        while not self._closing:
            for rank, proc in self.procs.items():
                rc = proc.poll()
                if rc is not None and not self._closing:
                    self.failure = f"rank {rank} of this peer stopped ({exit_reason(rc)})"
                    logger.debug(self.failure)
                    self.stop.set()
                    timer = threading.Timer(GRACE_SECONDS, self._stuck)
                    timer.daemon = True
                    timer.start()
                    return
            time.sleep(0.2)

    def _stuck(self) -> None:
        """Rank 0 did not come out of a collective after another rank stopped: end the peer here."""
        if self._closing:
            return
        logger.error(f"{self.failure}: stopping this peer")
        sys.stderr.flush()
        if os.getpgrp() == os.getpid():
            kill_group(os.getpgrp())
        os._exit(1)

    def close(self, timeout: float = GRACE_SECONDS) -> None:
        """Wait for the ranks to end (they were told to stop), then kill what is left; remove the
        rendezvous folder."""
        self._closing = True
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.rendezvous, ignore_errors=True)
