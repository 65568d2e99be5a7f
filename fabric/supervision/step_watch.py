"""A bound on a training step that makes no progress (``step_timeout``): a hang becomes a death, with where it was.

A rank that hangs (alive, its threads still running, but its training loop not moving) stops its replica group and,
through the quorum, every other group. A death is what the fault-tolerant strategies recover from, so a hang is
made into one: each rank tells how far it got, and a rank that has not moved for ``step_timeout`` seconds is ended
with a report of where it was; its launcher then restarts it as after any death.

Who ends it:

* under a supervisor (``fabric-torch run``, the popen launcher's ranks 1..N-1), the **supervisor**: each rank
  keeps a small file in its job folder (:class:`StepWatch`: the bound, the monotonic time of its last progress and
  its committed step count, in shared memory), and the supervisor looks at it with the ranks
  (:class:`StepWatchReader`). It sees a rank that is stopped (SIGSTOP), or stuck in C code that holds the GIL, as
  stalled all the same, and ends it with SIGKILL;
* without one (a single process started directly, a rank under Ray, the popen launcher's own rank 0), a thread
  of the rank itself, which can end it from a hang of its Python code but not from a stop.

Waiting on other replica groups (the quorum, the all-reduce across groups, the commit, a healing transfer) and
writing or reading a checkpoint are not a stall: they have bounds of their own (``quorum_timeout``,
``replica_timeout``, the store's), and a group waiting for a hung peer must not be ended in its place. The bound
is armed at the end of the first step this process takes, so that a first step that compiles or warms up (or a
checkpoint loaded before it) is not cut short.

Standard library only (``fabric run`` imports it).
"""

from __future__ import annotations

import mmap
import os
import signal
import struct
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from fabric._core.env import JOB_DIR_ENV, SUPERVISOR_PID_ENV
from fabric.supervision.diagnosis import where_rank_is, where_this_process_is

__all__ = ["GROUP_STEP_ENV", "Stall", "StepWatch", "StepWatchReader", "describe_stall", "supervisor_job_dir"]

#: The highest step a replica group committed in its earlier attempts (``fabric run`` sets it for each restart):
#: a group restarted after its peers finished must not train alone from step 0.
GROUP_STEP_ENV = "FABRIC_FT_GROUP_STEP"

# seq (odd while written), the bound (0: not armed), the last progress (CLOCK_MONOTONIC; 0: waiting on others),
# committed steps
_LAYOUT = struct.Struct("<qddq")
_FILE = "step-rank{rank}"


def supervisor_job_dir() -> str | None:
    """The job folder of the supervisor that started this process and watches it (None: no supervisor does)."""
    marker = os.environ.get(SUPERVISOR_PID_ENV, "")
    if not marker.isdigit() or int(marker) != os.getppid():
        return None  # started by hand, by torchrun or Ray, or the popen launcher's own rank 0
    return os.environ.get(JOB_DIR_ENV) or None


def _path(job_dir: str, rank: int) -> str:
    return os.path.join(job_dir, _FILE.format(rank=rank))


@dataclass(frozen=True)
class Stall:
    """A rank that made no progress for longer than its bound."""

    rank: int
    seconds: float
    timeout: float


def describe_stall(stall: Stall, where: str | None) -> str:
    """The one report of a stalled rank: how long, the setting that bounds it, and where it was."""
    place = f"it was at {where}" if where else "it did not answer the request for its stack (stopped, or stuck outside Python)"
    return (
        f"fabric: rank {stall.rank} made no progress for {stall.seconds:.1f} s (step_timeout={stall.timeout:g} s):"
        f" {place}; it is ended so that its group restarts and heals (raise step_timeout if such a step is expected)"
    )


