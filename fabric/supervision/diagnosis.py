"""Which rank did not arrive, and where was it? The diagnosis of a collective that timed out.

A rank that never joins a collective leaves the others waiting until the process group's timeout
makes one of them raise. That error says *that* a collective timed out, never *who* kept it waiting.
The supervisor (rank 0's monitor thread under "popen", the launching process under "spawn") can tell:
before it tears the job down it asks every live rank for the Python stack of its main thread and
sorts the ranks into those that were inside a collective ("waited") and those that were elsewhere
("did not arrive"), each with the file, line and function it was at.

How a rank's stack is obtained without its cooperation: at start, every rank registers
``faulthandler`` on :data:`DUMP_SIGNAL`, writing to its own file in a job folder that the launcher
creates and passes down (:data:`JOB_DIR_ENV`). The handler runs in C, so it answers even while the
rank sleeps, spins in pure Python, or blocks inside a C call. The supervisor sends the signal and
reads the file; its own stack (rank 0 under "popen") it reads directly.

A rank that raised also leaves its traceback in the job folder (:func:`record_failure`), so the
supervisor knows what failed even for ranks whose traceback only went to their own stderr.

Only the standard library is used, so importing this module is cheap.
"""

from __future__ import annotations

import faulthandler
import io
import linecache
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import tokenize
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import IO

from fabric._core.processes import process_alive
from fabric.supervision.failure_report import is_library

__all__ = [
    "DUMP_SIGNAL",
    "JOB_DIR_ENV",
    "Frame",
    "create_job_dir",
    "diagnose",
    "install_stack_dump",
    "looks_like_collective_timeout",
    "read_failures",
    "record_failure",
    "remove_job_dir",
    "where_rank_is",
    "where_this_process_is",
]

#: Environment variable naming the job folder (created by the launcher) to the ranks it starts.
JOB_DIR_ENV = "FABRIC_JOB_DIR"
#: The signal on which a rank writes the stacks of all its threads to its stack file. A real-time
#: signal where there are some: SIGUSR1/SIGUSR2 are what clusters send before preemption (SLURM's
#: ``--signal``), and a user's requeue handler must never fire because we asked for a stack.
DUMP_SIGNAL = int(signal.SIGRTMIN) + 7 if hasattr(signal, "SIGRTMIN") else int(signal.SIGUSR1)
#: How long the supervisor waits for the ranks' stack dumps (they normally take milliseconds).
DUMP_WAIT_S = 1.0

_JOB_DIR_PREFIX = "fabric-job-"
_HEADER = "# fabric stack dump: rank {rank} pid {pid} main-thread {ident:#x}\n"
_HEADER_RE = re.compile(r"# fabric stack dump: rank (-?\d+) pid (\d+) main-thread (0x[0-9a-f]+)")
_THREAD_RE = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME_RE = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
_TRACEBACK_FRAME_RE = re.compile(r'File "(.*)", line (\d+), in (.*)$')
# Frames in these parts of torch (or Horovod) mean "waiting for the other ranks": the collectives
# themselves, DDP's forward-time syncs, and backward, which DDP turns into gradient all-reduces.
_COLLECTIVE_PARTS = ("torch/distributed/", "torch/nn/parallel/distributed.py", "torch/autograd/", "horovod/")
_TIMEOUT_RE = re.compile(r"timed? ?out|timeout|deadline exceeded", re.IGNORECASE)
_DISTRIBUTED_RE = re.compile(r"torch[/\\]distributed|DistBackendError|DistError|gloo|nccl|c10d|horovod", re.IGNORECASE)

_dump_file: IO[str] | None = None  # kept open for the life of the process: faulthandler writes to its fd


# --------------------------------------------------------------------------------------
# The job folder
# --------------------------------------------------------------------------------------


def create_job_dir() -> str:
    """A fresh private folder for this job's stack dumps and failure records.

    Its name carries the launcher's pid, so folders left by launchers that were killed outright
    (no chance to clean up) are recognised and removed here.
    """
    _remove_stale_job_dirs()
    return tempfile.mkdtemp(prefix=f"{_JOB_DIR_PREFIX}{os.getpid()}-")


