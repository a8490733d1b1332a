"""What cotrain replaces, overrides, copies, calls or reads of hivemind's private internals, and why: one
entry per hivemind function, with the hash of the source it was written against.

An upgrade of hivemind is a checklist: ``changed()`` names every function whose source differs from the one
recorded here (tests/test_internals.py fails naming them); re-read each, adapt cotrain's side (``by``), then
record the new hash (``python -m cotrain.hivemind_ext.manifest`` prints them). ``missing()`` names those
that no longer exist at all, and ``install()`` refuses to start on them: an override of a renamed method
would silently never be called.

The source is read from hivemind's module files (``inspect.getsource`` of the module, the function found in
it by name), so the functions cotrain replaces at run time are hashed as hivemind wrote them.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
from dataclasses import dataclass

HIVEMIND_VERSION = "1.1.12"  # the release every hash below was taken from


@dataclass(frozen=True)
class Touch:
    target: str  # a hivemind function or method, by module and qualified name
    how: str  # replaced (at run time), overridden (in a subclass), copied (adapted), called, read
    by: str  # where cotrain does it
    why: str
    sha: str  # sha256 of the target's source (first 16 hex digits)
    names: tuple[str, ...] = ()  # for "read": the private attributes the target sets and cotrain reads


AVG = "hivemind.averaging.averager.DecentralizedAverager"
OPT = "hivemind.optim.optimizer.Optimizer"
STATE = "hivemind.optim.state_averager.TrainingStateAverager"
HOOKS = "cotrain.hivemind_ext.hooks"

MANIFEST: tuple[Touch, ...] = (
    # replaced at run time (install())
    Touch(
        f"{AVG}._shutdown",
        "replaced",
        "cotrain.hivemind_ext.fixes._shutdown; hosting.ServedInThread",
        "finalized its rounds' futures, not their runners (a peer stopped mid-round crashed its averager); "
        "a thread's loop also cancels and awaits what is left",
        "8420eecefef0bfe1",
    ),
    Touch(
        f"{AVG}._declare_for_download_periodically",
        "replaced",
        "cotrain.hivemind_ext.fixes",
        "stored the same record a dozen times a second during an all-reduce",
        "dac3b587ccad8722",
    ),
    Touch(
        "hivemind.averaging.matchmaking.PotentialLeaders._update_queue_periodically",
        "replaced",
        "cotrain.hivemind_ext.fixes",
        "read the would-be leaders from the DHT without pause (228 reads/s)",
        "75da6c960bbf09f4",
    ),
    Touch(
        "hivemind.p2p.servicer.ServicerBase.remove_p2p_handlers",
        "replaced",
        "cotrain.hivemind_ext.fixes",
        "waited forever for a daemon that had already ended",
        "b082faefcb633cd3",
    ),
    Touch(
        "hivemind.utils.mpfuture.MPFuture.__setstate__",
        "replaced",
        "cotrain.hivemind_ext.hosting",
        "a future unpickled in its own process took itself for the original (threads serving)",
        "90afdaa746634ca9",
        ("_origin_pid",),
    ),
    Touch(
        "hivemind.utils.mpfuture.MPFuture._set_event_threadsafe",
        "replaced",
        "cotrain.hivemind_ext.hosting",
        "ran another thread's idle loop (threads serving)",
        "e47040798bb9403e",
        ("_loop", "_aio_event"),
    ),
    Touch(
        "hivemind.utils.asyncio.switch_to_uvloop",
        "replaced",
        "cotrain.hivemind_ext.hosting",
        "a serving thread's loop finishes its tasks when it closes (replaced in the averager, DHT modules)",
        "109aa0e27ad8a336",
    ),
    Touch(
        "hivemind.dht.dht.DHT.run",
        "replaced",
        "cotrain.hivemind_ext.hosting._SignalsOutsideMainThread",
        "its signal.signal call is allowed only in the main thread (the DHT module's signal is replaced)",
        "ce5055303b827ec6",
    ),
    # overridden through the hook bases (hooks.py), copied where the hook's override adapts hivemind's code
    Touch(
        f"{AVG}._run_allreduce_inplace_",
        "copied",
        f"{HOOKS}.Averager; cotrain.hivemind_ext.reducers.RobustAveraging",
        "the all-reduce with cotrain's robust runner and bounded application",
        "1e8649d70494d9d1",
    ),
    Touch(
        f"{AVG}._aggregate_with_group",
        "copied",
        f"{HOOKS}.Averager; cotrain.algorithms.lineage.OuterAverager",
        "DiLoCo's rounds send the outer state only where the lineages that count in the group differ",
        "0b9ff15fd3fc9676",
    ),
    Touch(
        f"{AVG}._load_state_from_peers",
        "copied",
        f"{HOOKS}.Averager; cotrain.hivemind_ext.statecheck.CheckedStateDownloads",
        "a donor's state is checked against published fingerprints, a size budget and (DiLoCo) its round",
        "db5f94b8ebb56fc1",
    ),
    Touch(
        "hivemind.p2p.servicer.ServicerBase._get_handle_name",
        "overridden",
        f"{HOOKS}.Averager.handler_class",
        "the sync state averager keeps hivemind's protocol names",
        "2460e1e66c820ba3",
    ),
    Touch(
        f"{OPT}._make_progress_tracker",
        "overridden",
        "cotrain.hivemind_ext.optimizer.SwarmOptimizer",
        "cotrain's tracker (gone peers, robust counting)",
        "19ebff151cfe85ad",
    ),
    Touch(
        f"{OPT}._make_state_averager",
        "overridden",
        "cotrain.hivemind_ext.optimizer.SwarmOptimizer",
        "the checked state averager",
        "4e2d2b03cefe5998",
    ),
    Touch(
        f"{OPT}._average_gradients_and_load_into_optimizer",
        "overridden",
        "cotrain.hivemind_ext.optimizer.SwarmOptimizer",
        "counts rounds and group sizes",
        "c0459b56003a2596",
    ),
    Touch(
        f"{OPT}._maybe_schedule_gradient_averaging",
        "overridden",
        "cotrain.hivemind_ext.optimizer.SwarmOptimizer",
        "no matchmaking while alone",
        "180134eb614e0095",
    ),
    Touch(
        f"{OPT}._update_global_epoch",
        "overridden",
        "cotrain.hivemind_ext.optimizer.SwarmOptimizer",
        "a peer left behind loads the swarm's state instead of stepping alone",
        "0786ab6afe75a7e9",
    ),
    Touch(
        "hivemind.optim.progress_tracker.ProgressTracker._progress_reporter",
        "read",
        f"{HOOKS}.Tracker.signal_reports_with; cotrain.hivemind_ext.progress.PacedSignal",
        "stored a record at every report_local_progress (every inner step of DiLoCo, each store reading "
        "every peer's record first): DiLoCo paces the signal that wakes it",
        "1fae03054fe2177d",
    ),
    Touch(
        "hivemind.optim.progress_tracker.ProgressTracker._parse_swarm_progress_data",
        "copied",
        f"{HOOKS}.Tracker; cotrain.hivemind_ext.progress",
        "gone peers left out; robust counting copies it",
        "d276f107c99e8fce",
    ),
    # the reducer of a part (public names, overridden in cotrain.hivemind_ext.reducers.RobustPartReducer)
    Touch(
        "hivemind.averaging.partition.TensorPartReducer.accumulate_part",
        "copied",
        "cotrain.hivemind_ext.reducers.RobustPartReducer",
        "contributions checked (shape, weight, finite values, records) and kept as sent, not summed at once",
        "9e7690629be6676e",
    ),
    Touch(
        "hivemind.averaging.partition.TensorPartReducer.check_current_part_finished",
        "overridden",
        "cotrain.hivemind_ext.reducers.RobustPartReducer",
        "a finished part is combined in the reducer's thread, off the averager's event loop",
        "c7ecebe5aa2eeb6c",
    ),
    Touch(
        "hivemind.averaging.partition.TensorPartReducer.reset_accumulators",
        "overridden",
        "cotrain.hivemind_ext.reducers.RobustPartReducer",
        "no dense accumulator: the senders' contributions are kept as sent",
        "58865dc0c6b2f39a",
    ),
    Touch(
        "hivemind.averaging.partition.TensorPartReducer.finalize",
        "overridden",
        "cotrain.hivemind_ext.reducers.RobustPartReducer",
        "the reducer's thread is shut down (the combines it holds still run)",
        "5573a5b15546e270",
    ),
    Touch(
        "hivemind.averaging.allreduce.AllReduceRunner._communicate_with_peer",
        "overridden",
        f"{HOOKS}.Runner; cotrain.hivemind_ext.reducers.RobustAllReduceRunner",
        "a peer whose own part was refused goes on without it",
        "0f1c2724f260d733",
    ),
    Touch(
        "hivemind.utils.auth.TokenAuthorizerBase.refresh_token_if_needed",
        "copied",
        f"{HOOKS}.Authorizer",
        "no assertion on the peer's own token (its access watcher reports it)",
        "e4f0b89a13d82ca2",
        ("_local_access_token", "_refresh_lock"),
    ),
    # called
    Touch(
        f"{OPT}._tag_along_with_zero_weight",
        "called",
        f"{HOOKS}.Optimizer.tag_along_with_zero_weight",
        "a round scheduled before a download goes on without this peer's weight",
        "771183d83e9de9ef",
    ),
    Touch(
        "hivemind.p2p.servicer.ServicerBase._collect_rpc_handlers",
        "called",
        f"{HOOKS}.Averager.serve_only",
        "an averager registers some of its handlers only (two of one prefix in the monitor: keeper, reducer)",
        "420cdc249473cc36",
        ("_rpc_handlers",),
    ),
    Touch(
        f"{STATE}._load_local_tensors_into_averager_",
        "called",
        f"{HOOKS}.load_local_tensors",
        "a checkpoint or backup loaded into the optimizer reaches the averager's tensors",
        "1592a6fc6f818d64",
    ),
    Touch(
        f"{STATE}._apply_optimizer_parameters_",
        "called",
        f"{HOOKS}.apply_optimizer_parameters",
        "DiLoCo's global parameters into the model's",
        "61b739328434f0a1",
    ),
    Touch(
        "hivemind.averaging.allreduce.AllReduceRunner._ban_sender",
        "called",
        f"{HOOKS}.Runner.ban_sender",
        "drop a sender's contribution from the round",
        "ff2ac3eff294bf0c",
    ),
    Touch(
        "hivemind.dht.dht.DHT._get_p2p_daemon_listen_maddr",
        "called",
        f"{HOOKS}.DHT.daemon_listen_maddr",
        "a replica of the DHT's P2P per serving thread",
        "98c236957589ee77",
    ),
    Touch(
        f"{STATE}._do",
        "called",
        "cotrain.hivemind_ext.liveness.WatchedRounds (relied on)",
        "the state averager begins its rounds through step(), which the round watch sees",
        "de445bef80f83979",
    ),
    # read
    Touch(
        f"{AVG}.__init__",
        "read",
        f"{HOOKS}.Averager",
        "all-reduce settings; the request pipe",
        "75d089f9ba0e822f",
        ("_averaging_alpha", "_allreduce_timeout", "_outer_pipe", "_running_groups"),
    ),
    Touch(
        f"{AVG}._run_internal",
        "read",
        f"{HOOKS}.Averager; cotrain.hivemind_ext.hosting.ServedInThread",
        "the averager's P2P and matchmaking; an averager served from a thread runs this loop directly",
        "49c04c0695ad197a",
        ("_p2p", "_matchmaking", "_state_updated"),
    ),
    Touch(
        "hivemind.dht.dht.DHT.__init__",
        "read",
        f"{HOOKS}.DHT; cotrain.hivemind_ext.requestpipe",
        "the request pipes and the record validator are wrapped",
        "3ef29c766f3207d1",
        ("_outer_pipe", "_inner_pipe", "_record_validator"),
    ),
    Touch(
        "hivemind.p2p.p2p_daemon.P2P.create",
        "read",
        f"{HOOKS}.p2p_client",
        "dialing a peer at given addresses",
        "505b1be984fa2a65",
        ("_client",),
    ),
    Touch(
        "hivemind.utils.auth.TokenAuthorizerBase.__init__",
        "read",
        f"{HOOKS}.Authorizer",
        "the peer's key follows its token file",
        "5daecea52d3bc62b",
        ("_local_private_key", "_local_access_token", "_refresh_lock"),
    ),
    Touch(
        "hivemind.utils.mpfuture.MPFuture._maybe_initialize_mpfuture_backend",
        "read",
        "cotrain.hivemind_ext.requestpipe",
        "a process's reply pipe crosses once",
        "6a0537cddccc8290",
        ("_global_sender_pipe",),
    ),
)


def _split(target: str) -> tuple[object, list[str]]:
    """The module of ``target`` and the rest of its dotted name."""
    parts = target.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            return importlib.import_module(".".join(parts[:i])), parts[i:]
        except ImportError:
            continue
    raise LookupError(f"no module in {target!r}")


def source_of(target: str) -> str | None:
    """The source of a hivemind function or method as its module's file has it (None: it is gone)."""
    module, names = _split(target)
    text = inspect.getsource(module)
    body = ast.parse(text).body
    node = None
    for name in names:
        found = [n for n in body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)]
        node = next((n for n in found if n.name == name), None)
        if node is None:
            return None
        body = node.body
    return ast.get_source_segment(text, node)


def digest(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def missing() -> list[str]:
    """Targets that no longer exist, or no longer set the private attributes cotrain reads."""
    gone = []
    for touch in MANIFEST:
        source = source_of(touch.target)
        if source is None:
            gone.append(touch.target)
        else:
            gone += [f"{touch.target} ({name})" for name in touch.names if name not in source]
    return gone


def changed() -> list[str]:
    """The targets whose source differs from the one recorded (each to re-read, where cotrain uses it)."""
    out = []
    for touch in MANIFEST:
        source = source_of(touch.target)
        if source is None or digest(source) != touch.sha:
            out.append(f"{touch.target} ({touch.how} by {touch.by})")
    return out


if __name__ == "__main__":
    for touch in MANIFEST:
        source = source_of(touch.target)
        print(touch.target, None if source is None else digest(source))
