"""Process supervision: start a job's rank processes, watch them, find the root cause, stop, report.

``fabric run`` (:mod:`fabric.cli`) and both launchers of :mod:`fabric.strategies.launchers` hand their
rank processes to the one :class:`Supervisor`, so a failure is handled the same way however the job was
started. The modules:

* :mod:`~fabric.supervision.supervisor`: :class:`Supervisor`, the rank handle it needs
  (:class:`RankProcess`), the ranks' states (:class:`RankState`) and the job's result (:class:`JobResult`);
* :mod:`~fabric.supervision.diagnosis`: for a collective timeout, which rank never arrived and where each was;
* :mod:`~fabric.supervision.signals`: signals to the supervising process, and the ones passed on to the ranks;
* :mod:`~fabric.supervision.rank_side`: what runs inside a rank (it never outlives its supervisor, reports
  that it raised);
* :mod:`~fabric.supervision.command_rank`: a rank started from a command line (``fabric run``, popen);
* :mod:`~fabric.supervision.rank_zero`: the popen job's supervision inside rank 0;
* :mod:`~fabric.supervision.node_rendezvous`: several nodes that restart together (``fabric run
  --num-nodes M --max-restarts N``); the only module that uses torch, imported inside its functions;
* :mod:`~fabric.supervision.lighthouse`: ``fabric-torch lighthouse``, torchft's server where the replica groups of a
  ``ddp_ft`` job meet (torchft, which imports torch, is imported inside its ``main`` only).

Every module imports only the standard library (and :mod:`fabric._core`) at import time, never
torch nor the rest of fabric, so ``fabric run`` starts ranks without paying for ``import torch``.
``tests/test_import_cost_guard.py`` keeps it that way.
"""

from fabric.supervision.supervisor import JobResult, RankFailedError, RankFailure, RankProcess, RankState, Supervisor

__all__ = ["JobResult", "RankFailedError", "RankFailure", "RankProcess", "RankState", "Supervisor"]
