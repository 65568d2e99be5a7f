"""`fabric run` and the supervision stay torch-free: each import runs in a fresh interpreter.

``fabric run`` starts its ranks before torch is imported anywhere (start-up time), and it uses
``fabric.supervision`` directly, so every module of that package imports only the standard library and
``fabric._core`` at module level: never torch, nor a part of fabric that does (strategies, plugins, the
facade). ``node_rendezvous`` needs torch for several nodes that restart together, and imports it inside
its functions only: importing the module must not import it. Each module is imported alone, so one
that is only ever imported after another cannot hide behind it.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import pytest

from support import REPO
from support.environment import clean_env

pytestmark = pytest.mark.cold

SUPERVISION = REPO / "fabric" / "supervision"
# found on disk, not by importing the package: a new module is checked without being listed here
SUPERVISION_MODULES = sorted(f"fabric.supervision.{info.name}" for info in pkgutil.iter_modules([str(SUPERVISION)]))
# what must never come along with them (prefixes of module names)
HEAVY = ("torch", "numpy", "lightning_utilities")
UPPER_LAYERS = ("fabric.strategies", "fabric.plugins", "fabric.fabric", "fabric.connector", "fabric.wrappers")

_REPORT = """
import json, sys
import {module}
print(json.dumps([sys.modules["fabric"].__file__, sorted(sys.modules)]))
"""


def _modules_after_importing(module: str) -> list[str]:
    """Every module in ``sys.modules`` of a fresh interpreter after ``import module``."""
    result = subprocess.run(
        [sys.executable, "-c", _REPORT.format(module=module)],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    fabric_file, modules = json.loads(result.stdout.strip().splitlines()[-1])
    assert fabric_file == str(REPO / "fabric" / "__init__.py")  # this checkout's fabric, not an installed one
    return modules


def _under(modules: list[str], prefixes: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes))


def test_every_supervision_module_is_checked() -> None:
    assert {
        "fabric.supervision.command_rank",
        "fabric.supervision.diagnosis",
        "fabric.supervision.node_rendezvous",
        "fabric.supervision.rank_side",
        "fabric.supervision.rank_zero",
        "fabric.supervision.signals",
        "fabric.supervision.supervisor",
    } <= set(SUPERVISION_MODULES)


@pytest.mark.procs
@pytest.mark.timeout(90)
@pytest.mark.parametrize("module", ["fabric.cli", "fabric.supervision", *SUPERVISION_MODULES])
def test_importing_imports_no_torch(module: str) -> None:
    modules = _modules_after_importing(module)
    assert module in modules  # the report is of a real import
    assert "torch" not in modules, f"importing {module} imported torch"
    heavy = _under(modules, HEAVY)
    assert not heavy, f"importing {module} imported {heavy}"


@pytest.mark.procs
@pytest.mark.timeout(90)
@pytest.mark.parametrize("module", ["fabric.supervision", *SUPERVISION_MODULES])
def test_supervision_imports_no_upper_layer(module: str) -> None:
    upper = _under(_modules_after_importing(module), UPPER_LAYERS)
    assert not upper, f"importing {module} imported {upper}: supervision sits below the strategies"
