"""Environment variables: their names, the global-rank formula, and the variables one rank gets.

The launchers, ``fabric run`` and the connector all talk through the environment: ``fabric run`` hands
its options to ``Fabric()`` in ``FABRIC_*`` variables, a supervisor tells each rank where it sits with
torchrun's rank variables, and ranks find their supervisor through the variables named here. Reading
a rank's position back is the cluster environments' job (``fabric.plugins.environments``), not this
module's.
"""

from __future__ import annotations

import os
import socket

__all__ = [
    "ENV_PREFIX",
    "JOB_DIR_ENV",
    "LIGHTHOUSE_ENV",
    "LIGHTNING_CLI_ENV",
    "NUM_REPLICA_GROUPS_ENV",
    "REPLICA_GROUP_ENV",
    "RUN_BY_CLI_ENV",
    "RUN_COMMAND_ENV",
    "STATUS_FD_ENV",
    "SUPERVISOR_PID_ENV",
    "cli_option",
    "export_rendezvous",
    "fabric_variable",
    "find_free_port",
    "global_rank",
    "rank_environment",
    "run_command",
    "started_by_a_cli",
    "started_by_lightning_cli",
]

#: ``fabric run --devices 2`` reaches ``Fabric()`` as ``FABRIC_DEVICES=2``.
ENV_PREFIX = "FABRIC_"
#: The pid of the supervisor that started this rank; a rank that sees its parent's pid here is one of ours.
SUPERVISOR_PID_ENV = "FABRIC_PARENT_PID"
#: An inherited pipe on which a rank tells its supervisor "I raised" (and when).
STATUS_FD_ENV = "FABRIC_STATUS_FD"
#: The job folder where ranks leave their tracebacks and, when asked, their stacks.
JOB_DIR_ENV = "FABRIC_JOB_DIR"
#: Set to "1" by ``fabric run`` for the processes it starts: ``Fabric()`` then sets the process up at once,
#: so a script can call ``torch.distributed`` right after creating it (as under Lightning's CLI).
RUN_BY_CLI_ENV = "FABRIC_RUN_BY_CLI"
#: The launching command as the user typed it (``fabric-torch run``, ``fabric run``, ``python -m fabric run``), set
#: by ``fabric run`` for its ranks so that their messages name it.
RUN_COMMAND_ENV = "FABRIC_RUN_COMMAND"
_DEFAULT_RUN_COMMAND = "fabric-torch run"
#: Fault tolerance across replica groups (the ``ddp_ft`` strategy, on torchft): ``fabric run --lighthouse HOST:PORT
#: --replica-group G --num-replica-groups R`` gives every rank of its job the lighthouse's address (``http://HOST:PORT``,
#: under the name torchft itself reads), its group's number G (0 .. R-1) and the number of groups R.
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
REPLICA_GROUP_ENV = "FABRIC_REPLICA_GROUP"
NUM_REPLICA_GROUPS_ENV = "FABRIC_NUM_REPLICA_GROUPS"


#: Lightning Fabric's CLI (its ``fabric run``, ``python -m lightning_fabric.cli``) marks the ranks it starts
#: through torchrun with ``LT_CLI_USED=1`` and hands its options over as ``LT_ACCELERATOR``, ``LT_STRATEGY``,
#: ``LT_DEVICES``, ``LT_NUM_NODES`` and ``LT_PRECISION``.
LIGHTNING_CLI_ENV = "LT_CLI_USED"
_LIGHTNING_PREFIX = "LT_"


def started_by_lightning_cli() -> bool:
    """Whether Lightning Fabric's CLI started this process (``LT_CLI_USED`` is a non-zero number)."""
    value = os.environ.get(LIGHTNING_CLI_ENV, "").strip()
    return value.isdigit() and int(value) != 0


def started_by_a_cli() -> bool:
    """Whether ``fabric run`` (ours or Lightning's) started this process: ``Fabric()`` then joins the job at once."""
    return os.environ.get(RUN_BY_CLI_ENV) == "1" or started_by_lightning_cli()


def cli_option(name: str) -> tuple[str, str, str] | None:
    """An option a run command handed to ``Fabric()``: (variable, value, the command as typed), or None.

    Ours (``FABRIC_<NAME>``) first; Lightning's CLI's (``LT_<NAME>``) only in a process that CLI started.
    """
    variable = fabric_variable(name)
    if variable in os.environ:
        return variable, os.environ[variable], run_command()
    variable = _LIGHTNING_PREFIX + name.upper()
    if variable in os.environ and started_by_lightning_cli():
        return variable, os.environ[variable], "fabric run"
    return None


def run_command() -> str:
    """The ``run`` command as the user typed it, for messages; ``fabric-torch run`` when no CLI said."""
    return os.environ.get(RUN_COMMAND_ENV, "").strip() or _DEFAULT_RUN_COMMAND


def fabric_variable(name: str) -> str:
    """``"num_nodes"`` -> ``"FABRIC_NUM_NODES"``."""
    return ENV_PREFIX + name.upper()


def global_rank(node_rank: int, processes_per_node: int, local_rank: int) -> int:
    """The rank of a process among all processes of the job (every node runs the same number)."""
    return node_rank * processes_per_node + local_rank


def rank_environment(
    main_address: str, main_port: int, node_rank: int, num_nodes: int, processes_per_node: int, local_rank: int
) -> dict[str, str]:
    """The variables torchrun exports to one rank, so the rank finds a complete, already started job."""
    rank = str(global_rank(node_rank, processes_per_node, local_rank))
    world_size = str(processes_per_node * num_nodes)
    return {
        "MASTER_ADDR": main_address,
        "MASTER_PORT": str(main_port),
        "WORLD_SIZE": world_size,
        "RANK": rank,
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(processes_per_node),
        "GROUP_RANK": str(node_rank),
        "NODE_RANK": str(node_rank),
        "GROUP_WORLD_SIZE": str(num_nodes),
        "ROLE_RANK": rank,
        "ROLE_WORLD_SIZE": world_size,
    }


def export_rendezvous(main_address: str, main_port: int) -> None:
    """Put the rendezvous point where ``init_process_group`` and every rank started later will read it.

    The one place in fabric that writes ``MASTER_ADDR``/``MASTER_PORT``.
    """
    os.environ["MASTER_ADDR"] = str(main_address)
    os.environ["MASTER_PORT"] = str(main_port)


def find_free_port(host: str = "127.0.0.1") -> int:
    """Ask the OS for a TCP port that nothing is bound to right now.

    The socket is closed before returning, so another program could grab the port in between; callers
    use it soon after.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
