"""The pipeline example runs as a user runs it: pp=2 x dp=2 on 4 processes (the popen launcher), then the same
training in one process; their losses are equal to float32 rounding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support import PYTHON, REPO
from support.environment import clean_env
from support.processes import run

EXAMPLE = REPO / "examples" / "pipeline" / "train_gpt.py"
SHORT = ["--steps", "6"]


@pytest.mark.procs
@pytest.mark.timeout(180)
def test_a_pipeline_of_two_stages_times_two_data_parallel_ranks_trains_as_one_process_does(tmp_path: Path) -> None:
    env = clean_env(OMP_NUM_THREADS="1")
    pipeline = run([PYTHON, str(EXAMPLE), *SHORT, "--json", str(tmp_path / "pipeline.json")], timeout=120, env=env, cwd=tmp_path)
    assert "4 process(es), pp=2 x dp=2, 1F1B, 4 microbatch(es) of 4 per rank" in pipeline.stdout, pipeline.stdout
    one = run([PYTHON, str(EXAMPLE), *SHORT, "--pipeline-parallel-size", "1", "--data-parallel-size", "1", "--json",
               str(tmp_path / "one.json")], timeout=120, env=env, cwd=tmp_path)  # fmt: skip
    assert "1 process(es), pp=1 x dp=1, 1F1B, 8 microbatch(es) of 4 per rank" in one.stdout, one.stdout

    got, want = (json.loads((tmp_path / name).read_text()) for name in ("pipeline.json", "one.json"))
    assert (got["world_size"], want["world_size"]) == (4, 1)
    assert len(got["losses"]) == len(want["losses"]) == 6
    for step, (a, b) in enumerate(zip(got["losses"], want["losses"])):
        assert abs(a - b) <= 1e-5 * abs(b), (step, got["losses"], want["losses"])
    assert abs(got["val_loss"] - want["val_loss"]) <= 1e-5 * abs(want["val_loss"]), (got["val_loss"], want["val_loss"])
    assert got["losses"][-1] < got["losses"][0] - 0.1, got["losses"]  # it trains