def _remove_stale_job_dirs() -> None:
    root = tempfile.gettempdir()
    try:
        names = [name for name in os.listdir(root) if name.startswith(_JOB_DIR_PREFIX)]
    except OSError:
        return
    for name in names:
        owner = name[len(_JOB_DIR_PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and not process_alive(int(owner)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def remove_job_dir(path: str | None) -> None:
    if path:
        shutil.rmtree(path, ignore_errors=True)


def _stack_file(job_dir: str, rank: int) -> str:
    return os.path.join(job_dir, f"stack-rank{rank}.txt")


def _failure_file(job_dir: str, rank: int) -> str:
    return os.path.join(job_dir, f"failure-rank{rank}.txt")


# --------------------------------------------------------------------------------------
# Rank side
# --------------------------------------------------------------------------------------


def install_stack_dump(job_dir: str | None, rank: int) -> bool:
    """Make this rank write its threads' stacks to its stack file on :data:`DUMP_SIGNAL`.

    The header line (which names the main thread) is written only after the handler is in place:
    the supervisor signals a rank only once it sees the header, because the default action of the
    signal would end the process. Returns whether the handler was installed.
    """
    global _dump_file
    if not job_dir or not os.path.isdir(job_dir) or threading.current_thread() is not threading.main_thread():
        return False
    try:
        previous = signal.getsignal(DUMP_SIGNAL)
        # append mode: every dump lands at the end, whatever the supervisor has read so far
        # open for the rest of the process (faulthandler writes to it on the signal); closed on re-registration
        dump_file = open(_stack_file(job_dir, rank), "a", encoding="utf-8")  # noqa: SIM115
        # chain to a handler the user installed, never to the default action (which would kill us)
        chain = callable(previous)
        faulthandler.register(DUMP_SIGNAL, file=dump_file, all_threads=True, chain=chain)
        main = threading.main_thread().ident or 0
        dump_file.write(_HEADER.format(rank=rank, pid=os.getpid(), ident=main))
        dump_file.flush()
    except (OSError, ValueError, RuntimeError):
        return False
    if _dump_file is not None and _dump_file is not dump_file:
        try:
            _dump_file.close()
        except OSError:
            pass
    _dump_file = dump_file
    return True


def record_failure(job_dir: str | None, rank: int, text: str) -> None:
    """Leave this rank's traceback where the supervisor can read it (the first record wins)."""
    if not job_dir or not os.path.isdir(job_dir):
        return
    path = _failure_file(job_dir, rank)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return  # already recorded (or the folder is gone): keep the first, most direct record
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(text)


def read_failures(job_dir: str | None) -> dict[int, str]:
    """rank -> traceback text of every rank that recorded a failure."""
    failures: dict[int, str] = {}
    if not job_dir:
        return failures
    try:
        names = os.listdir(job_dir)
    except OSError:
        return failures
    for name in names:
        match = re.fullmatch(r"failure-rank(-?\d+)\.txt", name)
        if match is None:
            continue
        try:
            with open(os.path.join(job_dir, name), encoding="utf-8", errors="replace") as file:
                failures[int(match.group(1))] = file.read()
        except OSError:
            pass
    return failures


# --------------------------------------------------------------------------------------
# Supervisor side
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Frame:
    filename: str
    lineno: int
    function: str


@dataclass
class _RankReport:
    rank: int
    state: str  # "raised", "waited", "absent", "silent"
    frames: list[Frame] = field(default_factory=list)  # outermost first
    pid: int | None = None


def reads_like_a_lost_peer(text: str) -> bool:
    """Whether a traceback reads like a collective or the process group failing (a peer gone), not the code's own error."""
    return bool(_DISTRIBUTED_RE.search(text))


_CLOSED_RE = re.compile(r"connection (?:reset|closed) by peer|broken pipe|connection reset|peer closed", re.IGNORECASE)


def reads_like_a_closed_connection(text: str) -> bool:
    """Whether a traceback reads like a peer's end seen from here: its connection closed or reset (not a timeout)."""
    return bool(_CLOSED_RE.search(text)) and not _TIMEOUT_RE.search(text)


def looks_like_collective_timeout(text: str) -> bool:
    """Whether a traceback reads like a collective (or the rendezvous) giving up on absent ranks."""
    return bool(_TIMEOUT_RE.search(text)) and bool(_DISTRIBUTED_RE.search(text))


def diagnose(
    job_dir: str | None,
    live: Mapping[int, int],
    raised: Mapping[int, str],
    own_rank: int | None = None,
    wait: float = DUMP_WAIT_S,
) -> str | None:
    """The report on a collective that timed out, or None if the failure was something else.

    Args:
        job_dir: the folder the ranks write their stacks and failures to.
        live: rank -> pid of every rank still running (``own_rank`` included when it is one).
        raised: rank -> traceback text of the ranks known to have raised.
        own_rank: the rank of the calling process, if it is one (its stack is read directly).
        wait: how long to wait for the stack dumps.
    """
    failures = {**read_failures(job_dir), **raised}
    if not any(looks_like_collective_timeout(text) for text in failures.values()):
        return None
    reports = [_RankReport(rank, "raised", _traceback_frames(text)) for rank, text in sorted(failures.items())]
    asked = {rank: pid for rank, pid in live.items() if rank not in failures and rank != own_rank}
    stacks = _collect_stacks(job_dir, asked, wait)
    for rank in sorted(set(live) - set(failures)):
        frames = _own_main_frames() if rank == own_rank else stacks.get(rank)
        if frames is None:
            reports.append(_RankReport(rank, "silent", pid=live[rank]))
        else:
            reports.append(_RankReport(rank, "waited" if _in_collective(frames) else "absent", frames, live[rank]))
    return _format(sorted(reports, key=lambda r: r.rank))


def _format(reports: list[_RankReport]) -> str:
    lines = []
    absent = [r for r in reports if r.state == "absent"]
    for report in absent:
        lines.append(
            f"fabric: rank {report.rank} did not arrive at the collective; it was at {_where(report.frames)}"
        )
    for report in reports:
        if report.state == "raised":
            lines.append(f"fabric: rank {report.rank} waited in the collective and timed out at {_where(report.frames)}")
        elif report.state == "waited":
            lines.append(f"fabric: rank {report.rank} was waiting in a collective at {_where(report.frames)}")
        elif report.state == "silent":
            lines.append(f"fabric: rank {report.rank} (pid {report.pid}) did not answer the request for its stack")
    if not absent and not any(r.state == "silent" for r in reports):
        lines.append(
            "fabric: every live rank was inside a collective: they may be waiting in different collectives"
            " (compare where each one was), or a rank on another machine did not arrive"
        )
    return "\n".join(lines)


def _where(frames: list[Frame]) -> str:
    """``file:line in function (source)`` of the innermost frame of the user's own code."""
    if not frames:
        return "an unknown place"
    frame = _user_frame(frames)
    source = _without_comment(linecache.getline(frame.filename, frame.lineno).strip())
    text = f"{_short_path(frame.filename)}:{frame.lineno} in {frame.function}"
    return f"{text} ({source})" if source else text


def _without_comment(source: str) -> str:
    """``x = f()  # note`` -> ``x = f()`` (the code is what tells where the rank was)."""
    if "#" not in source:
        return source
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return source
    for token in tokens:
        if token.type == tokenize.COMMENT:
            return source[: token.start[1]].rstrip()
    return source


def _short_path(filename: str) -> str:
    try:
        relative = os.path.relpath(filename)
    except ValueError:
        return filename
    return relative if not relative.startswith("..") and len(relative) < len(filename) else filename


def _user_frame(frames: list[Frame]) -> Frame:
    for frame in reversed(frames):  # innermost first
        if not is_library(frame.filename):
            return frame
    return frames[-1]


def _in_collective(frames: list[Frame]) -> bool:
    return any(part in frame.filename.replace("\\", "/") for frame in frames for part in _COLLECTIVE_PARTS)


def _traceback_frames(text: str) -> list[Frame]:
    """The frames of the last traceback in ``text`` (outermost first)."""
    frames: list[Frame] = []
    for line in text.splitlines():
        if "Traceback (most recent call last)" in line:
            frames = []  # a chained exception: the last traceback is the one that ended the rank
        match = _TRACEBACK_FRAME_RE.search(line)
        if match:
            frames.append(Frame(match.group(1), int(match.group(2)), match.group(3).strip()))
    return frames


def _own_main_frames() -> list[Frame]:
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return []
    return [Frame(f.filename, f.lineno or 0, f.name) for f in traceback.extract_stack(frame)]


def _collect_stacks(job_dir: str | None, ranks: Mapping[int, int], wait: float) -> dict[int, list[Frame]]:
    """Signal each rank that registered a stack dump and parse its main thread's stack."""
    if not job_dir or not ranks:
        return {}
    pending: dict[int, tuple[str, int, int]] = {}  # rank -> (path, offset before the request, main ident)
    for rank, pid in ranks.items():
        path = _stack_file(job_dir, rank)
        try:
            with open(path, encoding="utf-8", errors="replace") as file:
                content = file.read()
        except OSError:
            continue
        header = None
        for match in _HEADER_RE.finditer(content):
            if int(match.group(2)) == pid:
                header = match
        if header is None:
            continue  # the rank has not registered its handler (yet): the signal would kill it
        offset = len(content.encode("utf-8"))
        try:
            os.kill(pid, DUMP_SIGNAL)
        except (ProcessLookupError, PermissionError):
            continue
        pending[rank] = (path, offset, int(header.group(3), 16))
    stacks: dict[int, list[Frame]] = {}
    deadline = time.monotonic() + wait
    sizes: dict[int, int] = {}
    while pending and time.monotonic() < deadline:
        time.sleep(0.02)
        for rank, (path, offset, ident) in list(pending.items()):
            try:
                size = os.path.getsize(path)
            except OSError:
                del pending[rank]
                continue
            if size <= offset or sizes.get(rank) != size:
                sizes[rank] = size  # not written yet, or still growing: look again
                continue
            with open(path, "rb") as file:
                file.seek(offset)
                dump = file.read().decode("utf-8", errors="replace")
            frames = _main_thread_frames(dump, ident)
            if frames is not None:
                stacks[rank] = frames
            del pending[rank]
    return stacks


def _main_thread_frames(dump: str, ident: int) -> list[Frame] | None:
    """The main thread's frames (outermost first) in a faulthandler dump of all threads."""
    threads: dict[int, list[Frame]] = {}
    current: list[Frame] | None = None
    for line in dump.splitlines():
        header = _THREAD_RE.match(line)
        if header:
            current = threads.setdefault(int(header.group(1), 16), [])
            continue
        match = _FRAME_RE.match(line)
        if match and current is not None:
            current.append(Frame(match.group(1), int(match.group(2)), match.group(3).strip()))
    frames = threads.get(ident)
    if frames is None and len(threads) == 1:
        frames = next(iter(threads.values()))
    return list(reversed(frames)) if frames is not None else None  # faulthandler lists innermost first


def where_rank_is(job_dir: str | None, rank: int, pid: int, wait: float = DUMP_WAIT_S) -> str | None:
    """Where a running rank's main thread is (``file:line in function (source)``), or None if it did not answer."""
    frames = _collect_stacks(job_dir, {rank: pid}, wait).get(rank)
    return _where(frames) if frames else None


def where_this_process_is() -> str | None:
    """Where this process's main thread is, read directly (for a watcher thread of the process itself)."""
    frames = _own_main_frames()
    return _where(frames) if frames else None
