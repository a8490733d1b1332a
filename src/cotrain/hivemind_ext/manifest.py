"""What cotrain replaces, overrides, copies, calls or reads of hivemind's private internals, and why: one
entry per hivemind function, with the hash of the source it was written against.

An upgrade of hivemind is a checklist: ``changed()`` names every function whose source differs from the one
recorded here (tests/swarm/test_internals.py fails naming them); re-read each, adapt cotrain's side
(``by``), then record the new hash (``python -m cotrain.hivemind_ext.manifest`` prints them).
``missing()`` names those that no longer exist at all, and ``install()`` refuses to start on them: an
override of a renamed method would silently never be called.

``PUBLIC`` is the part of hivemind that code outside this package may import: its packages' exports and
the documented record modules, each with why; the rest is named only inside cotrain.hivemind_ext.

The source is read from hivemind's module files (``inspect.getsource`` of the module, the function found in
it by name), so the functions cotrain replaces at run time are hashed as hivemind wrote them.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import inspect
from dataclasses import dataclass

HIVEMIND_VERSION = "1.1.12"  # the release every hash below was taken from

# hivemind's public API: the modules that code outside cotrain.hivemind_ext may import from (checked by
# tests/unit/hivemind_ext/test_internals.py). A package counts with the names its ``__init__`` exports;
# ``.*`` admits every submodule. Any other hivemind name needed elsewhere is re-exported by
# cotrain.hivemind_ext.unexported.
PUBLIC: tuple[tuple[str, str], ...] = (
    ("hivemind", "the top-level classes: DHT, DecentralizedAverager, Optimizer"),
    ("hivemind.dht", "DHT, DHTNode, DHTID: the DHT and its keys"),
    ("hivemind.p2p", "P2P, PeerID, P2PContext, the servicer bases: the transport and peer ids"),
    ("hivemind.compression", "the compression strategies and the tensor (de)serializers"),
    ("hivemind.utils", "get_dht_time, MSGPackSerializer, TimedStorage, MPFuture, the asyncio helpers"),
    ("hivemind.optim", "Optimizer, GradScaler, TrainingAverager"),
    ("hivemind.averaging", "DecentralizedAverager"),
    ("hivemind.dht.schema", "SchemaValidator, BytesWithPublicKey: the documented record schemas"),
    ("hivemind.dht.crypto", "RSASignatureValidator: the documented signed records"),
    ("hivemind.dht.validation", "RecordValidatorBase, CompositeValidator, DHTRecord: what a validator sees"),
    ("hivemind.utils.crypto", "RSAPrivateKey, RSAPublicKey: the keys records and tokens are signed with"),
    ("hivemind.proto.*", "the wire messages (protobuf), which any peer of the protocol reads and writes"),
    ("hivemind.utils.logging", "get_logger, use_hivemind_log_handler: where hivemind's log lines go"),
)


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
EXT = "cotrain.hivemind_ext."
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
        f"{EXT}hosting._SignalsOutsideMainThread; {EXT}dht.SwarmDHT (wraps its pipe and validator first)",
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
        f"{HOOKS}.Averager; cotrain.hivemind_ext.outer.OuterAverager",
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
        f"{HOOKS}.Optimizer; {EXT}optimizer.SwarmOptimizer",
        "cotrain's tracker (gone peers, robust counting)",
        "19ebff151cfe85ad",
    ),
    Touch(
        f"{OPT}._make_state_averager",
        "overridden",
        f"{HOOKS}.Optimizer; {EXT}optimizer.SwarmOptimizer",
        "the checked state averager",
        "4e2d2b03cefe5998",
    ),
    Touch(
        f"{OPT}._average_gradients_and_load_into_optimizer",
        "overridden",
        f"{HOOKS}.Optimizer; {EXT}optimizer.SwarmOptimizer",
        "counts rounds and group sizes",
        "c0459b56003a2596",
    ),
    Touch(
        f"{OPT}._maybe_schedule_gradient_averaging",
        "overridden",
        f"{HOOKS}.Optimizer; {EXT}optimizer.SwarmOptimizer",
        "no matchmaking while alone",
        "180134eb614e0095",
    ),
    Touch(
        f"{OPT}._update_global_epoch",
        "overridden",
        f"{HOOKS}.Optimizer; {EXT}optimizer.SwarmOptimizer",
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
    # overridden in cotrain's subclasses: public methods and constructors that extend hivemind's (most call
    # it through super()); a change upstream is re-read against each override
    Touch(
        "hivemind.averaging.allreduce.AllReduceRunner.__init__",
        "overridden",
        f"{EXT}reducers.RobustAllReduceRunner",
        "swaps in the robust part reducer (aggregation, excluded senders, records)",
        "4d7c804548973da9",
    ),
    Touch(
        "hivemind.averaging.allreduce.AllReduceRunner.run",
        "overridden",
        f"{EXT}reducers.RobustAllReduceRunner",
        "after its last own result a peer finishes reducing the others' parts before the runner ends",
        "e02e7943262e1c6c",
    ),
    Touch(
        "hivemind.averaging.averager.DecentralizedAverager.get_current_state",
        "overridden",
        f"{EXT}statecheck.CheckedStateDownloads",
        "the poisoned-state attack serves altered tensors (fault injection)",
        "7dc271d383574d0b",
    ),
    Touch(
        "hivemind.averaging.averager.DecentralizedAverager.load_state_from_peers",
        "overridden",
        f"{EXT}statecheck.CheckedStateDownloads",
        "notes the step held before a download",
        "086aef71adff32b5",
    ),
    Touch(
        "hivemind.averaging.averager.DecentralizedAverager.rpc_join_group",
        "overridden",
        f"{EXT}reducers.RobustAveraging",
        "excluded peers are told this averager looks for no group",
        "bdfd9d174d5e3456",
    ),
    Touch(
        "hivemind.averaging.averager.DecentralizedAverager.run_in_background",
        "overridden",
        f"{EXT}hosting.ServedInThread",
        "the caller's SIGINT handler is put back after the start (hivemind left it ignored)",
        "237d27c2cf1652b8",
    ),
    Touch(
        "hivemind.averaging.averager.DecentralizedAverager.shutdown",
        "overridden",
        f"{EXT}statecheck.CheckedStateDownloads",
        "closes the fingerprint publisher first",
        "e016f256c54a7124",
    ),
    Touch(
        "hivemind.averaging.averager.DecentralizedAverager.state_sharing_priority",
        "overridden",
        f"{EXT}statecheck.CheckedStateDownloads",
        "the poisoned-state attack raises the priority (fault injection)",
        "55833de762823f7a",
    ),
    Touch(
        "hivemind.averaging.averager.DecentralizedAverager.step",
        "overridden",
        f"{EXT}liveness.WatchedRounds",
        "each round's StepControl is kept for the round watch",
        "bedc0a053d961ff0",
    ),
    Touch(
        "hivemind.averaging.partition.TensorPartReducer.__init__",
        "overridden",
        f"{EXT}reducers.RobustPartReducer",
        "the aggregation, the excluded senders, the records, the refusal counts and the combining thread",
        "8b9a899cae48f9d6",
    ),
    Touch(
        "hivemind.dht.dht.DHT._shutdown",
        "overridden",
        f"{EXT}hosting.ServedInThread",
        "a thread's loop cancels and awaits the tasks the shutdown leaves",
        "90c3e4df7fd9a0bb",
    ),
    Touch(
        "hivemind.dht.dht.DHT.replicate_p2p",
        "overridden",
        f"{EXT}dht.SwarmDHT",
        "one replica per event loop of a thread-served averager; guarded in a private swarm",
        "92dd5f8c394be059",
    ),
    Touch(
        "hivemind.dht.dht.DHT.run_in_background",
        "overridden",
        f"{EXT}hosting.ServedInThread",
        "the caller's SIGINT handler is put back after the start (hivemind left it ignored)",
        "6ea2ca259762d900",
    ),
    Touch(
        "hivemind.dht.validation.RecordValidatorBase.sign_value",
        "overridden",
        f"{EXT}dht.RememberedVerdicts",
        "passed to the wrapped validators",
        "1226f64d09cbeefa",
    ),
    Touch(
        "hivemind.dht.validation.RecordValidatorBase.strip_value",
        "overridden",
        f"{EXT}dht.RememberedVerdicts",
        "passed to the wrapped validators",
        "ef7ee25b8399a716",
    ),
    Touch(
        "hivemind.dht.validation.RecordValidatorBase.validate",
        "overridden",
        f"{EXT}dht.RememberedVerdicts; {EXT}validators.RevocationsValidator",
        "verdicts remembered by the record's digest; a revocation list checked against the authority's "
        "signature",
        "f6f50ba1a584db9d",
    ),
    Touch(
        "hivemind.optim.grad_averager.GradientAverager.__init__",
        "overridden",
        f"{EXT}averaging.SwarmGradientAverager; {EXT}direct.DirectTransport",
        "no state sharing, read-ahead of parts, the aggregation; the direct transport's flag before the "
        "process starts",
        "46c7e32eab9f4882",
    ),
    Touch(
        "hivemind.optim.grad_averager.GradientAverager.schedule_step",
        "overridden",
        f"{EXT}averaging.SwarmGradientAverager",
        "an auxiliary reducer says so to its group in what it gathers",
        "9a5a347db6738933",
    ),
    Touch(
        "hivemind.optim.optimizer.Optimizer.__init__",
        "overridden",
        f"{EXT}optimizer.SwarmOptimizer",
        "install() first; single-threaded torch in the optimizer's step thread; the round watch",
        "214e79521754a5a2",
    ),
    Touch(
        "hivemind.optim.optimizer.Optimizer.load_state_from_peers",
        "overridden",
        f"{EXT}optimizer.SwarmOptimizer",
        "gives up after load_state_timeout (hivemind retries forever); a scheduled round goes on without "
        "this peer's weight",
        "a8b8111272110a54",
    ),
    Touch(
        "hivemind.optim.optimizer.Optimizer.shutdown",
        "overridden",
        f"{EXT}optimizer.SwarmOptimizer",
        "closes the round watch first",
        "96caf836566823f4",
    ),
    Touch(
        "hivemind.optim.progress_tracker.ProgressTracker.__init__",
        "overridden",
        f"{EXT}progress.SwarmProgressTracker",
        "gone peers, clients counted for an auxiliary reducer, the paced report signal",
        "500f7125a8fb61f3",
    ),
    Touch(
        "hivemind.optim.progress_tracker.ProgressTracker.report_local_progress",
        "overridden",
        f"{EXT}progress.SwarmProgressTracker",
        "a new epoch or a reset is stored at once, whatever the pace",
        "4a472f49997eac38",
    ),
    Touch(
        "hivemind.optim.progress_tracker.ProgressTracker.shutdown",
        "overridden",
        f"{EXT}progress.SwarmProgressTracker",
        "unpaces the report signal so that the reporter ends at once",
        "0467cac4d8a8cb1b",
    ),
    Touch(
        "hivemind.optim.state_averager.TrainingStateAverager.__init__",
        "overridden",
        f"{EXT}diloco_state.DiLoCoStateAverager; {EXT}direct.DirectTransport; "
        f"{EXT}statecheck.CheckedStateDownloads",
        "DiLoCo's inner optimizer and schedule; checked downloads' records; the direct transport's flag",
        "5114e951be435f8f",
    ),
    Touch(
        "hivemind.optim.state_averager.TrainingStateAverager.get_current_state",
        "overridden",
        f"{EXT}diloco_state.DiLoCoStateAverager; {EXT}statecheck.CheckedStateDownloads",
        "DiLoCo's served state carries the inner optimizer, its steps and the vouched lineage; the "
        "poisoned-state attack",
        "99a62afa87818087",
    ),
    Touch(
        "hivemind.optim.state_averager.TrainingStateAverager.load_state_from_peers",
        "overridden",
        f"{EXT}diloco_state.DiLoCoStateAverager; {EXT}statecheck.CheckedStateDownloads",
        "DiLoCo's download checks its round and loads the inner optimizer; the step held is noted first",
        "88d8dcb9e16286e3",
    ),
    Touch(
        "hivemind.p2p.p2p_daemon.P2P.add_protobuf_handler",
        "overridden",
        f"{EXT}guard.GuardedP2P",
        "a private swarm's averaging and download handlers admit only peers that proved a valid token",
        "c59594c276afc08f",
    ),
    Touch(
        "hivemind.p2p.p2p_daemon.P2P.call_protobuf_handler",
        "overridden",
        f"{EXT}guard.GuardedP2P",
        "proves this peer's token before calling a guarded handler",
        "77335217418f15fb",
    ),
    Touch(
        "hivemind.p2p.p2p_daemon.P2P.iterate_protobuf_handler",
        "overridden",
        f"{EXT}guard.GuardedP2P",
        "proves this peer's token before calling a guarded handler",
        "78ca100c0fb63623",
    ),
    Touch(
        "hivemind.p2p.servicer.ServicerBase.get_stub",
        "overridden",
        f"{EXT}direct.DirectTransport",
        "all-reduce parts travel over the direct TCP path where there is one",
        "bd7e76c060578e26",
    ),
    Touch(
        "hivemind.utils.auth.TokenAuthorizerBase.does_token_need_refreshing",
        "overridden",
        f"{EXT}authorizer.SwarmAuthorizer",
        "refreshed when the peer's token file was replaced",
        "4a69ddadd00f5293",
    ),
    Touch(
        "hivemind.utils.auth.TokenAuthorizerBase.get_token",
        "overridden",
        f"{EXT}authorizer.SwarmAuthorizer",
        "the peer's own token and its key, re-read when renewed",
        "88e312e705f34918",
    ),
    Touch(
        "hivemind.utils.auth.TokenAuthorizerBase.is_token_valid",
        "overridden",
        f"{EXT}authorizer.SwarmAuthorizer",
        "cotrain's token checks (authority, expiry, revocations), refusals logged",
        "1fe1df7c9919ebd9",
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
        f"{HOOKS}.Averager; overridden by {EXT}direct.DirectTransport, {EXT}outer.OuterAverager, "
        f"{EXT}statecheck.CheckedStateDownloads",
        "all-reduce settings; the request pipe",
        "75d089f9ba0e822f",
        ("_averaging_alpha", "_allreduce_timeout", "_outer_pipe", "_running_groups"),
    ),
    Touch(
        f"{AVG}._run_internal",
        "read",
        f"{HOOKS}.Averager; {EXT}hosting.ServedInThread; {EXT}outer.OuterAverager.expect_group",
        "the averager's P2P and matchmaking; an averager served from a thread runs this loop directly",
        "49c04c0695ad197a",
        ("_p2p", "_matchmaking", "_state_updated"),
    ),
    Touch(
        "hivemind.averaging.matchmaking.Matchmaking.__init__",
        "read",
        f"{EXT}outer.OuterAverager.expect_group",
        "the group size a leader assembles at (``target_group_size``, read again at every join request), set "
        "per round to the peers expected in it",
        "abb7e5e417d66c38",
    ),
    Touch(
        "hivemind.dht.dht.DHT.__init__",
        "read",
        f"{HOOKS}.DHT; {EXT}requestpipe; overridden by {EXT}dht.SwarmDHT",
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
        f"{HOOKS}.Authorizer; overridden by {EXT}authorizer.SwarmAuthorizer",
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


def is_public(module: str) -> bool:
    """Whether ``module`` (a dotted hivemind module name) is in hivemind's public API (``PUBLIC``)."""
    for name, _ in PUBLIC:
        if module == name.removesuffix(".*") or (name.endswith(".*") and module.startswith(name[:-1])):
            return True
    return False


