"""The interface every process launcher implements."""

from __future__ import annotations

import signal
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from fabric._core.threads import share_cores

__all__ = ["Launcher", "share_cores_with_torch"]


class Launcher(ABC):
    """Starts the processes of a job and runs a function in each of them.

    A strategy owns one launcher. ``Fabric.launch`` hands the user's function to
    :meth:`launch`; the launcher decides how the other processes come to exist (by
    re-running the script, by forking, by spawning) and keeps watch over them so that a
    failure anywhere ends the whole job instead of leaving ranks waiting forever.
    """

    @property
    @abstractmethod
    def is_interactive_compatible(self) -> bool:
        """Whether this launcher works from a notebook or a REPL.

        Launchers that re-run the script or pickle the function by reference cannot run code
        that lives only in the session (see ``fabric.launching.in_interactive_session``).
        """

    @abstractmethod
    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Start the job's processes and run ``function(*args, **kwargs)``.

        Returns what the function returned in the process with local rank 0.
        """

    @property
    def requires_function(self) -> bool:
        """Whether :meth:`launch` needs a real function to run.

        True for launchers whose new processes run only that function (spawn, fork);
        False for those that re-run the whole script, where ``launch`` may get a no-op.
        """
        return False

    def kill(self, signum: int = signal.SIGTERM) -> None:
        """Tear down every process this launcher started (and their subprocesses).

        Strategies call this from their exception handler so that the other ranks do
        not keep waiting in a collective for a rank that is gone. The default does
        nothing: some launchers start no processes of their own.
        """

    def on_rank_failure(self, trace: str) -> None:
        """The user's code raised in this process with ``trace``; the strategy reports it here.

        A launcher that supervises the job diagnoses the failure (for a collective timeout: which
        ranks never arrived, and where they were) and stops the other ranks; in a supervised rank it
        leaves the traceback where the supervisor finds it. The default stops the processes.
        """
        self.kill()


def share_cores_with_torch(local_processes: int) -> None:
    """Give this process and the ranks it starts their share of the cores (``fabric._core.threads``)."""
    threads = share_cores(local_processes)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
