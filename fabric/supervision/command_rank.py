"""A rank started from a command line: the handle ``fabric run`` and the popen launcher give the supervisor.

The process runs ``command`` in its own session (so it can be stopped with all its subprocesses),
bound to this process's death (see ``rank_side``), with three variables that make it a supervised
rank: the supervisor's pid, the write end of a status pipe on which it reports "I raised" at once,
and the job folder for its traceback and, when asked, its stack.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Collection, Mapping

from fabric._core.env import JOB_DIR_ENV, STATUS_FD_ENV, SUPERVISOR_PID_ENV
from fabric.supervision.rank_side import rank_command

__all__ = ["CommandRank"]


class CommandRank:
    """One rank process started from ``command`` (a :class:`~fabric.supervision.supervisor.RankProcess`)."""

    def __init__(
        self,
        rank: int,
        command: list[str],
        env: Mapping[str, str],
        job_dir: str,
        keep_stdin: bool = False,
        cwd: str | None = None,
    ) -> None:
        self.rank = rank
        self.raised_at: float | None = None
        self.traceback: str | None = None  # a command's rank prints its own traceback
        #: (status or None, when) the rank reported as it began to exit (``rank_side.report_exit``)
        self.exiting: tuple[int | None, float] | None = None
        read_fd, write_fd = os.pipe()
        full_env = {**env, SUPERVISOR_PID_ENV: str(os.getpid()), STATUS_FD_ENV: str(write_fd), JOB_DIR_ENV: job_dir}
        try:
            self.proc = subprocess.Popen(
                rank_command(command),
                env=full_env,
                cwd=cwd,
                stdin=None if keep_stdin else subprocess.DEVNULL,
                pass_fds=(write_fd,),
                # its own session and process group: the rank is stopped with its subprocesses, and a
                # terminal's Ctrl-C reaches only the supervisor, which decides what happens to the job
                start_new_session=True,
            )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        os.set_blocking(read_fd, False)
        self._status_fd: int | None = read_fd
        self._status_open = True
        self._pidfd: int | None = None
        pidfd_open = getattr(os, "pidfd_open", None)
        if pidfd_open is not None:
            try:
                self._pidfd = pidfd_open(self.proc.pid)
            except OSError:  # an old kernel, or the process is already gone: the poll timeout covers it
                pass

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def poll(self) -> int | None:
        code = self.proc.poll()
        if code is not None and self._status_open:
            self._read_status()  # it may have reported just before it ended
        return code

    def fds(self) -> list[int]:
        if self.proc.returncode is not None:
            return []  # an ended process stays "readable": stop looking at it
        fds = [self._pidfd] if self._pidfd is not None else []
        if self._status_open and self._status_fd is not None:
            fds.append(self._status_fd)
        return fds

    def take_reports(self, ready: Collection[int]) -> None:
        if self._status_open and self._status_fd in ready:
            self._read_status()

    def _read_status(self) -> None:
        if self._status_fd is None:
            return
        try:
            data = os.read(self._status_fd, 256)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._status_open = False  # every copy of the write end is closed
            return
        for line in data.split(b"\n"):
            if line.startswith(b"E") and self.raised_at is None:
                try:
                    self.raised_at = float(line[1:])
                except ValueError:
                    self.raised_at = float("inf")  # raised, when unknown: after every timed report
            elif line.startswith(b"X") and self.exiting is None:
                status, _, when = line[1:].partition(b" ")
                try:
                    self.exiting = (int(status) if status.isdigit() else None, float(when))
                except ValueError:
                    pass

    def close(self) -> None:
        for fd in (self._status_fd, self._pidfd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._status_fd = self._pidfd = None
        self._status_open = False
