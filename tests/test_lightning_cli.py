"""Programs on our ``fabric`` started by Lightning Fabric's own CLI (its ``fabric run``).

That CLI exports ``LT_CLI_USED=1`` and its options as ``LT_ACCELERATOR``/``LT_STRATEGY``/``LT_DEVICES``/
``LT_NUM_NODES``/``LT_PRECISION``, then starts the ranks with torchrun. The real runs here do exactly that
(torchrun from this environment, those variables), so no Lightning install is needed: ``Fabric()`` must take
the options and join the process group at construction, as Lightning's own ``Fabric()`` does there.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from support.environment import job_environment
from support.processes import run

_SCRIPT = """\
import json, sys
from pathlib import Path
import torch
import torch.distributed as dist
from fabric import Fabric

fabric = Fabric()  # options from the CLI only
# straight after construction, as under Lightning's CLI: the process group exists
value = torch.tensor([float(fabric.global_rank + 1)])
dist.all_reduce(value)
# one file per rank: the ranks share torchrun's stdout, where their lines can interleave
report = {"rank": fabric.global_rank, "world": fabric.world_size, "sum": value.item(),
          "initialized": dist.is_initialized(), "precision": fabric.strategy.precision.precision,
          "accelerator": type(fabric.accelerator).__name__}
(Path(__file__).parent / f"report-{fabric.global_rank}.json").write_text(json.dumps(report))
"""


def _lightning_cli_run(script: Path, options: dict[str, str], nprocs: int = 2):
    env = job_environment(LT_CLI_USED="1", **{f"LT_{name.upper()}": value for name, value in options.items()})
    port = env.pop("MASTER_PORT")
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nprocs}", "--nnodes=1",
               "--node-rank=0", "--master-addr=127.0.0.1", f"--master-port={port}", str(script)]
    return run(command, timeout=60, env=env, check=False)


@pytest.mark.procs
@pytest.mark.timeout(90)
def test_fabric_joins_the_group_at_construction_under_lightnings_cli(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    result = _lightning_cli_run(script, {"accelerator": "cpu", "devices": "2", "num_nodes": "1", "precision": "bf16-mixed"})
    assert result.returncode == 0, result.stdout + result.stderr
    reports = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("report-*.json"))]
    assert [report["rank"] for report in reports] == [0, 1]
    for report in reports:
        assert report["world"] == 2 and report["initialized"] and report["sum"] == 3.0
        assert report["precision"] == "bf16-mixed" and report["accelerator"] == "CPUAccelerator"


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_a_conflict_with_lightnings_cli_options_names_them(tmp_path: Path) -> None:
    script = tmp_path / "conflict.py"
    script.write_text("from fabric import Fabric\nFabric(accelerator='cpu', precision='64-true')\n")
    result = _lightning_cli_run(script, {"accelerator": "cpu", "devices": "1", "num_nodes": "1", "precision": "bf16-mixed"}, 1)
    assert result.returncode != 0
    assert "--precision=bf16-mixed given to `fabric run` (LT_PRECISION=bf16-mixed)" in result.stderr, result.stderr


def test_lightnings_variables_count_only_in_processes_its_cli_started(monkeypatch: pytest.MonkeyPatch) -> None:
    from fabric._core.env import cli_option, started_by_a_cli

    for name in ("LT_CLI_USED", "FABRIC_RUN_BY_CLI", "FABRIC_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LT_DEVICES", "2")
    assert cli_option("devices") is None and not started_by_a_cli()
    monkeypatch.setenv("LT_CLI_USED", "0")
    assert cli_option("devices") is None and not started_by_a_cli()
    monkeypatch.setenv("LT_CLI_USED", "1")
    assert cli_option("devices") == ("LT_DEVICES", "2", "fabric run") and started_by_a_cli()
    monkeypatch.setenv("FABRIC_DEVICES", "3")  # ours first
    assert cli_option("devices")[:2] == ("FABRIC_DEVICES", "3")
