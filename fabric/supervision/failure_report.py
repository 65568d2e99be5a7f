"""How a failed job is told: once, the cause first, then the user's own frames and a few of the library's.

A supervised rank that raises prints nothing itself: it records its whole traceback in the job folder (what
the diagnosis of a collective timeout reads) and a brief one (:func:`brief_traceback`): the exception, the
frames of the user's own code, and of the library's only the call the user made and the line that raised.
The supervisor prints one report (:func:`failure_report`), in which the ranks whose brief tracebacks are the
same are one failure, named together ("rank 0, 1 raised ..."), so a failure every rank meets (a checkpoint
that does not fit) is told once and no run blames another rank than the last.

``FABRIC_FULL_TRACEBACKS=1`` brings back every rank's whole traceback, each rank printing its own as it
raises (every line labelled ``[rank N]``); the supervisor then names the cause in one line.

Only the standard library is used, so importing this module is cheap.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sysconfig
import traceback
from collections.abc import Collection, Mapping, Sequence
from functools import lru_cache

__all__ = [
    "FULL_TRACEBACKS_ENV",
    "brief_traceback",
    "failure_report",
    "full_tracebacks",
    "is_library",
    "read_briefs",
    "record_brief",
]

#: Set to 1 for every rank's whole traceback instead of the one brief report.
FULL_TRACEBACKS_ENV = "FABRIC_FULL_TRACEBACKS"
#: The user's own frames a brief traceback keeps (the innermost ones).
USER_FRAMES = 4
#: How a brief report tells where the whole tracebacks are.
FULL_HINT = f"({FULL_TRACEBACKS_ENV}=1 prints every rank's full traceback)"


def full_tracebacks() -> bool:
    """Whether the user asked for every rank's whole traceback (``FABRIC_FULL_TRACEBACKS=1``)."""
    return os.environ.get(FULL_TRACEBACKS_ENV, "").strip().lower() in ("1", "true", "yes", "on")


# --------------------------------------------------------------------------------------
# Whose code is a frame in
# --------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _package_roots() -> dict[str, str]:
    """Where this package and the libraries it drives live, by name (each a folder path ending in a separator)."""
    roots = {"fabric": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}  # this file: fabric/supervision/
    for name in ("torch", "horovod", "lightning_utilities"):
        try:
            spec = importlib.util.find_spec(name)  # finds, does not import
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.submodule_search_locations:
            roots[name] = next(iter(spec.submodule_search_locations))
    return {name: os.path.join(os.path.abspath(root), "") for name, root in roots.items()}


@lru_cache(maxsize=1)
def library_roots() -> tuple[str, ...]:
    """Folders whose files are not the user's: this package, torch (and friends), installed packages, Python's own."""
    paths = sysconfig.get_paths()
    python = [os.path.join(os.path.abspath(path), "") for key in ("stdlib", "platstdlib", "purelib", "platlib") if (path := paths.get(key))]
    return (*_package_roots().values(), *python)


def is_library(filename: str) -> bool:
    """Whether a frame in ``filename`` is the library's (fabric, torch, an installed package, Python) and not the user's."""
    if filename.startswith("<"):
        return True  # <frozen ...>, <string>: nothing a user can open
    path = os.path.abspath(filename)
    return path.startswith(library_roots()) or f"{os.sep}site-packages{os.sep}" in path or f"{os.sep}dist-packages{os.sep}" in path


def _package_of(filename: str) -> str:
    """A name for the library a frame is in: ``fabric``, ``torch``, another installed package, or ``python``."""
    path = os.path.abspath(filename)
    for name, root in _package_roots().items():
        if path.startswith(root):
            return name
    found = re.search(r"[/\\](?:site|dist)-packages[/\\]([^/\\]+)", path)
    return found.group(1).removesuffix(".py") if found else "python"


# --------------------------------------------------------------------------------------
# Rank side: the brief traceback
# --------------------------------------------------------------------------------------


def brief_traceback(exc: BaseException) -> str:
    """The exception, then the frames of the user's own code (the innermost :data:`USER_FRAMES`), and of the
    library's after them only the first (the call the user made) and the last (where it raised); each run of
    frames left out between them is one ``... N frames inside fabric, torch`` line (those before the first frame
    shown, the launcher's, are left out silently). Frame lines read as Python's.
    """
    lines = [line.rstrip("\n") for part in traceback.format_exception_only(type(exc), exc) for line in part.splitlines()]
    frames = traceback.extract_tb(exc.__traceback__)
    user = [index for index, frame in enumerate(frames) if not is_library(frame.filename)]
    if user:
        keep = set(user[-USER_FRAMES:])
        if user[-1] + 1 < len(frames):
            keep |= {user[-1] + 1, len(frames) - 1}
    else:
        keep = set(range(max(len(frames) - 2, 0), len(frames)))
    hidden: list[str] = []
    for index, frame in enumerate(frames[min(keep, default=len(frames)):], start=min(keep, default=len(frames))):
        if index not in keep:
            hidden.append(_package_of(frame.filename))
            continue
        lines.extend(_hidden(hidden))
        hidden = []
        lines.append(f'  File "{frame.filename}", line {frame.lineno}, in {frame.name}')
        if frame.line:
            lines.append(f"    {frame.line.strip()}")
    lines.extend(_hidden(hidden))
    lines.extend(_chain(exc))
    return "\n".join(lines)


