"""The benchmarks' command lines, parsed and never run: every ``python benchmarks/X.py ...`` line of the docs
parses with its script's own parser, every argument a script's functions read is one its parser gives, and the
command lines a script builds for the processes it starts (cotrain's roles, its own peer processes, the
simulated peers of ``lib/simulated.py``) parse with the parser of what they start: cotrain's own CLI
(``cotrain.cli.parse``, the config resolved too) or the script's. No process is started and nothing trains."""

from __future__ import annotations

import argparse
import ast
import importlib
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import DEAD_PEER, REPO
from cotrain import cli

BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import allreduce  # noqa: E402
import aux_load  # noqa: E402
import byzantine  # noqa: E402
import chaos  # noqa: E402
import convergence  # noqa: E402
import footprint  # noqa: E402
import memory_per_param  # noqa: E402
import nat  # noqa: E402
import overhead  # noqa: E402
import prepare  # noqa: E402
import reducer_memory  # noqa: E402
import relay  # noqa: E402
import round_end  # noqa: E402
import rounds_sim  # noqa: E402
import scale  # noqa: E402
import sharing  # noqa: E402
import slow_peer  # noqa: E402
import soak  # noqa: E402
import swarm_cpu  # noqa: E402
import traffic  # noqa: E402
import utilization  # noqa: E402
from lib import roles, simulated  # noqa: E402

SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py"))
DOCS = [REPO / "README.md", BENCHMARKS / "README.md"]
DOCS += sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "benchmarks-log.md")  # the log: history
INLINE = re.compile(r"`(python\s+benchmarks/\w+\.py[^`]*)`")  # a span may break across lines
BASH = re.compile(r"```(?:bash|sh|shell|console)\n(.*?)```", re.S)
COMMON_C = re.compile(r"`C` = `([^`]*)`")  # a section's common options, used as $C in its commands


def documented() -> list[tuple[str, str]]:
    """(document, command) of each ``python benchmarks/X.py ...`` in the docs (not the history), inline or in
    a bash block, continuation lines joined and ``$C`` replaced by the section's ``C`` defined before it."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        spans = [(m.start(), m.group(1)) for m in INLINE.finditer(text)]
        for block in BASH.finditer(text):
            for line in re.sub(r"\\\n\s*", " ", block.group(1)).splitlines():
                line = line.strip().removeprefix("$ ")
                if line.startswith("python benchmarks/"):
                    spans.append((block.start(), line))
        common = [(m.start(), " ".join(m.group(1).split())) for m in COMMON_C.finditer(text)]
        for at, command in sorted(spans):
            command = " ".join(command.split())
            before = [c for pos, c in common if pos < at]
            if "$C" in command and before:  # (without a C before it, the command fails to parse below)
                command = command.replace("$C", before[-1])
            found.append((doc.name, command))
    return found


def script_and_arguments(command: str) -> tuple[str, list[str]]:
    """The script of a documented command line and its arguments: comments dropped, and an elided part (a
    bare ``...``) left out."""
    words = shlex.split(command, comments=True)
    assert words[0] == "python" and words[1].startswith("benchmarks/"), command
    return Path(words[1]).stem, [w for w in words[2:] if w != "..."]


def cotrain_argv(argv: list[str]) -> list[str]:
    """The arguments of a ``python -m cotrain ...`` command line."""
    assert argv[:3] == [sys.executable, "-m", "cotrain"], argv
    return argv[3:]


def own_argv(argv: list[str], script: str) -> list[str]:
    """The arguments of a command line that runs ``script`` (a benchmark, or a module of lib/) itself."""
    assert argv[0] == sys.executable and Path(argv[1]).resolve() == (BENCHMARKS / script).resolve(), argv
    return argv[2:]


def parses_as_cotrain(argv: list[str]):
    """``argv`` (``ROLE ...``) parsed by cotrain's CLI and its config resolved (raises on any problem): the
    resolved config."""
    ns, config = cli.parse(argv)
    assert ns.command == argv[0], argv
    return config


class Recorder:
    """Stands in for ``lib.roles.Swarm``: keeps each role's command line instead of starting a process."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.procs: dict[str, None] = {}
        self.argv: dict[str, list[str]] = {}
        self.env: dict[str, dict[str, str]] = {}

    def start(self, name: str, args: list[str], threads: int, env: dict[str, str] | None = None) -> None:
        self.procs[name], self.argv[name], self.env[name] = None, list(args), env or {}

    def dead(self) -> list[str]:
        return []

    def remember_tree(self) -> None:
        pass


