"""Horovod stays optional: `import fabric` never loads it, and without it strategy='horovod' says how
to get it. These run whether or not Horovod is installed (its absence is simulated in a subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from support import REPO

pytestmark = [pytest.mark.procs, pytest.mark.cold]

ROOT = REPO


def python(code: str, extra_path: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, str(ROOT), env.get("PYTHONPATH")) if p)
    for name in [name for name in env if name.startswith("FABRIC_")]:
        del env[name]
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.timeout(90)
def test_import_fabric_and_ddp_do_not_import_horovod() -> None:
    result = python(
        """
        import sys
        import fabric
        from fabric import Fabric
        assert "horovod" not in sys.modules, "import fabric loaded horovod"
        Fabric(accelerator="cpu", strategy="ddp", devices=2)
        import fabric.strategies
        assert "horovod" in fabric.strategies.STRATEGY_REGISTRY
        print(sorted(name for name in sys.modules if name.startswith("horovod")))
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def _check_install_hint(stderr: str) -> None:
    assert "ImportError" in stderr
    for fragment in ("make horovod", "scripts/build_horovod.sh", "C++17", "pip install horovod"):
        assert fragment in stderr, f"{fragment!r} missing from the error:\n{stderr}"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("blocked", ["horovod", "horovod.torch"])
def test_missing_horovod_explains_how_to_install(blocked: str) -> None:
    result = python(
        f"""
        import sys
        sys.modules[{blocked!r}] = None  # makes `import {blocked}` fail as if it were not installed
        from fabric import Fabric
        Fabric(accelerator="cpu", strategy="horovod")
        """
    )
    assert result.returncode != 0
    _check_install_hint(result.stderr)


@pytest.mark.timeout(90)
def test_horovod_without_its_torch_extension_explains_how_to_rebuild(tmp_path: Path) -> None:
    # what horovod.torch looks like when its compiled extension fails to load: the names are missing
    package = tmp_path / "horovod" / "torch"
    package.mkdir(parents=True)
    (tmp_path / "horovod" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("print('Warning! MPI libs are missing')\n")
    result = python(
        """
        from fabric import Fabric
        Fabric(accelerator="cpu", strategy="horovod")
        """,
        extra_path=str(tmp_path),
    )
    assert result.returncode != 0
    _check_install_hint(result.stderr)
    assert "did not load" in result.stderr
