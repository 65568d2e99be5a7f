"""Shared fixtures of the test suite (kept small: most tests build what they need themselves)."""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parent
REPO_ROOT = TESTS.parent
# this checkout's `fabric`, and `support` (tests/support/) for every test module in any folder below; spawned
# workers inherit sys.path, job scripts get both through PYTHONPATH (support.environment.clean_env)
for _path in (str(TESTS), str(REPO_ROOT)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from support import device_guard  # noqa: E402
from support.environment import clean_env  # noqa: E402

# fixtures of a real S3-compatible server on 127.0.0.1 (moto_s3, s3_bucket): support/s3.py
pytest_plugins = ["support.s3", "support.process_guard"]

# NCCL's rule on every collective, in this process and in every Python process a test starts (see device_guard)
os.environ.setdefault(device_guard.DEVICE_VARIABLE, "cpu")
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [device_guard.SITE_FOLDER, os.environ.get("PYTHONPATH")]))
device_guard.install()

# fabric prints its INFO records itself when the root logger has no handler (as at import here); in the
# tests they go through the root logger instead, where pytest's caplog sees them
logging.getLogger("fabric").propagate = True
for _handler in list(logging.getLogger("fabric").handlers):
    logging.getLogger("fabric").removeHandler(_handler)


@pytest.fixture
def clean_fabric_env(monkeypatch: pytest.MonkeyPatch):
    """No ``FABRIC_*`` (or Lightning ``PL_*``) variable from the developer's shell gets in, and none a test sets gets out.

    (``fabric run`` passes options as ``FABRIC_ACCELERATOR`` etc.; ``seed_everything`` writes
    ``FABRIC_GLOBAL_SEED`` and ``PL_GLOBAL_SEED``.)
    """
    for name in [name for name in os.environ if name.startswith(("FABRIC_", "PL_"))]:
        monkeypatch.delenv(name)
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    """Environment for a child Python that must import this checkout's ``fabric`` from any folder."""
    return clean_env(OMP_NUM_THREADS="1")  # two cores are shared with other test runs


@pytest.fixture(scope="session")
def saved_on_two(tmp_path_factory) -> Path:
    """A real 2-process FSDP job's checkpoints (``support/scripts/dcp/job.py save``): a folder of shards,
    a full file and per-rank references. Shared, so the tests only read it (copy it to damage it)."""
    from support.dcp_jobs import run_job

    out = tmp_path_factory.mktemp("dcp")
    run_job(2, str(out), "save")
    return out


@pytest.fixture(scope="session")
def warm_ranks_env() -> dict[str, str]:
    """For a reference run inside a ``cold`` module, whose subject is what the other runs do: the variable that
    makes the processes it starts warm (nothing when ``TEST_WARM_RANKS=0`` turns warm ranks off)."""
    from support.warm_ranks import VARIABLE

    return {} if os.environ.get(VARIABLE) == "0" else {VARIABLE: _WARM.socket()}


@pytest.fixture(scope="session")
def keep_going_uninterrupted(tmp_path_factory, warm_ranks_env) -> Path:
    """``support/scripts/resilience/keep_going_job.py`` never interrupted (2 ranks under ``launch()``): what the
    restart and pre-emption tests' resumed jobs must end equal to. Shared: tests only read it."""
    from support import PYTHON
    from support.loading import script_path
    from support.processes import finish, start

    folder = tmp_path_factory.mktemp("keep_going_uninterrupted")
    job = [PYTHON, str(script_path("resilience", "keep_going_job.py")), str(folder)]
    [(code, out, err)] = finish([start(job, env=clean_env(OMP_NUM_THREADS="1", **warm_ranks_env))], 150)
    assert code == 0, f"{out}\n{err[-4000:]}"
    return folder


class _WarmParent:
    """This pytest process's warm parent (support/warm_ranks.py), started when the first test wants warm ranks."""

    def __init__(self) -> None:
        self.proc: Any = None
        self.path = ""
        self.folder = ""

    def socket(self) -> str:
        if self.proc is None or self.proc.poll() is not None:
            from support import warm_ranks

            self.folder = tempfile.mkdtemp(prefix="fabric-warm-")
            self.proc, self.path = warm_ranks.start_parent(self.folder, clean_env())
        return self.path

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            if not os.environ.get("TEST_WARM_KEEP"):  # keep the folder's warm.sock.log: which programs ran warm
                shutil.rmtree(self.folder, ignore_errors=True)


_WARM = _WarmParent()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    """The Python processes a ``procs`` test starts (its fixtures' too) run warm, unless it is marked ``cold`` (its
    subject is starting a process) or ``TEST_WARM_RANKS=0`` asks for cold ones everywhere."""
    from support.warm_ranks import VARIABLE

    if os.environ.get(VARIABLE) != "0":
        if item.get_closest_marker("procs") and not item.get_closest_marker("cold"):
            os.environ[VARIABLE] = _WARM.socket()
        else:
            os.environ.pop(VARIABLE, None)
    yield


def pytest_unconfigure(config: pytest.Config) -> None:
    _WARM.stop()
