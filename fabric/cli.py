"""``fabric run``: start a script that builds a plain ``Fabric()`` on one or more devices and machines.

The command-line options travel to the script through ``FABRIC_*`` environment variables, which the
connector reads, so the script needs no flags of its own. One process is the script itself (this
process is replaced by it). More processes per node, or more nodes, are started here, each with the
variables torchrun exports (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``NODE_RANK``), so inside the script Fabric finds a complete job
and launches nothing. This process then watches the ranks of its node with the same supervisor the launchers use
(``fabric.strategies.launchers.supervisor``): the first rank that fails brings the others down and its
exit status becomes the command's.

Why our own small launcher instead of ``torch.distributed.run``: it needs only the standard library
(no torch or torch.distributed import before the ranks start), and failure handling, exit codes and
signal forwarding are exactly what this module says, on every node.

Details worth knowing:

* Each rank is its own process group (so it is stopped together with its subprocesses) and never
  outlives `fabric run`, even when that is killed with SIGKILL (see ``launchers.rank_side``).
* SIGUSR1 and SIGTERM (the cluster's pre-emption warnings) are passed on to every rank's own
  process, which decides when to stop (``fabric.preempted``); after SIGTERM the ranks get
  ``--shutdown-timeout`` seconds to end, and the job ends with their status (``launchers.signals``).
  SIGINT, SIGHUP or a second SIGTERM stop every rank at once: exit status 128 + the signal.
* When several ranks fail, the root cause is reported and its status returned: a rank that died
  outright before ranks that raised (their errors are echoes), else the rank that raised first.
* A rank whose collective timed out is diagnosed as under the launchers: which rank never arrived,
  and where it was.
* ``OMP_NUM_THREADS`` defaults to cores / processes per node, so N ranks do not oversubscribe the CPU.

Only the standard library is imported at module level; keep it that way (start-up time).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from fabric._core.devices import DevicesSyntaxError, parse_devices
from fabric._core.env import fabric_variable, find_free_port, global_rank, rank_environment
from fabric._core.names import ACCELERATOR_CHOICES, PRECISION_ALIASES, PRECISION_VALUES

if TYPE_CHECKING:
    from fabric.strategies.launchers.node_rendezvous import NodeRendezvous

__all__ = ["main", "run", "build_run_parser"]

_PROG = "fabric"
# `fabric run` hands these to the script's Fabric(); its choices are the core's names (no torch import).
ACCELERATORS = ACCELERATOR_CHOICES
PRECISIONS = (*PRECISION_VALUES, *(alias for alias in PRECISION_ALIASES if isinstance(alias, str)))
# Why a strategy cannot be started by `fabric run`, by how its processes come to exist.
_REFUSED = {
    "from_function": "it starts its own processes from inside the script",
    "horovodrun": "Horovod jobs are started by horovodrun: `horovodrun -np N python SCRIPT`",
}

DEFAULT_MAIN_ADDRESS = "127.0.0.1"
DEFAULT_MAIN_PORT = 29400


# ---- options ------------------------------------------------------------------------------------------


def _strategies() -> tuple[tuple[str, ...], dict[str, str]]:
    """The strategy names the CLI accepts, and why each of the others is refused (from the registry)."""
    from fabric.strategies import STRATEGY_REGISTRY, strategy_launch  # the registry imports nothing heavy

    refused = {name: _REFUSED[strategy_launch(name)] for name in STRATEGY_REGISTRY if strategy_launch(name) in _REFUSED}
    return ("auto", *(name for name in STRATEGY_REGISTRY if name not in refused)), refused


def _choice(option: str, accepted: Sequence[str], extra: dict[str, str] | None = None) -> Any:
    def parse(value: str) -> str:
        if value.lower() in accepted:
            return value.lower()
        if extra and value.lower() in extra:
            raise argparse.ArgumentTypeError(
                f"{option}={value!r} cannot be used with `fabric run`: {extra[value.lower()]}."
                f" Accepted: {', '.join(accepted)}"
            )
        raise argparse.ArgumentTypeError(f"{option}={value!r} is not known; accepted: {', '.join(accepted)}")

    return parse


def _devices(value: str) -> str:
    """Check ``--devices`` with the core's device syntax; pass it on as text the connector reads back."""
    text = value.strip()
    try:
        parsed = parse_devices(text)
    except DevicesSyntaxError:
        raise argparse.ArgumentTypeError(
            f"--devices={value!r} is not valid; accepted: a positive number of devices per node (e.g. 2),"
            " -1 or 'auto' (every GPU), or device indices such as '0,1'"
        ) from None
    except ValueError:
        raise argparse.ArgumentTypeError(f"--devices={value!r} names a device more than once") from None
    if parsed == "all":
        return text
    if isinstance(parsed, int):
        return str(parsed)
    # a single index keeps its comma ("0,": device 0, not a count of 0 devices)
    return ",".join(map(str, parsed)) + ("," if len(parsed) == 1 else "")


