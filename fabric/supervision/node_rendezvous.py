"""Several nodes that restart together: ``fabric run --num-nodes M --max-restarts N``, or ``--num-nodes MIN:MAX``.

Every node's ``fabric run`` joins torch's elastic rendezvous (the ``c10d`` backend, hosted by the node
of ``--node-rank 0`` at ``--main-address:--main-port``) once per attempt of the job, as torchrun's
agents do. A round of the rendezvous is an attempt:

* a round completes with every node (``--num-nodes M``), or, for ``MIN:MAX``, with MAX nodes at once or
  with the MIN or more that joined by the end of the last call (``--rdzv-conf last_call_timeout``,
  30 s): the bounded wait for more nodes after one is lost for good;
* in the round's store (a fresh key space per round) node 0 publishes a free port for the ranks'
  own rendezvous and the job's restart count, so every rank of the attempt meets its peers on a port
  no earlier attempt used (no stale gloo addresses) and sees the same ``TORCHELASTIC_RESTART_COUNT``;
* the nodes of the round are numbered by their ``--node-rank`` (each node its own; node 0, which hosts
  the store and is the ranks' ``MASTER_ADDR``, is always there): ``GROUP_RANK``, the global ranks and
  ``WORLD_SIZE`` follow from the round, so after a resize the script sees the new size and resumes
  on it (``fabric.checkpoint.resume.resize``). With a fixed number of nodes a rank keeps its number across
  attempts, so per-rank checkpoint state resumes where it belongs;
* while the ranks run, the supervisor asks :meth:`NodeRendezvous.should_stop`: a node waiting for the
  next round (its ranks failed, or it is new) makes the others stop theirs and join it, and a closed
  rendezvous (a node gave up: restarts exhausted, or a signal) ends the job everywhere;
* restarts count failures, as torchrun's do: a node whose ranks failed marks the round, and node 0
  counts the marked rounds; a node that joins (membership change) restarts the job without using up
  ``--max-restarts``;
* when this node's ranks all succeeded it waits for the other nodes to finish (the node hosting the
  store leaves last), so nobody loses the store while its ranks still work.

torch is imported only here, only on this path (``fabric run`` stays torch-free otherwise).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from fabric._core.env import fabric_variable, find_free_port, global_rank, rank_environment
from fabric._core.listening import tcp_store_arguments
from fabric._core.processes import signal_name
from fabric.supervision.signals import SignalPipe
from fabric.supervision.supervisor import POLL_S, JobResult, Supervisor, wait_readable

__all__ = ["JOIN_TIMEOUT_S", "OTHER_NODE_RESTARTS", "NodeRendezvous", "default_run_id"]

#: How long a node waits for all nodes to join a round (torchrun's default).
JOIN_TIMEOUT_S = 600
#: How often a running node asks the rendezvous whether another node wants a new round.
CHECK_EVERY_S = 0.5
#: The store's timeout for one read (torch's c10d rendezvous backend's default ``read_timeout``).
STORE_READ_TIMEOUT_S = 60
#: How long the node hosting the store waits, at the end, for the other nodes to see that the job ended.
LEAVE_TIMEOUT_S = 10.0

_PORT, _RESTART, _FAILED = "fabric/ranks_port", "fabric/restart_count", "fabric/failed"
_FINISHED, _LEFT = "fabric/finished", "fabric/left"
#: ``JobResult.stopped`` when another node waits for the next round: the one outside stop that restarts
OTHER_NODE_RESTARTS = "another node is restarting the job"
_CLOSED = "another node ended the job (restarts spent, or a signal)"


def default_run_id(main_address: str, main_port: int) -> str:
    """The rendezvous id all nodes of one job derive alike when the user gives none."""
    return f"fabric-{main_address}-{main_port}"


class NodeRendezvous:
    """This node's place in torch's elastic rendezvous: one round per attempt, shared by all nodes.

    Use :meth:`run` with the node's :class:`Supervisor`: before each attempt it sets the supervisor's
    ``rank_ids`` to this node's global ranks of the round, and the rank-starting function takes each
    rank's variables from :meth:`rank_variables`.
    """

    def __init__(
        self, main_address: str, main_port: int, node_rank: int, num_nodes: int, run_id: str | None = None, *,
        min_nodes: int | None = None, processes_per_node: int = 1, conf: dict[str, int] | None = None,
    ) -> None:
        self.main_address = main_address
        self.main_port = main_port
        self.node_rank = node_rank
        self.num_nodes = num_nodes  # the most nodes a round takes
        self.min_nodes = num_nodes if min_nodes is None else min_nodes
        self.processes_per_node = processes_per_node
        self.conf = dict(conf or {})  # --rdzv-conf
        self.run_id = run_id or default_run_id(main_address, main_port)
        #: this node's number and the number of nodes in the current attempt
        self.group_rank, self.group_world_size = node_rank, num_nodes
        #: the job's restart count (failed attempts so far) of the current attempt, as node 0 announced it
        self.restart_count = 0
        self._ranks_port = main_port
        self._handler: Any = None
        self._store: Any = None  # the current round's store
        self._next_check = 0.0
        #: told when the store cannot listen on the main address's interface alone (set by :meth:`run`)
        self.report: Callable[[str], object] | None = None

    @property
    def join_timeout(self) -> int:
        return self.conf.get("join_timeout", JOIN_TIMEOUT_S)

    def rank_ids(self) -> list[int]:
        """The global ranks this node runs in the current attempt."""
        return [global_rank(self.group_rank, self.processes_per_node, local) for local in range(self.processes_per_node)]

    def rank_variables(self, local_rank: int) -> dict[str, str]:
        """What local rank ``local_rank`` of this node sees in the current attempt (torchrun's variables)."""
        return {
            **rank_environment(self.main_address, self._ranks_port, self.group_rank, self.group_world_size,
                               self.processes_per_node, local_rank),
            "TORCHELASTIC_RESTART_COUNT": str(self.restart_count),
            "TORCHELASTIC_RUN_ID": self.run_id,
            fabric_variable("num_nodes"): str(self.group_world_size),
        }

    @property
    def endpoint(self) -> str:
        host = f"[{self.main_address}]" if ":" in self.main_address else self.main_address
        return f"{host}:{self.main_port}"

    # -- the job ----------------------------------------------------------------------------------

    def run(self, supervisor: Supervisor, max_restarts: int, report: Callable[[str], object]) -> JobResult:
        """Attempts of the job on this node, each started with the other nodes, up to ``max_restarts`` restarts.

        Ends with the first result that is not restarted: success everywhere, a signal (never
        restarted), or a failure once the restarts are spent (the failed rank's status).
        """
        result: JobResult | None = None
        self.report = report
        try:
            while True:
                ended = self._join(supervisor.signals)
                if ended is not None:  # a signal, or the job ended elsewhere, while waiting for the others
                    report(_why(ended))
                    if ended.signal is None and result is not None and result.failure is not None:
                        return result  # our own failure stays the cause and the exit status
                    result = ended
                    return ended
                supervisor.rank_ids = self.rank_ids()
                if self.min_nodes < self.num_nodes:
                    ranks = self.group_world_size * self.processes_per_node
                    report(f"this attempt runs on {self.group_world_size} node(s) of {self.min_nodes}..{self.num_nodes}"
                           f" ({ranks} ranks); this node is node {self.group_rank}")
                result = supervisor.run(report, should_stop=self.should_stop)
                if result.ok:
                    result = self._finish(supervisor.signals)
                    if result.ok:
                        return result
                    report(_why(result))
                if result.restartable:  # this node's ranks failed: a restart, if any is left
                    self._mark_failed()
                    if self.restart_count >= max_restarts:
                        return result
                    report(f"restarting the ranks on this node with the other nodes"
                           f" (restart {self.restart_count + 1} of {max_restarts})")
                elif result.stopped == OTHER_NODE_RESTARTS:  # another node failed, left or joined
                    report("starting the ranks on this node again with the nodes of the next round")
                else:
                    return result
        finally:
            self._leave()

    def should_stop(self) -> JobResult | None:
        """While the ranks run: a result when another node waits for a new round or closed the rendezvous."""
        now = time.monotonic()
        if now < self._next_check:
            return None
        self._next_check = now + CHECK_EVERY_S
        try:
            if self._handler.is_closed():
                return JobResult(stopped=_CLOSED)
            if self._handler.num_nodes_waiting() > 0:
                return JobResult(stopped=OTHER_NODE_RESTARTS)
        except Exception as err:  # the store is gone: its host node ended
            return JobResult(stopped=f"lost the node rendezvous at {self.endpoint} ({type(err).__name__}: {err})")
        return None

    # -- rounds ------------------------------------------------------------------------------------

    def _join(self, signals: SignalPipe | None) -> JobResult | None:
        """Join the next round with the other nodes (watching for signals meanwhile); None once joined."""
        outcome: dict[str, Any] = {}

        def join() -> None:
            try:
                self._next_round()
            except BaseException as err:  # handed to the waiting thread
                outcome["error"] = err

        worker = threading.Thread(target=join, name="fabric-node-rendezvous", daemon=True)
        worker.start()
        while worker.is_alive():
            signum = _signal_within(signals, POLL_S)
            if signum is not None:
                return JobResult(signal=signum)
            worker.join(0)
        if "error" in outcome:
            return JobResult(stopped=_join_failure(outcome["error"], self.endpoint, self.join_timeout))
        self._next_check = time.monotonic() + CHECK_EVERY_S
        return None

    def _next_round(self) -> None:
        if self._handler is None:
            self._handler = self._connect()
        previous = self._store
        info = self._handler.next_rendezvous()
        store = self._store = info.store
        if self.node_rank == 0:
            failed_before = previous is not None and previous.check([_FAILED])
            store.set(_RESTART, str(self.restart_count + int(failed_before)))
            store.set(_PORT, str(find_free_port("")))
        store.set(f"fabric/node_rank_of/{info.rank}", str(self.node_rank))
        given = [int(store.get(f"fabric/node_rank_of/{rank}")) for rank in range(info.world_size)]
        if len(set(given)) != len(given) or 0 not in given:
            raise ValueError(
                f"the nodes joined with --node-rank values {sorted(given)}; each of the {info.world_size} nodes needs"
                f" its own --node-rank, one of them 0 (the node at --main-address), accepted: 0 .. {self.num_nodes - 1}"
            )
        self.group_rank, self.group_world_size = sorted(given).index(self.node_rank), info.world_size
        self.restart_count = int(store.get(_RESTART))
        self._ranks_port = int(store.get(_PORT))

    def _mark_failed(self) -> None:
        """Tell node 0 that this attempt failed here: the next round counts as a restart."""
        try:
            self._store.set(_FAILED, "1")
        except Exception:  # the store is gone: the job ends anyway
            pass

    def _connect(self) -> Any:
        """The c10d rendezvous handler; the node of node rank 0 hosts its store.

        The store is the one torch's c10d backend would create (multi-tenant, a 60 s read timeout), but
        its server listens only on the interface of ``--main-address`` (``fabric._core.listening``), and
        torch's second store (the one it shares with the ranks of torchrun's agent, which ours never use)
        is not created: ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in this process (the ranks' environments
        are made before).
        """
        from torch.distributed import TCPStore
        from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        settings: dict[str, Any] = {**self.conf, "join_timeout": self.join_timeout, "is_host": self.node_rank == 0}
        parameters = RendezvousParameters(
            backend="c10d", endpoint=self.endpoint, run_id=self.run_id, min_nodes=self.min_nodes,
            max_nodes=self.num_nodes, **settings,
        )
        try:
            store = TCPStore(**tcp_store_arguments(
                self.main_address, self.main_port, is_server=self.node_rank == 0, single_machine=False,
                timeout=timedelta(seconds=STORE_READ_TIMEOUT_S), warn=self.report))
        except (ValueError, RuntimeError, TimeoutError) as err:  # as torch's c10d backend reports it
            raise RendezvousConnectionError(f"the connection to the store at {self.endpoint} failed") from err
        return create_handler(store, C10dRendezvousBackend(store, self.run_id), parameters)

    def _finish(self, signals: SignalPipe | None) -> JobResult:
        """This node's ranks all succeeded: wait until every node's did (or the job goes on without us)."""
        try:
            self._store.add(_FINISHED, 1)
            while self._store.add(_FINISHED, 0) < self.group_world_size:
                signum = _signal_within(signals, POLL_S)
                if signum is not None:
                    return JobResult(signal=signum)
                stopped = self.should_stop()
                # another node's ranks may have finished and closed the round between our two looks
                if stopped is not None and self._store.add(_FINISHED, 0) < self.group_world_size:
                    return stopped
        except Exception as err:
            return JobResult(stopped=f"lost the node rendezvous at {self.endpoint} ({type(err).__name__}: {err})")
        return JobResult()

    def _leave(self) -> None:
        """Close the rendezvous (the job is over: the others stop too) and leave; the store's host leaves last.

        The store lives in the process of node 0: it waits (a bounded time) until the other nodes have
        seen the end, so none of them meets a vanished store instead of a closed rendezvous.
        """
        if self._handler is None:
            return
        handler, store, self._handler, self._store = self._handler, self._store, None, None
        try:
            handler.shutdown()
            if store is None:
                return
            if self.node_rank != 0:
                store.add(_LEFT, 1)
                return
            deadline = time.monotonic() + LEAVE_TIMEOUT_S
            while store.add(_LEFT, 0) < self.group_world_size - 1 and time.monotonic() < deadline:
                time.sleep(POLL_S)
        except Exception:  # the store is gone already: nothing left to tell anybody
            pass


def _signal_within(signals: SignalPipe | None, timeout: float) -> int | None:
    """A watched signal that has arrived; else None, after waiting up to ``timeout`` seconds for one."""
    signum = signals.take() if signals is not None else None
    if signum is None:
        wait_readable([signals.fd] if signals is not None and signals.fd is not None else [], timeout)
    return signum


def _why(result: JobResult) -> str:
    """Why waiting for the other nodes (to join, or to finish) ended: a signal, or a ``stopped`` reason."""
    if result.signal is not None:
        return f"received {signal_name(result.signal)} while waiting for the other nodes"
    return str(result.stopped)


def _join_failure(error: BaseException, endpoint: str, join_timeout: int) -> str:
    name = type(error).__name__
    if name == "RendezvousClosedError":
        return _CLOSED
    if name == "RendezvousTimeoutError":
        return f"not enough nodes joined the node rendezvous at {endpoint} within {join_timeout} s"
    if isinstance(error, ValueError):
        return f"error: {error}"
    cause = f" ({type(error.__cause__).__name__}: {error.__cause__})" if error.__cause__ is not None else ""
    return f"the node rendezvous at {endpoint} failed: {name}: {error}{cause}"