# ------------------------------------------------------------------------------ every script, every doc line


def test_every_script_is_documented_and_every_documented_command_names_a_script():
    scripts = {script_and_arguments(c)[0] for _, c in documented()}
    assert scripts <= set(SCRIPTS), scripts - set(SCRIPTS)
    assert set(SCRIPTS) <= scripts, f"not in the docs: {sorted(set(SCRIPTS) - scripts)}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_parses_its_defaults(script: str):
    args = importlib.import_module(script).parse_args([])
    assert isinstance(args, argparse.Namespace)


@pytest.mark.parametrize("doc,command", documented(), ids=lambda v: v[:80])
def test_every_documented_benchmark_command_parses(doc: str, command: str):
    script, argv = script_and_arguments(command)
    args = importlib.import_module(script).parse_args(argv)
    if script == "convergence":  # its arms are checked when parsed; their strategies resolve in cotrain
        assert all(arm.strategy in ("sync", "diloco") for arm in args.arms), command
    if script == "rounds_sim":
        assert [rounds_sim.Arm.parse(a) for a in args.arms], command


def argument_reads(module) -> tuple[set[str], set[str]]:
    """The ``args.X`` a module's functions read, and those they set (a script fills some in after parsing)."""
    tree = ast.parse(Path(module.__file__).read_text())
    reads, sets = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "args":
            (sets if isinstance(node.ctx, ast.Store) else reads).add(node.attr)
    return reads, sets


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_argument_a_script_reads_is_one_its_parser_gives(script: str):
    """A renamed or removed flag, or a function handed a namespace without an attribute it reads (the
    ``AttributeError: 'Namespace' object has no attribute 'model_params'`` of a run), fails here."""
    module = importlib.import_module(script)
    reads, sets = argument_reads(module)
    missing = reads - set(vars(module.parse_args([]))) - sets
    assert not missing, f"{script}.py reads args.{', args.'.join(sorted(missing))}, which its parser lacks"


def test_every_argument_the_simulated_peer_reads_is_one_its_parser_gives():
    reads, _ = argument_reads(simulated)
    peer = set(vars(simulated.build_parser().parse_args([])))
    # worker_argv reads the benchmark's namespace (utilization, traffic, aux_load: below); the rest the peer's
    orchestrator = {"limit", "peers", "keep_logs"}
    assert reads - peer <= orchestrator, reads - peer


# --------------------------------------------------------------------------- simulated peers (lib/simulated)


def peer_args(worker: list[str], *extra: str) -> argparse.Namespace:
    """A simulated peer's command line as ``Peers.start`` completes it, parsed by the peer's parser."""
    argv = own_argv(worker, "lib/simulated.py")
    return simulated.build_parser().parse_args([*argv, "--index", "1", "--address", "10.213.0.2", *extra])


@pytest.mark.parametrize(
    "argv",
    [
        ["--rate", "100", "--modes", "sync", "delayed", "diloco", "diloco-overlap"],
        [
            "--rate",
            "10",
            "--modes",
            "diloco-topk-overlap",
            "--model-params",
            "100000000",
            "--local-steps",
            "100",
        ],
        ["--quick", "--keep-logs"],
    ],
)
def test_utilization_builds_peers_of_every_mode_it_runs(argv):
    args = utilization.parse_args(argv)
    for mode in args.modes:
        peer = peer_args(utilization.peer_argv(mode, args), "--initial-peer", DEAD_PEER)
        first, last, _ = utilization.window(mode, args)
        assert (peer.mode, peer.stop_at, peer.expect_peers) == (mode, last + 1, args.peers)
        assert peer.model_params == args.model_params and peer.local_steps == args.local_steps
        assert peer.averaging_timeout == args.averaging_timeout >= 60 and peer.keep_logs == args.keep_logs
        assert peer.target_batch_size == (
            args.inner_batch if simulated.is_diloco(mode) else args.target_batch_size
        )


