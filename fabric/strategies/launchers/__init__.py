"""Process launchers: how the processes of a distributed job come to exist and end.

* :class:`SubprocessScriptLauncher` ("popen") re-runs the user's command for each extra local rank;
  the user's own process is local rank 0.
* :class:`MultiprocessingLauncher` ("spawn", "fork", "forkserver") starts workers from the current
  process and returns the result of process 0.

Both, and ``fabric run``, hand their rank processes to one :class:`Supervisor` (:mod:`fabric.supervision`),
which stops the whole job quickly when any rank fails and, when a collective times out, first names
the ranks that never arrived and where each one was. This package holds only the :class:`Launcher`
contract and these two adapters of it; the supervision itself needs neither torch nor a strategy.
"""

from fabric.strategies.launchers.launcher import Launcher
from fabric.strategies.launchers.multiprocessing import MultiprocessingLauncher
from fabric.strategies.launchers.subprocess_script import SubprocessScriptLauncher
from fabric.supervision.supervisor import JobResult, RankFailedError, RankFailure, Supervisor

__all__ = [
    "JobResult",
    "Launcher",
    "MultiprocessingLauncher",
    "RankFailedError",
    "RankFailure",
    "SubprocessScriptLauncher",
    "Supervisor",
]