class StepWatch:
    """This rank's side: how far it got, where the supervisor (or its own watcher thread) can see it.

    Args:
        timeout: seconds a rank may go without progress once armed.
        job_dir: the supervisor's job folder (None: no supervisor watches this rank; a thread of its own does).
        rank: this rank's number in the job folder.
    """

    def __init__(self, timeout: float, job_dir: str | None, rank: int) -> None:
        self.timeout = float(timeout)
        self.rank = rank
        self._lock = threading.Lock()
        self._seq = 0
        self._armed = False
        self._at = 0.0
        self._committed = 0
        self._map: mmap.mmap | None = None
        if job_dir and os.path.isdir(job_dir):
            fd = os.open(_path(job_dir, rank), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, _LAYOUT.size)
                self._map = mmap.mmap(fd, _LAYOUT.size)
            finally:
                os.close(fd)
            self._write()
        else:
            threading.Thread(target=self._watch_own_process, name="fabric-step-watch", daemon=True).start()

    @property
    def supervised(self) -> bool:
        """Whether a supervisor looks at this rank (else a thread of the rank itself)."""
        return self._map is not None

    def beat(self, committed: int | None = None) -> None:
        """Progress now (``committed``: the committed step count, for the launcher's memory of the group)."""
        with self._lock:
            self._at = time.monotonic()
            if committed is not None:
                self._committed = committed
            self._write()

    def arm(self) -> None:
        """Bound the steps from now on (called once this process has taken its first step)."""
        if not self._armed:
            with self._lock:
                self._armed = True
                self._at = time.monotonic()
                self._write()

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """A wait that has its own bound (on other groups, on storage): not a stall. Progress again at its end."""
        with self._lock:
            self._at = 0.0
            self._write()
        try:
            yield
        finally:
            self.beat()

    def _write(self) -> None:
        if self._map is None:
            return
        timeout = self.timeout if self._armed else 0.0
        self._seq += 1
        self._map[:8] = struct.pack("<q", self._seq)  # odd: a reader retries
        self._map[8:] = _LAYOUT.pack(0, timeout, self._at, self._committed)[8:]
        self._seq += 1
        self._map[:8] = struct.pack("<q", self._seq)

    def _watch_own_process(self) -> None:
        """Without a supervisor: end this process from a hang of its own (its main thread's stack on stderr)."""
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            with self._lock:
                at, armed = self._at, self._armed
            stalled = time.monotonic() - at if armed and at else 0.0
            if stalled > self.timeout:
                report = describe_stall(Stall(self.rank, stalled, self.timeout), where_this_process_is())
                sys.stderr.write(report + "\n")
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGKILL)


class StepWatchReader:
    """The supervisor's side: the step files of one attempt's ranks."""

    def __init__(self, job_dir: str | None) -> None:
        self._job_dir = job_dir
        self._maps: dict[int, mmap.mmap] = {}
        #: the highest committed step count any rank reported (kept across :meth:`close`, for the next attempt)
        self.committed = 0

    def look(self, ranks: Mapping[int, int]) -> Stall | None:
        """The first of ``ranks`` (rank -> pid, the running ones) that stalled beyond its bound, if any."""
        now = time.monotonic()
        for rank in ranks:
            values = self._read(rank)
            if values is None:
                continue
            timeout, at, committed = values
            self.committed = max(self.committed, committed)
            if timeout > 0 and at > 0 and now - at > timeout:
                return Stall(rank, now - at, timeout)
        return None

    def _read(self, rank: int) -> tuple[float, float, int] | None:
        mapped = self._maps.get(rank)
        if mapped is None:
            if not self._job_dir:
                return None
            try:
                fd = os.open(_path(self._job_dir, rank), os.O_RDONLY)
            except OSError:
                return None  # the rank keeps no step file (not a fault-tolerant strategy, or not set up yet)
            try:
                if os.fstat(fd).st_size < _LAYOUT.size:
                    return None
                mapped = self._maps[rank] = mmap.mmap(fd, _LAYOUT.size, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
        for _ in range(100):  # a write takes nanoseconds: a torn read is retried
            seq, timeout, at, committed = _LAYOUT.unpack(mapped[:])
            if seq % 2 == 0 and struct.unpack("<q", mapped[:8])[0] == seq:
                return timeout, at, committed
        return None

    def where(self, stall: Stall, pid: int) -> str | None:
        """Where the stalled rank was (its main thread's stack, asked with the stack-dump signal), or None."""
        return where_rank_is(self._job_dir, stall.rank, pid)

    def close(self, ranks: Iterable[int] = ()) -> None:
        """Take the last word of ``ranks`` (their committed steps), then let go of the files."""
        for rank in ranks:
            values = self._read(rank)
            if values is not None:
                self.committed = max(self.committed, values[2])
        for mapped in self._maps.values():
            mapped.close()
        self._maps.clear()