@pytest.mark.parametrize(
    "argv",
    [
        ["--steps", "4", "--rounds", "1"],
        ["--no-sync", "--local-steps", "10", "--topk", "--rounds", "2"],
        ["--no-sync", "--topk", "--no-dense", "--local-steps", "10", "--rounds", "3", "--peers", "16"],
        ["--quick", "--model-params", "1000000"],
    ],
)
def test_traffic_builds_peers_of_every_configuration_it_runs(argv):
    args = traffic.parse_args(argv)
    configs = traffic.configs(args)
    assert configs and all(mode in simulated.MODES for _, mode, _, _ in configs)
    for _, mode, h, timed in configs:
        peer = peer_args(traffic.peer_argv(mode, h, timed, args))
        assert (peer.mode, peer.local_steps, peer.stop_at) == (mode, h, args.warmup + timed + 1)
        assert peer.target_batch_size == args.target_batch_size == args.peers * 4 * 8
        assert peer.model_params == args.model_params and peer.expect_peers == args.peers
    if "--no-dense" in argv:
        assert [m for _, m, _, _ in configs] == ["diloco-topk"]


@pytest.mark.parametrize("mode", ["diloco", "diloco-topk"])
def test_aux_load_builds_reducers_and_clients_on_the_real_model(mode):
    args = aux_load.parse_args(["--clients", "2", "4", "6", "--rounds", "2", "--modes", mode])
    for clients in args.clients:
        worker = aux_load.peer_argv(mode, clients, args)
        reducer, client = (
            peer_args(worker, "--aux"),
            peer_args(worker, "--initial-peer", DEAD_PEER, "--client-mode"),
        )
        assert reducer.aux and client.client_mode and not client.aux
        assert client.target_batch_size == clients * args.micro_batch * args.accumulation
        assert (client.model_params, client.stop_at, client.expect_peers) == (0, 2 + args.rounds, clients)
        assert client.averaging_timeout >= 60
    with pytest.raises(SystemExit):
        aux_load.parse_args(["--clients", "1"])


# ------------------------------------------------------------------------------- scripts' own peer processes


def test_allreduce_builds_its_peers_with_the_arms_it_times(tmp_path):
    args = allreduce.parse_args(["--libp2p-arm", "--dtypes", "fp16", "--rounds", "3", "--exchanges", "1"])
    assert (args.peers, args.dtypes, args.rounds, args.libp2p_arm) == ([2, 4, 8], ["fp16"], 3, True)
    quick = allreduce.parse_args(["--quick", "--exchanges", "1"])
    assert (quick.peers, quick.dtypes, quick.rounds, quick.exchanges) == ([2, 4], ["fp16"], 1, 1)
    for n in args.peers:
        argv = own_argv(allreduce.peer_argv(n, args, tmp_path / "shapes.json"), "allreduce.py")
        peer = allreduce.parse_args(
            [*argv, "--index", "1", "--address", "10.213.0.2", "--initial-peer", DEAD_PEER]
        )
        assert (
            peer.peer
            and peer.group_size == n
            and peer.libp2p_arm
            and peer.shapes == str(tmp_path / "shapes.json")
        )
        assert (peer.transport, peer.aggregation, peer.matchmaking_time) == (
            "tcp",
            "mean",
            args.matchmaking_time,
        )


def test_scale_builds_its_roles_and_trainers(tmp_path):
    args = scale.parse_args(["--peers", "16", "--quick"])
    args.data = str(tmp_path / "data")  # main prepares it
    for role in ("monitor", "eval"):
        config = parses_as_cotrain(
            cotrain_argv(scale.role_argv(role, args, "10.213.0.1", [DEAD_PEER], tmp_path))
        )
        assert config.run.target_batch_size == args.target_batch_size
    for k in range(6):
        argv = own_argv(scale.trainer_argv(args, k, "10.213.0.3", [DEAD_PEER], 4, k == 5), "scale.py")
        peer = scale.parse_args(argv)
        assert peer.peer and (peer.index, peer.group_size, peer.initial_peers) == (k, 4, [DEAD_PEER])
        assert peer.client == scale.trainer_client(k) and peer.at_once == (k == 5) and peer.data == args.data
        assert peer.target_batch_size == args.target_batch_size


