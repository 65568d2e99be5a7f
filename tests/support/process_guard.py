"""The ``procs`` mark made true: a test that starts a process without it fails.

Every way this process can start another one ends in one of three calls: ``_posixsubprocess.fork_exec``
(``subprocess``, which keeps its own reference, and ``multiprocessing``'s spawn and forkserver start-up),
``os.fork`` (the fork start method) or ``os.posix_spawn[p]``. The guard wraps them once per test process and notes
each start made while a test without ``@pytest.mark.procs`` runs (its set-up, call or tear-down); that
test then fails, naming what it started. The process still starts, so the test's own clean-up runs as
usual. ``TEST_PROCS_RECORD=<folder>`` writes the node ids of tests that start processes, marked or not,
to ``<folder>/<pid>.txt`` instead of failing them; with ``TEST_PROCS_REFUSE=1`` as well, every start raises
instead, so a whole run finds them in minutes: that is how the marks were first placed.
"""

from __future__ import annotations

import _posixsubprocess  # type: ignore[import-not-found]
import functools
import os
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest

RECORD_VARIABLE = "TEST_PROCS_RECORD"
REFUSE_VARIABLE = "TEST_PROCS_REFUSE"


class ProcessStartRefused(RuntimeError):
    """``TEST_PROCS_REFUSE=1``: a test started a process while the guard was finding which tests do."""


class _Guard:
    def __init__(self) -> None:
        self.item: pytest.Item | None = None
        self.started: list[str] = []

    def note(self, what: str) -> None:
        if self.item is not None:
            self.started.append(what)


_GUARD = _Guard()


def _watched(name: str, function: Callable[..., Any], describe: Callable[..., str]) -> Callable[..., Any]:
    @functools.wraps(function)
    def start(*args: Any, **kwargs: Any) -> Any:
        _GUARD.note(f"{name}({describe(*args, **kwargs)})")
        if _GUARD.item is not None and os.environ.get(REFUSE_VARIABLE) == "1":
            raise ProcessStartRefused(_GUARD.started[-1])
        return function(*args, **kwargs)

    return start


def _command(args: Any, *rest: Any, **kwargs: Any) -> str:
    return " ".join(os.fsdecode(a) for a in args) if isinstance(args, (list, tuple)) else repr(args)


def _spawned(path: Any, argv: Any, *rest: Any, **kwargs: Any) -> str:
    return _command(argv)


def install() -> None:
    """Wrap the three process-starting calls (once)."""
    if getattr(_posixsubprocess.fork_exec, "_procs_guarded", False):
        return
    for owner, name, describe in (
        (_posixsubprocess, "fork_exec", _command),
        (subprocess, "_fork_exec", _command),
        (os, "fork", lambda *a, **k: ""),
        (os, "posix_spawn", _spawned),
        (os, "posix_spawnp", _spawned),
    ):
        wrapped = _watched(name, getattr(owner, name), describe)
        wrapped._procs_guarded = True  # type: ignore[attr-defined]
        setattr(owner, name, wrapped)


def pytest_configure(config: pytest.Config) -> None:
    install()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _GUARD.item, _GUARD.started = item, []
    try:
        yield
    finally:
        started, _GUARD.item = _GUARD.started, None
        folder = os.environ.get(RECORD_VARIABLE)
        if folder and started:
            with open(os.path.join(folder, f"{os.getpid()}.txt"), "a") as file:
                file.write(f"{item.nodeid}\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    if call.when != "teardown" or item.get_closest_marker("procs") or os.environ.get(RECORD_VARIABLE):
        return
    if _GUARD.started:
        report = outcome.get_result()
        report.outcome = "failed"
        starts = "; ".join(_GUARD.started[:3]) + (f" and {len(_GUARD.started) - 3} more" if len(_GUARD.started) > 3 else "")
        report.longrepr = (
            f"{item.nodeid} started a process but has no @pytest.mark.procs: {starts}. Mark it (the fast tier,"
            " `pytest -m 'not procs'`, must start none)"
        )
