"""Shared fixtures of the test suite (kept small: most tests build what they need themselves)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import fabric  # noqa: E402

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
    env = {name: value for name, value in os.environ.items() if not name.startswith("FABRIC_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")  # two cores are shared with other test runs
    return env