def test_overhead_runs_the_same_work_in_both_arms(tmp_path):
    argv = ["--preset", "albert-large-v2", "--device", "cuda", "--precision", "bf16",
            "--text-file", "valid.txt", "--whole-articles", "--micro-batch", "32", "--accumulation", "4",
            "--target-batch-size", "1024",
            "--steps", "4", "--warmup-steps", "2", "--threads", "8", "--repeats", "2", "--quiet-wait", "3",
            "--retries", "0", "--", "--swarm-processes"]  # fmt: skip
    args = overhead.parse_args(argv)
    peer = parses_as_cotrain(
        cotrain_argv(overhead.cotrain_command(args, tmp_path / "data", tmp_path / "out", "r"))
    )
    assert peer.peer.swarm_processes and peer.run.target_batch_size == 1024 and peer.peer.max_steps == 4
    plain = overhead.parse_args(own_argv(overhead.plain_command(args, tmp_path / "data"), "overhead.py"))
    assert plain.plain_worker
    for name in ("steps", "warmup_steps", "threads", "micro_batch", "preset", "device", "precision",
                 "accumulation", "target_batch_size"):  # fmt: skip
        assert getattr(plain, name) == getattr(args, name), name
    with pytest.raises(SystemExit):
        overhead.parse_args(["--steps", "2", "--warmup-steps", "2"])


def test_memory_per_param_measures_each_run_in_a_process_of_its_own():
    args = memory_per_param.parse_args(
        ["--presets", "llama-tiny", "llama-150m", "--outer-momentum", "0.9", "0"]
    )
    one = memory_per_param.parse_args(
        own_argv(memory_per_param.one_command("llama-150m", "diloco", 0.9, args), "memory_per_param.py")
    )
    assert (one.one, one.outer_momentum, one.seq, one.device) == (
        ["llama-150m", "diloco"],
        [0.9],
        args.seq,
        args.device,
    )
    sync = memory_per_param.parse_args(
        own_argv(memory_per_param.one_command("llama-tiny", "sync", None, args), "memory_per_param.py")
    )
    assert sync.one == ["llama-tiny", "sync"] and sync.outer_momentum is None


def test_reducer_memory_measures_each_count_of_senders_in_a_process_of_its_own():
    args = reducer_memory.parse_args(["--senders", "2", "8", "16"])
    for mode in args.modes:
        one = reducer_memory.parse_args(
            own_argv(reducer_memory.one_command(mode, 8, args.part_mb), "reducer_memory.py")
        )
        assert (one.one, one.part_mb) == ([mode, "8"], args.part_mb)


def test_prepare_runs_the_recipe_and_cotrain_prepare_on_the_same_corpus(tmp_path):
    args = prepare.parse_args(["--num-proc", "2", "--repeats", "20", "40"])
    corpus, tokenizer = tmp_path / "x20.txt", tmp_path / "tokenizer"
    baseline = prepare.parse_args(
        own_argv(prepare.baseline_command(corpus, tokenizer, tmp_path / "b", tmp_path / "c"), "prepare.py")
    )
    assert baseline.baseline == [str(corpus), str(tokenizer), str(tmp_path / "b"), str(tmp_path / "c")]
    parses_as_cotrain(cotrain_argv(prepare.cotrain_command(corpus, tokenizer, tmp_path / "o", args.num_proc)))


def test_relay_starts_each_role_as_a_process_of_its_own(tmp_path):
    for argv in (["--megabytes", "200", "--wait", "240"], ["--megabytes", "200", "--dht", "--no-listen"]):
        args = relay.parse_args(argv)
        for name, extra in (
            ("relay", []),
            ("receiver", ["--relay", DEAD_PEER, "--wait", str(args.wait), "--no-listen"]),
            ("sender-nat", ["--relay", DEAD_PEER, "--target", str(tmp_path / "receiver.json"), "--megabytes",
                            str(args.megabytes), "--private"]),
        ):  # fmt: skip
            role = relay.parse_args(
                own_argv(relay.role_argv(name, tmp_path, "0.0.0.0", args.dht, extra), "relay.py")
            )
            assert (role.role, role.dht, role.stop) == (name.split("-")[0], args.dht, str(tmp_path / "stop"))


def test_round_end_times_a_lone_peer_in_a_process_per_tree():
    args = round_end.parse_args(["--model-params", "4000000", "--rounds", "3", "--local-steps", "2"])
    peer = round_end.parse_args(own_argv(round_end.peer_command(args), "round_end.py"))
    assert peer.peer and (peer.model_params, peer.rounds, peer.local_steps) == (4_000_000, 3, 2)
    assert round_end.parse_args(["--src", "/tmp/old/src", "src"]).src == [Path("/tmp/old/src"), Path("src")]