def _positive_int(option: str) -> Any:
    def parse(value: str) -> int:
        if value.strip().isdigit() and int(value) >= 1:
            return int(value)
        raise argparse.ArgumentTypeError(f"{option}={value!r} is not valid; accepted: an integer >= 1")

    return parse


def _non_negative_int(option: str) -> Any:
    def parse(value: str) -> int:
        if value.strip().isdigit():
            return int(value)
        raise argparse.ArgumentTypeError(f"{option}={value!r} is not valid; accepted: an integer >= 0")

    return parse


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if 0 <= seconds < float("inf"):  # NaN too is refused
        return seconds
    raise argparse.ArgumentTypeError(f"--shutdown-timeout={value!r} is not valid; accepted: a number of seconds >= 0")


def _port(value: str) -> int:
    if value.strip().isdigit() and 1 <= int(value) <= 65535:
        return int(value)
    raise argparse.ArgumentTypeError(f"--main-port={value!r} is not valid; accepted: an integer in 1..65535")


# (dest, flags, argparse keyword arguments); the flag spellings are Lightning Fabric's.
def _options() -> list[tuple[str, tuple[str, ...], dict[str, Any]]]:
    strategies, refused = _strategies()
    return [
        ("accelerator", ("--accelerator",), dict(
            type=_choice("--accelerator", ACCELERATORS), default=None, metavar="NAME",
            help=f"The hardware to run on: {', '.join(ACCELERATORS)}. Default: the script's choice ('auto')."),
        ),
        ("strategy", ("--strategy",), dict(
            type=_choice("--strategy", strategies, refused), default=None, metavar="NAME",
            help=f"How to run across devices: {', '.join(strategies)}. Default: the script's choice ('auto')."),
        ),
        ("devices", ("--devices",), dict(
            type=_devices, default="1", metavar="N",
            help="Devices (processes) per node: a number, -1 or 'auto' (every GPU), or indices like '0,1'."
            " Default: 1."),
        ),
        ("num_nodes", ("--num-nodes", "--num_nodes"), dict(
            type=_positive_int("--num-nodes"), default=1, metavar="N",
            help="Number of machines (nodes) in the job. Default: 1."),
        ),
        ("node_rank", ("--node-rank", "--node_rank"), dict(
            type=_non_negative_int("--node-rank"), default=0, metavar="R",
            help="Index of this machine, 0 .. num_nodes-1 (run the command once per machine). Default: 0."),
        ),
        ("main_address", ("--main-address", "--main_address"), dict(
            default=DEFAULT_MAIN_ADDRESS, metavar="HOST",
            help="Address of the machine with node rank 0, reachable from all nodes."
            f" Default: {DEFAULT_MAIN_ADDRESS}."),
        ),
        ("main_port", ("--main-port", "--main_port"), dict(
            type=_port, default=None, metavar="PORT",
            help=f"Port on the main machine for the rendezvous (of the nodes, with --max-restarts). Default:"
            f" {DEFAULT_MAIN_PORT} (on a single node, a free port)."),
        ),
        ("max_restarts", ("--max-restarts", "--max_restarts"), dict(
            type=_non_negative_int("--max-restarts"), default=0, metavar="N",
            help="After a rank fails, stop the ranks and start them again, up to N times; every attempt sees"
            " TORCHELASTIC_RESTART_COUNT (0, 1, ...). Several nodes restart together. Default: 0."),
        ),
        ("rdzv_id", ("--rdzv-id", "--rdzv_id"), dict(
            default=None, metavar="ID",
            help="With --max-restarts and several nodes: the job's id in the nodes' rendezvous, the same on"
            " every node. Default: derived from --main-address and --main-port."),
        ),
        ("shutdown_timeout", ("--shutdown-timeout", "--shutdown_timeout"), dict(
            type=_seconds, default=None, metavar="S",
            help="After SIGTERM, passed on to the ranks, wait up to S seconds for them to end before they are"
            " killed (torchrun's option). Default: 30."),
        ),
        ("precision", ("--precision",), dict(
            type=_choice("--precision", PRECISIONS), default=None, metavar="P",
            help=f"Numeric precision: {', '.join(PRECISIONS)}. Default: the script's choice ('32-true')."),
        ),
    ]


