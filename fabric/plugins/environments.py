"""Cluster environments: where does this process sit in a (possibly multi-node) job?

A strategy needs four facts before it can join a process group: how many processes
there are, which one this is, where rank 0 listens, and whether somebody else
already started all the processes. Every scheduler and launcher answers those
questions through different environment variables; the classes here translate them
into one interface so strategies never read ``os.environ`` themselves.

Rules shared by every environment in this module:

* A variable that is required but missing, or set to something that is not a
  well-formed value (``RANK="x"``, a negative size, a port above 65535), raises
  ``ValueError`` naming the variable and the offending value.
* Environments never write ``MASTER_ADDR``/``MASTER_PORT`` into ``os.environ``, with
  one exception: :class:`LightningEnvironment` stores the free port it picked in
  ``MASTER_PORT`` so processes it launches later agree on it. Strategies export
  ``main_address``/``main_port`` themselves before ``init_process_group``.
* Only the standard library is imported at module level; ``mpi4py`` is imported
  the first time an :class:`MPIEnvironment` instance needs a rank.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import socket
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterator
from itertools import product
from typing import Any

__all__ = [
    "ClusterEnvironment",
    "KubeflowEnvironment",
    "LightningEnvironment",
    "LocalEnvironment",
    "LSFEnvironment",
    "MPIEnvironment",
    "SLURMEnvironment",
    "TorchElasticEnvironment",
    "detect_cluster_environment",
    "find_free_port",
    "parse_slurm_nodelist",
]

log = logging.getLogger(__name__)

# Ports derived from a scheduler job id land in [_JOB_PORT_BASE, _JOB_PORT_BASE + _JOB_PORT_SPAN).
# The window sits below the usual Linux ephemeral range (32768+) so an outgoing
# connection is unlikely to be holding it, and two jobs sharing a node only collide
# when their ids are congruent modulo 10000.
_JOB_PORT_BASE = 10000
_JOB_PORT_SPAN = 10000

_INT_PATTERN = re.compile(r"\s*[+-]?[0-9]+\s*")


# --------------------------------------------------------------------------------------
# Reading the environment
# --------------------------------------------------------------------------------------


def _parse_int(name: str, raw: str, *, minimum: int = 0, maximum: int | None = None) -> int:
    """Turn the text of variable ``name`` into an int, or say exactly what is wrong with it."""
    if not _INT_PATTERN.fullmatch(raw):
        raise ValueError(f"Environment variable {name}={raw!r} is not an integer.")
    value = int(raw)
    if value < minimum or (maximum is not None and value > maximum):
        upper = "" if maximum is None else f" and at most {maximum}"
        raise ValueError(f"Environment variable {name}={raw!r} is out of range: expected at least {minimum}{upper}.")
    return value


def _env_int(name: str, default: int | None = None, *, minimum: int = 0, maximum: int | None = None) -> int:
    """Read an integer variable; a missing variable falls back to ``default`` or is an error."""
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise ValueError(f"Environment variable {name} is required here but is not set.")
        return default
    return _parse_int(name, raw, minimum=minimum, maximum=maximum)


def _env_port(name: str = "MASTER_PORT") -> int:
    return _env_int(name, minimum=1, maximum=65535)


def _env_str(name: str) -> str:
    """Read a required, non-empty string variable."""
    raw = os.environ.get(name)
    if raw is None:
        raise ValueError(f"Environment variable {name} is required here but is not set.")
    if not raw.strip():
        raise ValueError(f"Environment variable {name}={raw!r} is empty.")
    return raw.strip()


def _port_from_job_id(name: str) -> int:
    """Map a numeric scheduler job id to a port, so every rank of the job derives the same one."""
    job_id = _env_int(name)
    return _JOB_PORT_BASE + job_id % _JOB_PORT_SPAN


def _checked_int(name: str, value: Any, minimum: int) -> int:
    """Validate an argument a strategy passes in (not an env var), so bad calls fail early."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    return value


def _hostname() -> str:
    return socket.gethostname()


