"""Process launchers: how the processes of a distributed job come to exist and end.

* :class:`SubprocessScriptLauncher` ("popen") re-runs the user's command for each
  extra local rank; the user's own process is local rank 0.
* :class:`MultiprocessingLauncher` ("spawn", "fork", "forkserver") starts workers
  from the current process and returns the result of process 0.

Both stop the whole job quickly when any rank fails (see ``supervision``); when a
collective times out, they first name the ranks that never arrived and where each
one was (see ``diagnosis``).
"""

from fabric.strategies.launchers.launcher import Launcher
from fabric.strategies.launchers.multiprocessing import MultiprocessingLauncher
from fabric.strategies.launchers.subprocess_script import SubprocessScriptLauncher
from fabric.strategies.launchers.supervision import RankFailedError

__all__ = ["Launcher", "MultiprocessingLauncher", "RankFailedError", "SubprocessScriptLauncher"]