def _split(target: str) -> tuple[object, list[str]]:
    """The module of ``target`` and the rest of its dotted name."""
    parts = target.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            return importlib.import_module(".".join(parts[:i])), parts[i:]
        except ImportError:
            continue
    raise LookupError(f"no module in {target!r}")


@functools.lru_cache(maxsize=64)
def _parsed(text: str) -> tuple[ast.Module, list[str]]:
    """A module's syntax tree and lines, made once per process: the manifest names 15 modules 73 times, and
    every role checks it as it starts (``ast.get_source_segment`` splits the whole module again at each call:
    0.7 CPU-s a start)."""
    return ast.parse(text), text.splitlines(keepends=True)


def _segment(lines: list[str], node: ast.AST) -> str:
    """``ast.get_source_segment`` of ``node`` from the module's ``lines`` (its offsets count UTF-8 bytes)."""
    first, last = node.lineno - 1, node.end_lineno - 1
    if first == last:
        return lines[first].encode()[node.col_offset : node.end_col_offset].decode()
    head = lines[first].encode()[node.col_offset :].decode()
    tail = lines[last].encode()[: node.end_col_offset].decode()
    return head + "".join(lines[first + 1 : last]) + tail


def source_of(target: str) -> str | None:
    """The source of a hivemind function or method as its module's file has it (None: it is gone)."""
    module, names = _split(target)
    tree, lines = _parsed(inspect.getsource(module))
    body = tree.body
    node = None
    for name in names:
        found = [n for n in body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)]
        node = next((n for n in found if n.name == name), None)
        if node is None:
            return None
        body = node.body
    return _segment(lines, node)


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