def find_free_port(host: str = "127.0.0.1") -> int:
    """Ask the OS for a TCP port that nothing is bound to right now.

    The socket is closed before returning, so another program could grab the port in
    between; callers should use it soon after.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _check_world_size(source: str, world_size: int, num_devices: int, num_nodes: int) -> None:
    expected = num_devices * num_nodes
    if world_size != expected:
        raise ValueError(
            f"The cluster reports {source}={world_size} processes, but the configuration asks for"
            f" devices={num_devices} x num_nodes={num_nodes} = {expected}. Make them agree."
        )


# --------------------------------------------------------------------------------------
# The interface
# --------------------------------------------------------------------------------------


class ClusterEnvironment(ABC):
    """Describes the job this process belongs to, so a strategy can join the process group."""

    @property
    @abstractmethod
    def creates_processes_externally(self) -> bool:
        """True when an outside launcher already started every rank, so we must start none."""

    @property
    @abstractmethod
    def main_address(self) -> str:
        """Host that rank 0 listens on for the rendezvous."""

    @property
    @abstractmethod
    def main_port(self) -> int:
        """Port that rank 0 listens on for the rendezvous."""

    @staticmethod
    @abstractmethod
    def detect() -> bool:
        """Whether the current process runs under this environment."""

    @abstractmethod
    def world_size(self) -> int:
        """Number of processes in the whole job."""

    @abstractmethod
    def set_world_size(self, size: int) -> None:
        """Let the strategy tell the environment the world size (ignored where the cluster decides)."""

    @abstractmethod
    def global_rank(self) -> int:
        """Index of this process among all processes of the job."""

    @abstractmethod
    def set_global_rank(self, rank: int) -> None:
        """Let the strategy tell the environment the global rank (ignored where the cluster decides)."""

    @abstractmethod
    def local_rank(self) -> int:
        """Index of this process among the processes on its node; picks the device."""

    @abstractmethod
    def node_rank(self) -> int:
        """Index of this process's node among the job's nodes."""

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Raise ``ValueError`` if the user's configuration contradicts what the cluster says."""

    def teardown(self) -> None:
        """Undo any changes this environment made to the process (e.g. env vars it set)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class _ClusterDecidesRanks:
    """Mixin for environments whose launcher started every rank: ranks come from it, setters only log.

    The rendezvous point defaults to MASTER_ADDR/MASTER_PORT, as torchrun and Kubeflow export them.
    """

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return _env_str("MASTER_ADDR")

    @property
    def main_port(self) -> int:
        return _env_port()

    def set_world_size(self, size: int) -> None:
        log.debug("%s ignores set_world_size(%r); the world size comes from the environment.", type(self).__name__, size)

    def set_global_rank(self, rank: int) -> None:
        log.debug("%s ignores set_global_rank(%r); the rank comes from the environment.", type(self).__name__, rank)


# --------------------------------------------------------------------------------------
# Our own launcher (and the single-process fallback)
# --------------------------------------------------------------------------------------


class LightningEnvironment(ClusterEnvironment):
    """The fallback: a single process, or ranks started by our own launcher or by hand.

    The strategy decides world size and global rank and hands them in through the
    setters. When no ``MASTER_PORT`` is set, :attr:`main_port` picks a free local port
    and writes it to ``os.environ["MASTER_PORT"]`` so that child processes launched
    afterwards inherit the same port; :meth:`teardown` removes it again.
    """

    def __init__(self) -> None:
        self._world_size = 1
        self._global_rank = 0
        self._port_we_set: str | None = None

    @property
    def creates_processes_externally(self) -> bool:
        return "LOCAL_RANK" in os.environ

    @property
    def main_address(self) -> str:
        raw = os.environ.get("MASTER_ADDR", "").strip()
        return raw or "127.0.0.1"

    @property
    def main_port(self) -> int:
        if "MASTER_PORT" in os.environ:
            return _env_port()
        port = find_free_port()
        os.environ["MASTER_PORT"] = str(port)
        self._port_we_set = str(port)
        return port

    @staticmethod
    def detect() -> bool:
        return True

    def world_size(self) -> int:
        return self._world_size

    def set_world_size(self, size: int) -> None:
        self._world_size = _checked_int("world size", size, 1)

    def global_rank(self) -> int:
        return self._global_rank

    def set_global_rank(self, rank: int) -> None:
        self._global_rank = _checked_int("global rank", rank, 0)

    def local_rank(self) -> int:
        return _env_int("LOCAL_RANK", 0)

    def node_rank(self) -> int:
        for name in ("NODE_RANK", "GROUP_RANK"):
            if name in os.environ:
                return _env_int(name)
        return 0

    def teardown(self) -> None:
        # Only remove the port if it is still the one we wrote; someone may have replaced it.
        if self._port_we_set is not None and os.environ.get("MASTER_PORT") == self._port_we_set:
            del os.environ["MASTER_PORT"]
        self._port_we_set = None


LocalEnvironment = LightningEnvironment


# --------------------------------------------------------------------------------------
# torchrun / torch.distributed.elastic
# --------------------------------------------------------------------------------------


class TorchElasticEnvironment(_ClusterDecidesRanks, ClusterEnvironment):
    """Processes started by ``torchrun``, which exports every rank and the rendezvous point."""

    _MARKERS = ("RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")

    @staticmethod
    def detect() -> bool:
        return all(name in os.environ for name in TorchElasticEnvironment._MARKERS)

    def world_size(self) -> int:
        return _env_int("WORLD_SIZE", minimum=1)

    def global_rank(self) -> int:
        return _env_int("RANK")

    def local_rank(self) -> int:
        return _env_int("LOCAL_RANK")

    def node_rank(self) -> int:
        return _env_int("GROUP_RANK")

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        _check_world_size("WORLD_SIZE", self.world_size(), num_devices, num_nodes)


# --------------------------------------------------------------------------------------
# SLURM
# --------------------------------------------------------------------------------------

# One bracket group of a Slurm hostlist item: a list of (low, high) digit strings.
_Ranges = list[tuple[str, str]]
_RANGE_PATTERN = re.compile(r"([0-9]+)(?:-([0-9]+))?")


def _parse_brackets(body: str, nodelist: str) -> _Ranges:
    ranges: _Ranges = []
    for part in body.split(","):
        match = _RANGE_PATTERN.fullmatch(part.strip())
        if match is None:
            raise ValueError(f"Malformed range {part!r} in Slurm nodelist {nodelist!r}.")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ValueError(f"Descending range {part!r} in Slurm nodelist {nodelist!r}.")
        ranges.append((low, high))
    return ranges


def _parse_item(item: str, nodelist: str) -> list[str | _Ranges]:
    """Split one top-level hostlist item into literal text and bracket groups."""
    segments: list[str | _Ranges] = []
    pos = 0
    while pos < len(item):
        open_at = item.find("[", pos)
        close_at = item.find("]", pos)
        if open_at == -1:
            if close_at != -1:
                raise ValueError(f"Unbalanced ']' in Slurm nodelist {nodelist!r}.")
            segments.append(item[pos:])
            break
        if close_at != -1 and close_at < open_at:
            raise ValueError(f"Unbalanced ']' in Slurm nodelist {nodelist!r}.")
        if open_at > pos:
            segments.append(item[pos:open_at])
        close_at = item.find("]", open_at)
        if close_at == -1:
            raise ValueError(f"Unbalanced '[' in Slurm nodelist {nodelist!r}.")
        body = item[open_at + 1 : close_at]
        if "[" in body:
            raise ValueError(f"Nested brackets in Slurm nodelist {nodelist!r}.")
        segments.append(_parse_brackets(body, nodelist))
        pos = close_at + 1
    return segments


def _split_top_level(nodelist: str) -> list[str]:
    """Split on commas and whitespace that are outside brackets."""
    items: list[str] = []
    depth = 0
    current: list[str] = []
    for char in nodelist:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if depth == 0 and (char == "," or char.isspace()):
            items.append("".join(current))
            current = []
        else:
            current.append(char)
    items.append("".join(current))
    return [item for item in items if item]


def _expand_ranges(ranges: _Ranges) -> Iterator[str]:
    for low, high in ranges:
        width = len(low)  # Slurm keeps the zero padding of the lower bound: [08-10] -> 08, 09, 10
        for number in range(int(low), int(high) + 1):
            yield str(number).zfill(width)


def _expand_item(segments: list[str | _Ranges]) -> Iterator[str]:
    choices = [[seg] if isinstance(seg, str) else list(_expand_ranges(seg)) for seg in segments]
    for parts in product(*choices):
        yield "".join(parts)


def parse_slurm_nodelist(nodelist: str) -> Iterator[str]:
    """Expand a compact Slurm nodelist (``"node[001-003,007],gpu5"``) into host names, in order.

    The whole string is checked for syntax immediately (``ValueError`` if malformed);
    the host names themselves are produced lazily, so taking only the first one of a
    huge allocation stays cheap. Several bracket groups in one item expand as a
    product, leftmost group varying slowest.
    """
    if not isinstance(nodelist, str):
        raise TypeError(f"nodelist must be a string, got {type(nodelist).__name__}.")
    if nodelist.count("[") != nodelist.count("]"):
        raise ValueError(f"Unbalanced brackets in Slurm nodelist {nodelist!r}.")
    items = _split_top_level(nodelist)
    if not items:
        raise ValueError(f"Slurm nodelist {nodelist!r} names no hosts.")
    parsed = [_parse_item(item, nodelist) for item in items]

    def generate() -> Iterator[str]:
        for segments in parsed:
            yield from _expand_item(segments)

    return generate()


class SLURMEnvironment(_ClusterDecidesRanks, ClusterEnvironment):
    """A batch job launched with ``srun``: Slurm starts one task per rank.

    Interactive allocations (``salloc`` shells, job names ``bash``/``interactive``) are
    not detected, because there the user starts processes themselves.

    Without ``MASTER_PORT`` the port is ``10000 + SLURM_JOB_ID % 10000`` (range
    10000-19999), identical on every node without any communication.
    """

    @property
    def main_address(self) -> str:
        if "MASTER_ADDR" in os.environ:
            return _env_str("MASTER_ADDR")
        for name in ("SLURM_NODELIST", "SLURM_JOB_NODELIST"):
            if name in os.environ:
                return self.resolve_root_node_address(os.environ[name])
        raise ValueError("Neither MASTER_ADDR nor SLURM_NODELIST/SLURM_JOB_NODELIST is set; cannot find the main node.")

    @property
    def main_port(self) -> int:
        if "MASTER_PORT" in os.environ:
            return _env_port()
        return _port_from_job_id("SLURM_JOB_ID")

    @staticmethod
    def detect() -> bool:
        return "SLURM_NTASKS" in os.environ and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive")

    @staticmethod
    def resolve_root_node_address(nodes: str) -> str:
        """First host of a compact Slurm nodelist, parsed locally (no ``scontrol`` call)."""
        try:
            return next(parse_slurm_nodelist(nodes))
        except StopIteration:  # pragma: no cover - parse_slurm_nodelist rejects empty lists
            raise ValueError(f"Slurm nodelist {nodes!r} names no hosts.") from None

    def world_size(self) -> int:
        return _env_int("SLURM_NTASKS", minimum=1)

    def global_rank(self) -> int:
        return _env_int("SLURM_PROCID")

    def local_rank(self) -> int:
        return _env_int("SLURM_LOCALID")

    def node_rank(self) -> int:
        return _env_int("SLURM_NODEID")

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        if "SLURM_NTASKS_PER_NODE" in os.environ:
            per_node = _env_int("SLURM_NTASKS_PER_NODE", minimum=1)
            if per_node != num_devices:
                raise ValueError(
                    f"SLURM_NTASKS_PER_NODE={per_node} but devices={num_devices}; Slurm must start one task per"
                    " device, so set --ntasks-per-node to the number of devices."
                )
        if "SLURM_NNODES" in os.environ:
            nodes = _env_int("SLURM_NNODES", minimum=1)
            if nodes != num_nodes:
                raise ValueError(
                    f"SLURM_NNODES={nodes} but num_nodes={num_nodes}; set num_nodes to the number of allocated nodes."
                )


# --------------------------------------------------------------------------------------
# LSF (jsrun)
# --------------------------------------------------------------------------------------


def _same_host(a: str, b: str) -> bool:
    """Compare host names, tolerating one side being fully qualified and the other short."""
    return a == b or a.split(".", 1)[0] == b.split(".", 1)[0]


class LSFEnvironment(_ClusterDecidesRanks, ClusterEnvironment):
    """An IBM Spectrum LSF job launched with ``jsrun``.

    Node rank and main address come from the rank file (``LSB_DJOB_RANKFILE``): one
    host per line, the first line being the launch node, which runs no rank and is
    skipped. Without ``MASTER_PORT`` the port is ``10000 + LSB_JOBID % 10000``.
    """

    _MARKERS = ("LSB_JOBID", "LSB_DJOB_RANKFILE", "JSM_NAMESPACE_LOCAL_RANK", "JSM_NAMESPACE_SIZE")

    @property
    def main_address(self) -> str:
        return self._compute_hosts()[0]

    @property
    def main_port(self) -> int:
        if "MASTER_PORT" in os.environ:
            return _env_port()
        return _port_from_job_id("LSB_JOBID")

    @staticmethod
    def detect() -> bool:
        return all(name in os.environ for name in LSFEnvironment._MARKERS)

    def world_size(self) -> int:
        return _env_int("JSM_NAMESPACE_SIZE", minimum=1)

    def global_rank(self) -> int:
        return _env_int("JSM_NAMESPACE_RANK")

    def local_rank(self) -> int:
        return _env_int("JSM_NAMESPACE_LOCAL_RANK")

    def node_rank(self) -> int:
        me = _hostname()
        for index, host in enumerate(self._compute_hosts()):
            if _same_host(host, me):
                return index
        path = os.environ.get("LSB_DJOB_RANKFILE")
        raise ValueError(f"This host {me!r} is not among the compute hosts in LSB_DJOB_RANKFILE={path!r}.")

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        _check_world_size("JSM_NAMESPACE_SIZE", self.world_size(), num_devices, num_nodes)

    @staticmethod
    def _compute_hosts() -> list[str]:
        """Distinct compute hosts from the rank file, in order of first appearance."""
        path = _env_str("LSB_DJOB_RANKFILE")
        try:
            with open(path, encoding="utf-8") as handle:
                lines = [line.strip() for line in handle]
        except OSError as err:
            raise ValueError(f"LSB_DJOB_RANKFILE={path!r} cannot be read: {err}") from err
        lines = [line for line in lines if line]
        hosts = list(dict.fromkeys(lines[1:]))  # skip the launch node, keep first-seen order
        if not hosts:
            raise ValueError(f"LSB_DJOB_RANKFILE={path!r} lists no compute hosts after the launch node.")
        return hosts


# --------------------------------------------------------------------------------------
# MPI (mpirun / mpiexec)
# --------------------------------------------------------------------------------------

_MPI_MARKERS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")
_MPI_HINT = "MPIEnvironment needs the mpi4py package: `pip install mpi4py`."


def _mpi4py_available() -> bool:
    try:
        return importlib.util.find_spec("mpi4py") is not None
    except (ImportError, ValueError):
        # ValueError: a module object without __spec__ already sits in sys.modules.
        return sys.modules.get("mpi4py") is not None


class MPIEnvironment(_ClusterDecidesRanks, ClusterEnvironment):
    """Processes started by an MPI launcher; ranks come from ``mpi4py``'s ``COMM_WORLD``.

    All values are gathered with one fixed sequence of collectives the first time any
    of them is asked for, then cached; so every rank must touch the environment (any
    property or rank method) once, as strategies do anyway. The main address and port
    are decided on rank 0 (its ``MASTER_ADDR``/hostname, its ``MASTER_PORT``/a free
    port) and broadcast, so ranks cannot disagree.
    """

    def __init__(self) -> None:
        if not _mpi4py_available():
            raise ImportError(_MPI_HINT)
        self._info: dict[str, Any] | None = None

    @property
    def main_address(self) -> str:
        return self._gather()["main_address"]

    @property
    def main_port(self) -> int:
        return self._gather()["main_port"]

    @staticmethod
    def detect() -> bool:
        # Env vars first: a plain run never even looks for mpi4py.
        if not any(name in os.environ for name in _MPI_MARKERS):
            return False
        return _mpi4py_available()

    def world_size(self) -> int:
        return self._gather()["world_size"]

    def global_rank(self) -> int:
        return self._gather()["global_rank"]

    def local_rank(self) -> int:
        return self._gather()["local_rank"]

    def node_rank(self) -> int:
        return self._gather()["node_rank"]

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        _check_world_size("the MPI world size", self.world_size(), num_devices, num_nodes)

    def _gather(self) -> dict[str, Any]:
        if self._info is not None:
            return self._info
        try:
            from mpi4py import MPI
        except ImportError as err:
            raise ImportError(_MPI_HINT) from err

        world = MPI.COMM_WORLD
        rank = int(world.Get_rank())
        size = int(world.Get_size())

        if hasattr(MPI, "COMM_TYPE_SHARED"):
            # Ranks that can share memory are on the same node.
            local = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
            local_rank = int(local.Get_rank())
            leader = local.bcast(rank, root=0)  # lowest world rank on this node names the node
            local.Free()
            leaders = world.allgather(leader)
            node_rank = sorted(set(leaders)).index(leader)
        else:
            # Pre-MPI-3 libraries: group by processor (host) name instead.
            names = world.allgather(MPI.Get_processor_name())
            me = names[rank]
            local_rank = names[:rank].count(me)
            node_rank = list(dict.fromkeys(names)).index(me)

        endpoint = None
        if rank == 0:
            address = os.environ.get("MASTER_ADDR", "").strip() or _hostname()
            port = _env_port() if "MASTER_PORT" in os.environ else find_free_port()
            endpoint = (address, port)
        address, port = world.bcast(endpoint, root=0)

        self._info = {
            "world_size": size,
            "global_rank": rank,
            "local_rank": local_rank,
            "node_rank": node_rank,
            "main_address": address,
            "main_port": int(port),
        }
        return self._info


# --------------------------------------------------------------------------------------
# Kubeflow PyTorchJob
# --------------------------------------------------------------------------------------


class KubeflowEnvironment(_ClusterDecidesRanks, ClusterEnvironment):
    """A Kubeflow PyTorchJob: the operator runs one process per pod and exports its rank."""

    _REQUIRED = ("KUBERNETES_PORT", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
    # Present when another launcher runs inside the pod; then that launcher's environment wins.
    _EXCLUDED = ("SLURM_NTASKS", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "GROUP_RANK", "LOCAL_WORLD_SIZE")

    @staticmethod
    def detect() -> bool:
        env = os.environ
        required = all(name in env for name in KubeflowEnvironment._REQUIRED)
        return required and not any(name in env for name in KubeflowEnvironment._EXCLUDED)

    def world_size(self) -> int:
        return _env_int("WORLD_SIZE", minimum=1)

    def global_rank(self) -> int:
        return _env_int("RANK")

    def local_rank(self) -> int:
        return 0

    def node_rank(self) -> int:
        return _env_int("RANK")

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        _check_world_size("WORLD_SIZE", self.world_size(), num_devices, num_nodes)


# --------------------------------------------------------------------------------------
# Detection
# --------------------------------------------------------------------------------------

_DETECTION_ORDER: tuple[type[ClusterEnvironment], ...] = (
    TorchElasticEnvironment,
    SLURMEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    KubeflowEnvironment,
    LightningEnvironment,
)


def detect_cluster_environment() -> ClusterEnvironment:
    """Instantiate the first environment that recognises the current process.

    The order runs from the most specific markers to the least: torchrun, Slurm, LSF,
    MPI, Kubeflow, and finally :class:`LightningEnvironment`, which always matches.
    """
    for env_cls in _DETECTION_ORDER:
        if env_cls.detect():
            log.debug("Detected cluster environment %s.", env_cls.__name__)
            return env_cls()
    return LightningEnvironment()  # pragma: no cover - LightningEnvironment.detect() is always True