# --------------------------------------------------------------------------------- cotrain's roles, as users


def test_convergence_starts_every_arms_roles_with_cotrains_flags(tmp_path, monkeypatch):
    monkeypatch.setattr(convergence, "Swarm", Recorder)
    args = convergence.parse_args(
        ["--preset", "gpt2-tiny", "--seq-length", "64", "--target-batch-size", "32", "--steps", "100",
         "--per-device-train-batch-size", "8", "--warmup-steps", "10", "--total-steps", "100",
         "--eval-every", "30", "--arms", "1", "4@56", "4:diloco:10", "4:diloco-topk:10",
         "--topk-density", "0.0625", "--topk-bits", "4", "--outer-lr", "1.0", "--outer-momentum", "0"]
    )  # fmt: skip
    for arm in args.arms:
        run = convergence.SwarmRun(arm, 0, args, tmp_path / "data", tmp_path)
        run._start_trainers([DEAD_PEER])
        assert sorted(run.swarm.argv) == sorted(
            ["monitor", "eval", *(f"trainer{i}" for i in range(arm.peers))]
        )
        for name, argv in run.swarm.argv.items():
            assert argv[0] == {"monitor": "monitor", "eval": "eval"}.get(name, "train"), name
            config = parses_as_cotrain(argv)
            assert config.run.strategy == arm.strategy
        train = parses_as_cotrain(run.swarm.argv["trainer0"])
        assert train.peer.max_steps == arm.max_steps(args.steps)
        assert (train.run.outer_compression == "topk") == (arm.compression == "topk")
    with pytest.raises(SystemExit):
        convergence.parse_args(["--steps", "100", "--arms", "4:diloco:30"])  # 100 is not a multiple of H


def test_byzantine_starts_attackers_among_honest_roles(tmp_path, monkeypatch):
    monkeypatch.setattr(byzantine, "AttackSwarm", Recorder)
    args = byzantine.parse_args(
        ["--models", "gpt2-tiny", "--setups", "7:2", "--attacks", "sign-flip", "--cost"]
    )
    arms = byzantine.arms_for(args)
    assert {a.aggregation for a in arms} == {"mean", "clip"} and {a.attack for a in arms} == {"", "sign-flip"}
    for arm in arms:
        run = byzantine.ArmRun(arm, args, tmp_path / "data", tmp_path)
        run._start_peers([DEAD_PEER])
        for argv in run.swarm.argv.values():
            parses_as_cotrain(argv)
        attackers = [n for n, env in run.swarm.env.items() if env.get(byzantine.ATTACK)]
        assert len(attackers) == (arm.attackers if arm.attack else 0), attackers
    quick = byzantine.parse_args(["--quick"])
    assert (quick.models, quick.setups, quick.attacks, quick.steps) == (
        ["gpt2-tiny"],
        [(5, 1)],
        ["sign-flip"],
        12,
    )
    cost = allreduce.parse_args(own_argv(byzantine.allreduce_argv(args), "allreduce.py"))
    assert (cost.peers, cost.dtypes, cost.aggregation) == ([4], ["fp16"], "both")


def test_chaos_starts_its_roles_and_asks_the_swarms_status(tmp_path):
    for strategy in ("sync", "diloco"):
        args = chaos.parse_args(
            ["--duration", "30", "--kill-every", "12", "--trainers", "3", "--strategy", strategy]
        )
        monitor = parses_as_cotrain(chaos.monitor_argv(args, tmp_path / "data", tmp_path))
        trainer = parses_as_cotrain(chaos.trainer_argv(args, tmp_path / "data", tmp_path, 1, [DEAD_PEER]))
        assert monitor.run.strategy == trainer.run.strategy == strategy
    parses_as_cotrain(chaos.status_argv([DEAD_PEER]))
    with pytest.raises(SystemExit):
        chaos.parse_args(["--trainers", "1"])


def started_swarm(tmp_path: Path, common: list[str], extra: list[str], trainers: int) -> Recorder:
    """``lib.roles.start_swarm`` on a recorder, the monitor's address already written."""
    (tmp_path / "monitor").mkdir(parents=True)
    (tmp_path / "monitor" / "initial_peers.txt").write_text(DEAD_PEER)
    swarm = Recorder(tmp_path)
    roles.start_swarm(swarm, tmp_path, common, tmp_path / "data", trainers, extra)
    return swarm