_EPILOG = """\
Fabric's options may come before or after SCRIPT; everything else after SCRIPT goes to the script
(--help too). Put '--' before script arguments that look like Fabric's options.
The options reach `Fabric()` in the script through FABRIC_* environment variables, so the script
needs no flags of its own; options not given are left to the script's code.

examples:
  fabric run train.py                                   # like `python train.py`
  fabric run --accelerator cpu --devices 2 train.py --lr 0.1
  fabric run --devices 2 --num-nodes 2 --node-rank 0 --main-address 10.0.0.1 train.py   # machine 0
  fabric run --devices 2 --num-nodes 2 --node-rank 1 --main-address 10.0.0.1 train.py   # machine 1
"""


def build_run_parser() -> argparse.ArgumentParser:
    """The parser of ``fabric run`` (also what ``--help`` prints)."""
    parser = argparse.ArgumentParser(
        prog=f"{_PROG} run",
        usage=f"{_PROG} run [options] SCRIPT [SCRIPT_ARGS ...]",
        description="Run a Python script that uses Fabric on the given devices and machines.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("script", metavar="SCRIPT", help="The Python script to run.")
    parser.add_argument("script_args", metavar="SCRIPT_ARGS", nargs="*", help="Arguments for the script.")
    for dest, flags, kwargs in _options():
        parser.add_argument(*flags, dest=dest, **kwargs)
    return parser


def _split_argv(argv: Sequence[str], flags: set[str]) -> tuple[list[str], str | None, list[str]]:
    """Separate Fabric's options from SCRIPT and the script's own arguments.

    Like Lightning's CLI, Fabric's options are recognised before and after SCRIPT; unknown options
    after SCRIPT belong to the script (``--help`` too), and '--' ends Fabric's options.
    """
    ours: list[str] = []
    script: str | None = None
    rest: list[str] = []
    tokens = list(argv)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "--":
            tail = tokens[i + 1 :]
            if script is None and tail:
                script, tail = tail[0], tail[1:]
            rest.extend(tail)
            break
        name = token.split("=", 1)[0]
        if token in ("-h", "--help") and script is None:
            ours.append(token)  # after SCRIPT, --help is the script's
        elif name in flags:
            ours.append(token)
            if "=" not in token and i + 1 < len(tokens):
                ours.append(tokens[i + 1])
                i += 1
        elif script is None and token.startswith("-") and token != "-":
            ours.append(token)  # an unknown option before SCRIPT: let argparse report it
        elif script is None:
            script = token
        else:
            rest.append(token)
        i += 1
    return ours, script, rest


@dataclass
class RunConfig:
    """The checked options of one ``fabric run``."""

    script: str
    script_args: list[str]
    accelerator: str | None
    strategy: str | None
    devices: str
    num_nodes: int
    node_rank: int
    main_address: str
    main_port: int | None
    precision: str | None
    given: frozenset[str]  # the options the user wrote
    max_restarts: int = 0
    rdzv_id: str | None = None
    shutdown_timeout: float | None = None  # None: the supervisor's default


def parse_run_args(argv: Sequence[str]) -> RunConfig:
    """Parse and check ``fabric run`` arguments; exits with status 2 and a message naming the bad value."""
    parser = build_run_parser()
    flag_to_dest = {flag: dest for dest, flags, _ in _options() for flag in flags}
    ours, script, rest = _split_argv(argv, set(flag_to_dest))
    args = parser.parse_args([*ours, "--", script] if script is not None else ours)
    given = frozenset(flag_to_dest[token.split("=", 1)[0]] for token in ours if token.split("=", 1)[0] in flag_to_dest)
    if args.node_rank >= args.num_nodes:
        parser.error(
            f"--node-rank={args.node_rank} is not valid with --num-nodes={args.num_nodes};"
            f" accepted: 0 .. {args.num_nodes - 1}"
        )
    if args.rdzv_id is not None and not (args.max_restarts and args.num_nodes > 1 and args.rdzv_id.strip()):
        parser.error(
            f"--rdzv-id={args.rdzv_id!r} is not used here; accepted: a non-empty id, with --num-nodes > 1 and"
            " --max-restarts >= 1 (the nodes' rendezvous exists only then)"
        )
    if not os.path.isfile(args.script):
        parser.error(f"SCRIPT {args.script!r} does not exist (or is not a file)")
    if not args.main_address.strip():
        parser.error("--main-address='' is empty; accepted: a host name or IP address")
    if args.accelerator == "cpu" and ("," in args.devices or args.devices == "-1"):
        parser.error(
            f"--devices={args.devices!r} is not valid with --accelerator=cpu; accepted: a number of processes or 'auto'"
        )
    if args.accelerator == "mps" and args.devices not in ("1", "auto", "-1", "0,"):
        parser.error(f"--devices={args.devices!r} is not valid with --accelerator=mps; accepted: 1 (there is one MPS device)")
    return RunConfig(
        script=args.script,
        script_args=rest,
        accelerator=args.accelerator,
        strategy=args.strategy,
        devices=args.devices,
        num_nodes=args.num_nodes,
        node_rank=args.node_rank,
        main_address=args.main_address.strip(),
        main_port=args.main_port,
        precision=args.precision,
        given=given,
        max_restarts=args.max_restarts,
        rdzv_id=args.rdzv_id,
        shutdown_timeout=args.shutdown_timeout,
    )


# ---- what to start --------------------------------------------------------------------------------------


def _gpu_count() -> int:
    """Visible CUDA devices; imports torch, so only asked when --devices needs it (-1 / 'auto')."""
    import torch

    return torch.cuda.device_count() if torch.backends.cuda.is_built() else 0


def processes_per_node(config: RunConfig) -> int:
    """How many processes this node runs."""
    if config.strategy not in (None, "auto"):
        from fabric.strategies import strategy_launch

        if strategy_launch(config.strategy) == "one_per_node":
            return 1
    devices = config.devices
    if "," in devices:
        return len([index for index in devices.split(",") if index])
    if devices.isdigit():
        return int(devices)
    # "auto" / "-1": every GPU where the accelerator may be a GPU, else one process
    if config.accelerator in ("cpu", "mps"):
        return 1
    count = _gpu_count()
    if count == 0 and config.accelerator == "cuda":
        raise ValueError(f"--devices={devices} asks for every CUDA device, but none is visible")
    return max(count, 1)  # no CUDA device: one process (the CPU, or the one MPS device)


def fabric_environment(config: RunConfig, nprocs: int) -> dict[str, str]:
    """The FABRIC_* variables the connector reads: the options given, and the shape of a job we start."""
    env: dict[str, str] = {}
    for name in ("accelerator", "strategy", "precision"):
        value = getattr(config, name)
        if value is not None:
            env[fabric_variable(name)] = value
    if "devices" in config.given or nprocs > 1 or config.num_nodes > 1:
        env[fabric_variable("devices")] = config.devices
    if "num_nodes" in config.given or config.num_nodes > 1:
        env[fabric_variable("num_nodes")] = str(config.num_nodes)
    return env


# ---- running ------------------------------------------------------------------------------------------


def _say(message: str) -> None:
    sys.stderr.write(f"[fabric] {message}\n")
    sys.stderr.flush()


def _run_ranks(
    command: list[str], envs: dict[int, dict[str, str]], max_restarts: int = 0, nodes: NodeRendezvous | None = None,
    shutdown_timeout: float | None = None,
) -> int:
    """Start the ranks of this node under one supervisor; the first failure or a stop signal ends them all.

    After a failure (not a signal, nor a pre-emption warning passed on) the ranks are started again,
    up to ``max_restarts`` times, each attempt with ``TORCHELASTIC_RESTART_COUNT`` set as torchrun sets
    it; with several nodes, every node's attempts go together through ``nodes`` (torch's elastic rendezvous).
    """
    from fabric.strategies.launchers.command_rank import CommandRank
    from fabric.strategies.launchers.signals import SignalForwarding, supervising_signals
    from fabric.strategies.launchers.supervisor import Supervisor

    first = min(envs)

    def start_rank(rank: int, job_dir: str) -> CommandRank:
        env = {**envs[rank], "TORCHELASTIC_RESTART_COUNT": str(supervisor.attempts - 1),
               "TORCHELASTIC_MAX_RESTARTS": str(max_restarts), **(nodes.attempt_environment if nodes else {})}
        # local rank 0 keeps the terminal's stdin, as under torchrun
        return CommandRank(rank, command, env, job_dir, keep_stdin=rank == first)

    # SIGINT/SIGHUP stop the job; SIGTERM/SIGUSR1 are passed on to the ranks (launchers/signals.py)
    with supervising_signals() as signals:
        forwarding = SignalForwarding(shutdown_timeout, report=_say)
        supervisor = Supervisor(start_rank, sorted(envs), signals=signals, forwarding=forwarding)
        try:
            result = nodes.run(supervisor, max_restarts, _say) if nodes else supervisor.run(report=_say)
            while not nodes and result.restartable and supervisor.attempts <= max_restarts:
                _say(f"restarting the ranks on this node (restart {supervisor.attempts} of {max_restarts})")
                result = supervisor.run(report=_say)
        finally:
            supervisor.close()
    return result.exit_status


def run(config: RunConfig) -> int:
    """Start the script for this node as ``config`` says; return the job's exit status."""
    try:
        nprocs = processes_per_node(config)
    except ValueError as err:
        _say(f"error: {err}")
        return 2
    env = {**os.environ, **fabric_environment(config, nprocs)}
    if nprocs == 1 and config.num_nodes == 1 and not config.max_restarts:
        # one process: become the script (same pid, signals and exit status are simply the script's)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, config.script, *config.script_args], env)

    main_port = config.main_port
    if main_port is None:
        main_port = find_free_port() if config.num_nodes == 1 else DEFAULT_MAIN_PORT
    if "OMP_NUM_THREADS" not in env:
        # N ranks each using every core would oversubscribe the CPU (torchrun sets 1; we share the cores)
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nprocs))
    envs = {}
    for local_rank in range(nprocs):
        ranks = rank_environment(config.main_address, main_port, config.node_rank, config.num_nodes, nprocs, local_rank)
        envs[global_rank(config.node_rank, nprocs, local_rank)] = {**env, **ranks}
    nodes = None
    if config.num_nodes > 1 and config.max_restarts:  # the one path of `fabric run` that imports torch
        from fabric.strategies.launchers.node_rendezvous import NodeRendezvous

        nodes = NodeRendezvous(config.main_address, main_port, config.node_rank, config.num_nodes, config.rdzv_id)
    return _run_ranks([sys.executable, config.script, *config.script_args], envs, config.max_restarts, nodes, config.shutdown_timeout)


# ---- entry point --------------------------------------------------------------------------------------

_TOP_HELP = f"""\
usage: {_PROG} <command> [options]

Fabric's command-line tool.

commands:
  run          Run a script that uses Fabric on several devices or machines (`{_PROG} run --help`).
  consolidate  Turn a sharded checkpoint folder into one file (`{_PROG} consolidate --help`).

options:
  -h, --help  show this help message and exit
  --version   print the version and exit
"""


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Entry point of the ``fabric`` command and ``python -m fabric``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        sys.stdout.write(_TOP_HELP)
        raise SystemExit(0 if args else 2)
    if args[0] == "--version":
        from fabric import __version__

        print(f"{_PROG} {__version__}")
        raise SystemExit(0)
    if args[0] == "consolidate":
        from fabric.consolidate import main as consolidate_main

        raise SystemExit(consolidate_main(args[1:]))
    if args[0] != "run":
        sys.stderr.write(_TOP_HELP)
        sys.stderr.write(f"{_PROG}: error: unknown command {args[0]!r}; accepted: run, consolidate\n")
        raise SystemExit(2)
    config = parse_run_args(args[1:])
    raise SystemExit(run(config))


if __name__ == "__main__":  # pragma: no cover
    main()
