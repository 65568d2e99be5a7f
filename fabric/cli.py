"""``fabric-torch run``: start a script that builds a plain ``Fabric()`` on one or more devices and machines.

The command is installed as ``fabric-torch`` (the distribution's name, which no other package uses) and as
``fabric`` (the name Lightning Fabric users know, which Lightning's packages install too: whichever was
installed last owns it), and runs as ``python -m fabric``; every message and doc shows ``fabric-torch``,
and ``--help``/``--version`` say which package and which folder the command belongs to.

The command-line options travel to the script through ``FABRIC_*`` environment variables, which the
connector reads, so the script needs no flags of its own. One process is the script itself (this
process is replaced by it). More processes per node, or more nodes, are started here, each with the
variables torchrun exports (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``NODE_RANK``), so inside the script Fabric finds a complete job
and launches nothing. This process then watches the ranks of its node with the same supervisor the launchers use
(``fabric.supervision.supervisor``): the first rank that fails brings the others down and its
exit status becomes the command's.

Why our own small launcher instead of ``torch.distributed.run``: it needs only the standard library
(no torch or torch.distributed import before the ranks start), and failure handling, exit codes and
signal forwarding are exactly what this module says, on every node.

Details worth knowing:

* Each rank is its own process group (so it is stopped together with its subprocesses) and never
  outlives `fabric run`, even when that is killed with SIGKILL (see ``fabric.supervision.rank_side``).
* SIGUSR1 and SIGTERM (the cluster's pre-emption warnings) are passed on to every rank's own
  process, which decides when to stop (``fabric.preempted``); after SIGTERM the ranks get
  ``--shutdown-timeout`` seconds to end, and the job ends with their status (``fabric.supervision.signals``).
  SIGINT, SIGHUP or a second SIGTERM stop every rank at once: exit status 128 + the signal.
* When several ranks fail, the root cause is reported and its status returned: a rank that died
  outright before ranks that raised (their errors are echoes), else the rank that raised first.
* A rank whose collective timed out is diagnosed as under the launchers: which rank never arrived,
  and where it was.
* With several nodes and ``--max-restarts``, or ``--num-nodes MIN:MAX`` (elastic), the nodes meet in torch's
  elastic rendezvous once per attempt (``fabric.supervision.node_rendezvous``): each attempt's number of
  nodes, and so every rank's ``RANK``/``WORLD_SIZE``, comes from its round.
* With ``--replica-group G --num-replica-groups R --lighthouse HOST:PORT`` the job is one replica group of a
  fault-tolerant job (the ``ddp_ft`` strategy, on torchft): every rank of every attempt gets ``TORCHFT_LIGHTHOUSE``,
  ``FABRIC_REPLICA_GROUP`` and ``FABRIC_NUM_REPLICA_GROUPS``. Each group is its own ``fabric run``, which watches
  and restarts its own ranks only: nothing here hears of another group, so its end is never this group's failure.
  ``fabric-torch lighthouse`` runs the server the groups meet at (``fabric.supervision.lighthouse``).
* ``OMP_NUM_THREADS`` defaults to usable cores / processes per node, so N ranks do not oversubscribe the
  CPU (``fabric._core.threads``; the launchers apply the same rule).

Only the standard library is imported at module level; keep it that way (start-up time).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

from fabric._core.env import (
    LIGHTHOUSE_ENV,
    NUM_REPLICA_GROUPS_ENV,
    REPLICA_GROUP_ENV,
    RUN_BY_CLI_ENV,
    RUN_COMMAND_ENV,
    fabric_variable,
    find_free_port,
    global_rank,
    rank_environment,
)
from fabric._core.threads import share_cores
from fabric.run_options import DEFAULT_MAIN_PORT, DISTRIBUTION, PROG, RunConfig, build_run_parser, parse_run_args

if TYPE_CHECKING:
    from fabric.supervision.node_rendezvous import NodeRendezvous

__all__ = ["about", "build_run_parser", "main", "program_name", "run"]

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
    env: dict[str, str] = {RUN_BY_CLI_ENV: "1", RUN_COMMAND_ENV: f"{config.prog} run"}
    for name in ("accelerator", "strategy", "precision"):
        value = getattr(config, name)
        if value is not None:
            env[fabric_variable(name)] = value
    if "devices" in config.given or nprocs > 1 or config.num_nodes > 1:
        env[fabric_variable("devices")] = config.devices
    if "num_nodes" in config.given or config.num_nodes > 1:
        env[fabric_variable("num_nodes")] = str(config.num_nodes)
    if config.lighthouse is not None:  # one replica group of a fault-tolerant job (ddp_ft): every attempt gets them
        env[LIGHTHOUSE_ENV] = config.lighthouse
        env[REPLICA_GROUP_ENV] = str(config.replica_group)
        env[NUM_REPLICA_GROUPS_ENV] = str(config.num_replica_groups)
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
    from fabric.supervision.command_rank import CommandRank
    from fabric.supervision.signals import SignalForwarding, supervising_signals
    from fabric.supervision.step_watch import GROUP_STEP_ENV
    from fabric.supervision.supervisor import Supervisor

    first = min(envs)

    def start_rank(rank: int, job_dir: str) -> CommandRank:
        # with several nodes the round decides the ranks' numbers (`nodes.rank_ids()`): this is local rank `local`
        local = rank - (min(supervisor.rank_ids) if nodes else first)
        env = {**envs[first + local], "TORCHELASTIC_RESTART_COUNT": str(supervisor.attempts - 1),
               "TORCHELASTIC_MAX_RESTARTS": str(max_restarts), **(nodes.rank_variables(local) if nodes else {})}
        if REPLICA_GROUP_ENV in env:  # a replica group restarted after its peers finished must not start over alone
            env[GROUP_STEP_ENV] = str(supervisor.committed_steps)
        # local rank 0 keeps the terminal's stdin, as under torchrun
        return CommandRank(rank, command, env, job_dir, keep_stdin=local == 0)

    # SIGINT/SIGHUP stop the job; SIGTERM/SIGUSR1 are passed on to the ranks (fabric/supervision/signals.py)
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
    share_cores(nprocs, env)  # N ranks each using every core would oversubscribe the CPU
    envs = {}
    for local_rank in range(nprocs):
        ranks = rank_environment(config.main_address, main_port, config.node_rank, config.num_nodes, nprocs, local_rank)
        envs[global_rank(config.node_rank, nprocs, local_rank)] = {**env, **ranks}
    nodes = None
    if config.node_rendezvous:  # the one path of `fabric run` that imports torch
        from fabric.supervision.node_rendezvous import NodeRendezvous, default_run_id

        rdzv_id = config.rdzv_id
        if rdzv_id is None and config.replica_group is not None:
            # two replica groups given the same main address and port must never meet in one rendezvous: each
            # group restarts alone, whatever another group does
            rdzv_id = f"{default_run_id(config.main_address, main_port)}-replica-group-{config.replica_group}"
        nodes = NodeRendezvous(config.main_address, main_port, config.node_rank, config.num_nodes, rdzv_id,
                               min_nodes=config.min_nodes, processes_per_node=nprocs, conf=config.rdzv_conf)
    return _run_ranks([sys.executable, config.script, *config.script_args], envs, config.max_restarts, nodes, config.shutdown_timeout)


# ---- entry point --------------------------------------------------------------------------------------

_TOP_HELP = """\
usage: {prog} <command> [options]

