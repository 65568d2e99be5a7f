"""A script written for "ddp_spawn" under an external launcher must not start a second set of ranks."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.procs, pytest.mark.cold]

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from fabric import Fabric

    def work(fabric, out):
        total = fabric.all_reduce(1, reduce_op="sum").item()
        with open(os.path.join(out, f"rank{fabric.global_rank}-pid{os.getpid()}.json"), "w") as f:
            json.dump({"world": fabric.world_size, "total": total, "launcher": type(fabric.strategy.launcher).__name__}, f)
        return total

    if __name__ == "__main__":
        fabric = Fabric(accelerator="cpu", strategy="ddp_spawn", devices=2)
        fabric.launch(work, sys.argv[1])
    """
)


@pytest.mark.timeout(120)
def test_ddp_spawn_script_under_fabric_run_runs_each_rank_once(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    script = tmp_path / "spawn_job.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    command = [sys.executable, "-m", "fabric", "run", "--accelerator", "cpu", "--devices", "2", str(script), str(out)]
    result = subprocess.run(command, env=subprocess_env, capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]
    # exactly one process per rank: nothing was spawned on top of the ranks `fabric run` started
    assert sorted(path.name.split("-")[0] for path in out.glob("rank*.json")) == ["rank0", "rank1"]
    assert all(r == {"world": 2, "total": 2, "launcher": "SubprocessScriptLauncher"} for r in reports), reports
