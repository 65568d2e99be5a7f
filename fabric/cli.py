"""``fabric run``: start a script that builds a plain ``Fabric()`` on one or more devices and machines.

The command-line options travel to the script through ``FABRIC_*`` environment variables, which the
connector reads, so the script needs no flags of its own. One process is the script itself (this
process is replaced by it). More processes per node, or more nodes, are started here, each with the
variables torchrun exports (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``NODE_RANK``), so inside the script Fabric finds a complete job
and launches nothing. This process then watches the ranks of its node: the first one that fails
brings the others down and its exit status becomes the command's.

Why our own small launcher instead of ``torch.distributed.run``: it needs only the standard library
(no torch or torch.distributed import before the ranks start), and failure handling, exit codes and
signal forwarding are exactly what this module says, on every node.

Details worth knowing:

* Each rank is its own process group (so it is stopped together with its subprocesses) and, on
  Linux, dies with `fabric run` even when that is killed with SIGKILL (a parent-death signal).
* SIGINT/SIGTERM/SIGHUP to `fabric run` are passed to every rank; after ``GRACE_S`` what is left is
  killed; the exit status is 128 + the signal.
* When several ranks fail, the one noticed first is reported and its status returned (peers that
  lost their connection usually fail a little later).
* ``OMP_NUM_THREADS`` defaults to cores / processes per node, so N ranks do not oversubscribe the CPU.

Only the standard library is imported at module level; keep it that way (start-up time).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

__all__ = ["main", "run", "build_run_parser"]

_PROG = "fabric"
ENV_PREFIX = "FABRIC_"

# Kept here (not imported from the accelerator/precision modules, which import torch) so `fabric run`
# starts fast; tests/test_cli.py checks they agree with the real registries.
ACCELERATORS = ("auto", "cpu", "cuda", "gpu", "mps")
PRECISIONS = ("32-true", "64-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "32", "64", "16", "bf16")
# Strategies that start processes of their own (from inside the script) or need another launcher.
_NOT_FOR_CLI = {
    "ddp_spawn": "it starts its own processes from inside the script",
    "ddp_fork": "it starts its own processes from inside the script",
    "ddp_notebook": "it starts its own processes from inside the script",
    "ddp_forkserver": "it starts its own processes from inside the script",
    "ddp_spawn_find_unused_parameters_true": "it starts its own processes from inside the script",
    "horovod": "Horovod jobs are started by horovodrun: `horovodrun -np N python SCRIPT`",
}
# Strategies that run one process per node whatever --devices says.
_ONE_PROCESS_STRATEGIES = ("dp", "single_device")

DEFAULT_MAIN_ADDRESS = "127.0.0.1"
DEFAULT_MAIN_PORT = 29400

#: Seconds the ranks get to end after a failure or a signal before they are killed.
GRACE_S = 3.0
_POLL_S = 0.05
_PR_SET_PDEATHSIG = 1


# ---- options ------------------------------------------------------------------------------------------


def _strategies() -> tuple[str, ...]:
    """Strategy names the CLI accepts: the registry minus those that start processes themselves."""
    from fabric.strategies import STRATEGY_REGISTRY  # the registry module itself imports nothing heavy

    return ("auto", *(name for name in STRATEGY_REGISTRY if name not in _NOT_FOR_CLI))


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
    text = value.strip()
    listed = text.startswith("[") and text.endswith("]")  # "[0, 1]": indices, like "0,1"
    inner = text[1:-1] if listed else text
    if text in ("auto", "-1"):
        return text
    if inner.isdigit() and int(inner) > 0 and not listed:
        return str(int(inner))
    parts = [p.strip() for p in inner.split(",") if p.strip()]
    if ("," in inner or listed) and parts and all(p.isdigit() for p in parts):
        if len(set(parts)) != len(parts):
            raise argparse.ArgumentTypeError(f"--devices={value!r} names a device more than once")
        # a single index keeps its comma ("0,": device 0, not a count of 0 devices)
        return ",".join(str(int(p)) for p in parts) + ("," if len(parts) == 1 else "")
    raise argparse.ArgumentTypeError(
        f"--devices={value!r} is not valid; accepted: a positive number of devices per node (e.g. 2),"
        " -1 or 'auto' (every GPU), or device indices such as '0,1'"
    )


def _positive_int(option: str) -> Any:
    def parse(value: str) -> int:
        if value.strip().isdigit() and int(value) >= 1:
            return int(value)
        raise argparse.ArgumentTypeError(f"{option}={value!r} is not valid; accepted: an integer >= 1")

    return parse


def _non_negative_int(value: str) -> int:
    if value.strip().isdigit():
        return int(value)
    raise argparse.ArgumentTypeError(f"--node-rank={value!r} is not valid; accepted: an integer >= 0")


def _port(value: str) -> int:
    if value.strip().isdigit() and 1 <= int(value) <= 65535:
        return int(value)
    raise argparse.ArgumentTypeError(f"--main-port={value!r} is not valid; accepted: an integer in 1..65535")


# (dest, flags, argparse keyword arguments); the flag spellings are Lightning Fabric's.
def _options() -> list[tuple[str, tuple[str, ...], dict[str, Any]]]:
    strategies = _strategies()
    return [
        ("accelerator", ("--accelerator",), dict(
            type=_choice("--accelerator", ACCELERATORS), default=None, metavar="NAME",
            help=f"The hardware to run on: {', '.join(ACCELERATORS)}. Default: the script's choice ('auto')."),
        ),
        ("strategy", ("--strategy",), dict(
            type=_choice("--strategy", strategies, _NOT_FOR_CLI), default=None, metavar="NAME",
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
            type=_non_negative_int, default=0, metavar="R",
            help="Index of this machine, 0 .. num_nodes-1 (run the command once per machine). Default: 0."),
        ),
        ("main_address", ("--main-address", "--main_address"), dict(
            default=DEFAULT_MAIN_ADDRESS, metavar="HOST",
            help="Address of the machine with node rank 0, reachable from all nodes."
            f" Default: {DEFAULT_MAIN_ADDRESS}."),
        ),
        ("main_port", ("--main-port", "--main_port"), dict(
            type=_port, default=None, metavar="PORT",
            help=f"Port on the main machine for the rendezvous. Default: {DEFAULT_MAIN_PORT}"
            " (on a single node, a free port)."),
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
    )


# ---- what to start --------------------------------------------------------------------------------------


def _gpu_count() -> int:
    """Visible CUDA devices; imports torch, so only asked when --devices needs it (-1 / 'auto')."""
    import torch

    return torch.cuda.device_count() if torch.backends.cuda.is_built() else 0


def processes_per_node(config: RunConfig) -> int:
    """How many processes this node runs."""
    if config.strategy in _ONE_PROCESS_STRATEGIES:
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
            env[ENV_PREFIX + name.upper()] = value
    if "devices" in config.given or nprocs > 1 or config.num_nodes > 1:
        env[ENV_PREFIX + "DEVICES"] = config.devices
    if "num_nodes" in config.given or config.num_nodes > 1:
        env[ENV_PREFIX + "NUM_NODES"] = str(config.num_nodes)
    return env


def rank_environment(config: RunConfig, nprocs: int, local_rank: int, main_port: int) -> dict[str, str]:
    """The torchrun-style variables of one rank (Fabric then sees a job that is already started)."""
    return {
        "MASTER_ADDR": config.main_address,
        "MASTER_PORT": str(main_port),
        "WORLD_SIZE": str(nprocs * config.num_nodes),
        "RANK": str(config.node_rank * nprocs + local_rank),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "GROUP_RANK": str(config.node_rank),
        "NODE_RANK": str(config.node_rank),
        "GROUP_WORLD_SIZE": str(config.num_nodes),
        "ROLE_RANK": str(config.node_rank * nprocs + local_rank),
        "ROLE_WORLD_SIZE": str(nprocs * config.num_nodes),
    }


def _free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


# ---- running ------------------------------------------------------------------------------------------


# Started in place of the script: ask Linux to kill this process if `fabric run` dies (even by SIGKILL),
# then become the script. Done in a fresh interpreter rather than in preexec_fn, which is unsafe once
# the launching process has threads.
_TRAMPOLINE = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    libc = ctypes.CDLL(None, use_errno=True)\n"
    f"    libc.prctl({_PR_SET_PDEATHSIG}, signal.SIGKILL, 0, 0, 0)\n"
    "    if os.getppid() != int(sys.argv[1]):\n"
    "        os._exit(137)\n"
    "except (OSError, AttributeError):\n"
    "    pass\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])\n"
)


@dataclass
class _Rank:
    rank: int
    local_rank: int
    proc: subprocess.Popen

    def describe(self, code: int) -> str:
        if code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with status {code}"
        return f"rank {self.rank} (local rank {self.local_rank}, pid {self.proc.pid}) {how}"


def _say(message: str) -> None:
    sys.stderr.write(f"[fabric run] {message}\n")
    sys.stderr.flush()


def _exit_status(code: int) -> int:
    return 128 - code if code < 0 else code


class _NodeJob:
    """The ranks of this node: start them, watch them, end them all when one fails or we are signalled."""

    def __init__(self, command: list[str], envs: list[dict[str, str]], ranks: list[int]) -> None:
        self.command = command
        self.envs = envs
        self.rank_ids = ranks
        self.ranks: list[_Rank] = []
        self._signal: int | None = None

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._signal is None:
            self._signal = signum

    def run(self) -> int:
        watched = [s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None]
        # Python lets only the main thread handle signals; from another thread they keep their effect
        main_thread = threading.current_thread() is threading.main_thread()
        previous = {s: signal.signal(s, self._on_signal) for s in watched} if main_thread else {}
        wakeup = _WakeUp()
        try:
            self._start()
            return self._watch(wakeup)
        finally:
            wakeup.close()
            self._stop(signal.SIGTERM)
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _start(self) -> None:
        launcher_pid = str(os.getpid())
        linux = sys.platform.startswith("linux")
        for local_rank, (env, rank) in enumerate(zip(self.envs, self.rank_ids)):
            if self._signal is not None:
                return
            argv = [sys.executable, "-c", _TRAMPOLINE, launcher_pid, *self.command] if linux else [sys.executable, *self.command]
            proc = subprocess.Popen(
                argv,
                env=env,
                stdin=None if local_rank == 0 else subprocess.DEVNULL,
                # its own process group: we can end the rank together with its subprocesses
                start_new_session=True,
            )
            self.ranks.append(_Rank(rank, local_rank, proc))

    def _watch(self, wakeup: _WakeUp) -> int:
        for rank in self.ranks:
            wakeup.watch(rank.proc.pid)
        while True:
            if self._signal is not None:
                name = signal.Signals(self._signal).name
                _say(f"received {name}; stopping {len(self._alive())} rank(s) on this node")
                self._stop(self._signal, sweep=True)
                return 128 + self._signal
            done = 0
            for rank in self.ranks:
                code = rank.proc.poll()
                if code is None:
                    continue
                if code != 0:
                    others = self._alive()
                    tail = f"; stopping the other {len(others)} rank(s) on this node" if others else ""
                    _say(rank.describe(code) + tail)
                    self._stop(signal.SIGTERM, sweep=True)
                    return _exit_status(code)
                wakeup.forget(rank.proc.pid)  # an ended process stays "ready": stop looking at it
                done += 1
            if done == len(self.ranks):
                return 0
            # Wake up the moment a rank ends (or a signal comes), so the rank that failed first is the
            # one reported, not a peer that failed a few milliseconds later because it lost its connection.
            wakeup.wait(_POLL_S)

    def _alive(self) -> list[_Rank]:
        return [r for r in self.ranks if r.proc.poll() is None]

    def _stop(self, signum: int, sweep: bool = False) -> None:
        """Send ``signum`` to every live rank's process group, then SIGKILL what is left after GRACE_S.

        With ``sweep``, also kill what is left in the ranks' process groups (their subprocesses).
        """
        alive = self._alive()
        for rank in alive:
            _kill_group(rank.proc.pid, signum)
        deadline = time.monotonic() + GRACE_S
        while alive and time.monotonic() < deadline:
            time.sleep(_POLL_S)
            alive = self._alive()
        for rank in alive:
            _kill_group(rank.proc.pid, signal.SIGKILL)
        for rank in self.ranks:
            try:
                rank.proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                pass
            if sweep:
                _kill_group(rank.proc.pid, signal.SIGKILL)


class _WakeUp:
    """Blocks until a watched process ends, a signal arrives, or a timeout passes (Linux: pidfds)."""

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}  # pid -> pidfd
        self._read_fd: int | None = None
        self._previous_wakeup: int | None = None
        try:
            read_fd, write_fd = os.pipe()
            os.set_blocking(read_fd, False)
            os.set_blocking(write_fd, False)
            self._previous_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
            self._read_fd, self._write_fd = read_fd, write_fd
        except (ValueError, OSError):  # not the main thread: rely on the timeout
            pass

    def watch(self, pid: int) -> None:
        pidfd_open = getattr(os, "pidfd_open", None)
        if pidfd_open is None:
            return
        try:
            self._fds[pid] = pidfd_open(pid)
        except OSError:  # old kernel, or the process is already gone: the timeout covers it
            pass

    def forget(self, pid: int) -> None:
        fd = self._fds.pop(pid, None)
        if fd is not None:
            os.close(fd)

    def wait(self, timeout: float) -> None:
        import select

        fds = [*self._fds.values(), *([self._read_fd] if self._read_fd is not None else [])]
        if not fds:
            time.sleep(timeout)
            return
        ready = select.select(fds, [], [], timeout)[0]
        if self._read_fd is not None and self._read_fd in ready:
            try:
                os.read(self._read_fd, 512)
            except OSError:
                pass

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
        if self._read_fd is not None:
            signal.set_wakeup_fd(self._previous_wakeup if self._previous_wakeup is not None else -1)
            os.close(self._read_fd)
            os.close(self._write_fd)
            self._read_fd = None


def _kill_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def run(config: RunConfig) -> int:
    """Start the script for this node as ``config`` says; return the job's exit status."""
    try:
        nprocs = processes_per_node(config)
    except ValueError as err:
        _say(f"error: {err}")
        return 2
    env = {**os.environ, **fabric_environment(config, nprocs)}
    command = [config.script, *config.script_args]
    if nprocs == 1 and config.num_nodes == 1:
        # one process: become the script (same pid, signals and exit status are simply the script's)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *command], env)

    main_port = config.main_port
    if main_port is None:
        main_port = _free_port() if config.num_nodes == 1 else DEFAULT_MAIN_PORT
    if "OMP_NUM_THREADS" not in env:
        # N ranks each using every core would oversubscribe the CPU (torchrun sets 1; we share the cores)
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nprocs))
    envs = [{**env, **rank_environment(config, nprocs, local, main_port)} for local in range(nprocs)]
    ranks = [config.node_rank * nprocs + local for local in range(nprocs)]
    return _NodeJob(command, envs, ranks).run()


# ---- entry point --------------------------------------------------------------------------------------

_TOP_HELP = f"""\
usage: {_PROG} <command> [options]

Fabric's command-line tool.

commands:
  run    Run a script that uses Fabric on several devices or machines (`{_PROG} run --help`).

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
    if args[0] != "run":
        sys.stderr.write(_TOP_HELP)
        sys.stderr.write(f"{_PROG}: error: unknown command {args[0]!r}; accepted: run\n")
        raise SystemExit(2)
    config = parse_run_args(args[1:])
    raise SystemExit(run(config))


if __name__ == "__main__":  # pragma: no cover
    main()