def _hidden(packages: list[str]) -> list[str]:
    if not packages:
        return []
    names = ", ".join(dict.fromkeys(packages))
    return [f"  ... {len(packages)} frame{'s' if len(packages) > 1 else ''} inside {names}"]


def _chain(exc: BaseException, depth: int = 3) -> list[str]:
    """One line per exception that led to ``exc`` (its cause, or the one it was raised while handling)."""
    lines: list[str] = []
    seen = {id(exc)}
    while depth > 0:
        if exc.__cause__ is not None:
            exc, how = exc.__cause__, "caused by"
        elif exc.__context__ is not None and not exc.__suppress_context__:
            exc, how = exc.__context__, "raised while handling"
        else:
            break
        if id(exc) in seen:
            break
        seen.add(id(exc))
        depth -= 1
        first = traceback.format_exception_only(type(exc), exc)[0].splitlines()[0].strip()
        lines.append(f"  ({how} {first})")
    return lines


def _brief_file(job_dir: str, rank: int) -> str:
    return os.path.join(job_dir, f"brief-rank{rank}.txt")


def record_brief(job_dir: str | None, rank: int, text: str) -> bool:
    """Leave this rank's brief traceback for its supervisor (the first record wins); False where none could be left."""
    if not job_dir or not os.path.isdir(job_dir):
        return False
    try:
        fd = os.open(_brief_file(job_dir, rank), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return True
    except OSError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(text)
    return True


def read_briefs(job_dir: str | None) -> dict[int, str]:
    """rank -> brief traceback of every rank that recorded one."""
    briefs: dict[int, str] = {}
    try:
        names = os.listdir(job_dir) if job_dir else []
    except OSError:
        return briefs
    for name in names:
        match = re.fullmatch(r"brief-rank(-?\d+)\.txt", name)
        if match is None:
            continue
        try:
            with open(os.path.join(job_dir, name), encoding="utf-8", errors="replace") as file:  # type: ignore[arg-type]
                briefs[int(match.group(1))] = file.read()
        except OSError:
            pass
    return briefs


# --------------------------------------------------------------------------------------
# Supervisor side: one report
# --------------------------------------------------------------------------------------


def ranks_text(ranks: Sequence[int]) -> str:
    """``rank 1`` or ``rank 0, 1``."""
    return "rank " + ", ".join(map(str, ranks))


def _exception_name(brief: str) -> str:
    """``CheckpointMismatchError`` of a brief whose first line is ``fabric.checkpoint.errors.CheckpointMismatchError: ...``."""
    head = brief.split("\n", 1)[0]
    name = head.split(":", 1)[0].strip() if ":" in head else head.strip()
    return name.rsplit(".", 1)[-1] or "an exception"


def failure_report(
    rank: int,
    raised: bool,
    described: str,
    briefs: Mapping[int, str],
    pids: Mapping[int, int | None] | None,
    running: Collection[int],
    full_traceback: str | None = None,
) -> str:
    """The one report of a failed job: a headline naming the cause, then the brief traceback of the failure
    (or, with ``FABRIC_FULL_TRACEBACKS=1``, the whole one where the ranks did not print their own).

    Args:
        rank: the rank at the root of the failure.
        raised: whether it raised (else it died: a signal, a status); only an exception has a traceback.
        described: how it ended in words, e.g. ``rank 1 was killed by SIGKILL`` (see ``describe_exit``).
        briefs: rank -> brief traceback of every rank that recorded one; the ranks whose brief is the cause's
            are named with it.
        pids: rank -> pid of the ranks whose pid is known, named in the headline (None: no pids, as in an
            exception's message).
        running: the ranks still running, of which those not named are "the other N rank(s)" being stopped.
        full_traceback: the cause's whole traceback where the report carries it (a multiprocessing worker sends
            it rather than printing it); None where the rank printed its own (with full tracebacks asked for).
    """
    brief = briefs.get(rank) if raised else None
    full = full_tracebacks()
    above = " (traceback above)" if raised and full and full_traceback is None else ""
    if brief is not None:
        ranks = sorted(r for r, text in briefs.items() if text == brief)
        headline = f"{ranks_text(ranks)} raised {_exception_name(brief)}{above}"
    else:
        ranks, headline = [rank], described + above
    known = [str(pid) for r in ranks if (pid := (pids or {}).get(r)) is not None]
    if known:
        headline += ", pid " + ", ".join(known)
    others = len(set(running) - set(ranks))
    if others:
        headline += f"; stopping the other {others} rank(s) on this node"
    body = ""
    if raised and (full or brief is None):
        body = (full_traceback or "").rstrip()
    elif brief is not None:
        body = f"{brief}\n{FULL_HINT}"
    return f"{headline}\n{body}" if body else headline