def test_footprint_and_swarm_cpu_start_a_monitor_and_trainers(tmp_path):
    args = footprint.parse_args(["--trainers", "2", "--minutes", "2", "--warmup", "60"])
    swarm = started_swarm(tmp_path / "a", footprint.common_args(args), footprint.keeper_args(tmp_path), 2)
    assert sorted(swarm.argv) == ["monitor", "trainer0", "trainer1"]
    for argv in swarm.argv.values():
        parses_as_cotrain(argv)
    swarm_cpu.parse_args(["--src", "a/src", "b/src", "--repeats", "1"])
    swarm = started_swarm(tmp_path / "b", list(swarm_cpu.COMMON), ["--dashboard-port", "-1"], 2)
    for argv in swarm.argv.values():
        parses_as_cotrain(argv)


def test_soak_starts_a_monitor_an_evaluation_peer_and_trainers(tmp_path):
    args = soak.parse_args(["--minutes", "60", "--dataset-path", "wt2", "--json", "soak.json"])
    parses_as_cotrain(soak.monitor_argv(args, tmp_path, tmp_path / "data"))
    parses_as_cotrain(soak.eval_argv(args, tmp_path, tmp_path / "data", [DEAD_PEER]))
    assert (
        parses_as_cotrain(soak.trainer_argv(args, tmp_path, tmp_path / "data", [DEAD_PEER], 3)).peer.seed == 3
    )
    with pytest.raises(SystemExit):
        soak.parse_args(["--minutes", "5"])  # settles for 10 minutes by default


def test_sharing_starts_trainers_alone_in_their_runs(tmp_path):
    args = sharing.parse_args(["--auto"])
    for threads in (0, 1, 2):
        config = parses_as_cotrain(
            sharing.trainer_argv("a", threads, tmp_path, tmp_path / "o", args.target_batch_size)
        )
        assert config.peer.torch_threads == threads


def test_slow_peer_starts_a_monitor_and_trainers_one_of_them_throttled(tmp_path):
    args = slow_peer.parse_args([])
    parses_as_cotrain(slow_peer.prepare_args(args, tmp_path))
    assert parses_as_cotrain(slow_peer.monitor_args(args, tmp_path)).run.outer_compression == "topk"
    trainer = slow_peer.cotrain(*slow_peer.trainer_args(args, 2, [DEAD_PEER], tmp_path, tmp_path / "t2"))
    parses_as_cotrain(cotrain_argv(trainer))
    shell = slow_peer.throttled(trainer, tmp_path / "group")
    assert shell[:2] == ["sh", "-c"] and shlex.split(shell[2].split("&& exec ", 1)[1]) == trainer


def test_nat_starts_its_roles_with_each_way_of_joining(tmp_path):
    for strategy in ("sync", "diloco"):
        argv = ["--homes", "3", "--no-public-trainer", "--modes", "client", "plain", "--strategy", strategy]
        args = nat.parse_args(argv)
        for mode in args.modes:
            monitor = nat.role_argv(
                nat.monitor_args(args), mode, args, tmp_path, tmp_path / "m", "10.213.0.1"
            )
            trainer = nat.trainer_args(args, [DEAD_PEER], 4, nat.MODES[mode])
            home = nat.role_argv(
                trainer, mode, args, tmp_path, tmp_path / "t", nat.LISTEN.get(mode, "10.214.0.2")
            )
            assert parses_as_cotrain(monitor).run.strategy == strategy
            assert parses_as_cotrain(home).peer.client_mode == (mode == "client")
    with pytest.raises(SystemExit):
        nat.parse_args(["--homes", "9"])


# ---------------------------------------------------------------------------------- lib/roles' datasets


def test_the_shared_datasets_are_prepared_with_cotrains_own_command(tmp_path, monkeypatch):
    ran: list[list[str]] = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kwargs: ran.append(cmd))
    for args in (convergence.parse_args([]), rounds_sim.parse_args([])):
        roles.prepare_wikitext(tmp_path, args)
    byzantine.prepared("gpt2-tiny", byzantine.parse_args([]), tmp_path)
    roles.prepare_demo(tmp_path, "albert-tiny", 128)
    assert len(ran) == 4
    for cmd in ran:
        parses_as_cotrain(cotrain_argv(cmd))