{about}

commands:
  run          Run a script that uses Fabric on several devices or machines (`{prog} run --help`).
  consolidate  Turn a sharded checkpoint folder into one file (`{prog} consolidate --help`).
  lighthouse   Run torchft's lighthouse, where the replica groups of a ddp_ft job meet (`{prog} lighthouse --help`).

options:
  -h, --help  show this help message and exit
  --version   print the version (and where this package is) and exit

This command is `{distribution}`, also `python -m fabric`. The package installs it as `fabric` too,
but Lightning (`lightning`, `lightning-fabric`) installs a `fabric` command of its own, and whichever
package was installed last owns that name: write `{distribution}` or `python -m fabric` in scripts.
"""


def program_name(argv0: str) -> str:
    """The command as the user called it, for usage lines: ``fabric-torch``, ``fabric`` or ``python -m fabric``."""
    name = os.path.basename(argv0)
    if name == "__main__.py" and os.path.dirname(os.path.abspath(argv0)) == os.path.dirname(os.path.abspath(__file__)):
        return "python -m fabric"  # this package's __main__.py (python -m sets argv[0] to its path)
    for command in (DISTRIBUTION, "fabric"):
        if name in (command, f"{command}.exe", f"{command}-script.py"):
            return command
    return PROG


def about() -> str:
    """Which package this command belongs to: ``fabric-torch 0.1.0 (the fabric package at /path/fabric)``."""
    import fabric

    return f"{DISTRIBUTION} {fabric.__version__} (the fabric package at {os.path.dirname(os.path.abspath(fabric.__file__))})"


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Entry point of the ``fabric-torch`` (and ``fabric``) command and of ``python -m fabric``."""
    args = list(sys.argv[1:] if argv is None else argv)
    prog = program_name(sys.argv[0] if sys.argv else "")
    if not args or args[0] in ("-h", "--help"):
        text = _TOP_HELP.format(prog=prog, distribution=DISTRIBUTION, about=f"The command line of {about()}.")
        sys.stdout.write(text)
        raise SystemExit(0 if args else 2)
    if args[0] == "--version":
        print(about())
        raise SystemExit(0)
    if args[0] == "consolidate":
        from fabric.consolidate import main as consolidate_main

        raise SystemExit(consolidate_main(args[1:], prog=f"{prog} consolidate"))
    if args[0] == "lighthouse":
        from fabric.supervision.lighthouse import main as lighthouse_main

        raise SystemExit(lighthouse_main(args[1:], prog=f"{prog} lighthouse"))
    if args[0] != "run":
        sys.stderr.write(_TOP_HELP.format(prog=prog, distribution=DISTRIBUTION, about=f"The command line of {about()}."))
        sys.stderr.write(f"{prog}: error: unknown command {args[0]!r}; accepted: run, consolidate, lighthouse\n")
        raise SystemExit(2)
    config = parse_run_args(args[1:], prog=prog, about=f"This is {about()}, not Lightning's launcher.")
    note = config.taken_after_script_note()
    if note:
        _say(note)
    raise SystemExit(run(config))


if __name__ == "__main__":  # pragma: no cover
    main()
