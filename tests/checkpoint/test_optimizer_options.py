"""An optimizer's group options come back as saved, with their types, after every kind of load.

One real 2-rank job (``support/scripts/checkpoint/optimizer_options_job.py``, gloo on the CPU) saves
``AdamW(betas=(0.8, 0.95))`` with DDP, FSDP and ModelParallelStrategy in each strategy's checkpoint formats,
then loads into fresh AdamWs with default options, through ``fabric.load`` and through ``fabric.load_raw`` of
a plain ``torch.save(optimizer.state_dict())``. torch's full-state ``set_optimizer_state_dict`` turns tuples
into lists; every load must leave ``betas`` a tuple and every other option as saved, on every rank.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from support.environment import job_environment
from support.loading import script_path
from support.processes import read_ranks, run

SCRIPT = script_path("checkpoint", "optimizer_options_job.py")
CASES = ("ddp", "fsdp", "fsdp_full", "model_parallel", "model_parallel_full")

pytestmark = pytest.mark.procs


def _run_job(outdir: Path) -> dict[int, dict[str, Any]]:
    env = job_environment()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={env['MASTER_PORT']}",
        str(SCRIPT), str(outdir),
    ]  # fmt: skip
    run(command, timeout=240, env=env, cwd=outdir)
    return read_ranks(outdir)


@pytest.mark.timeout(300)
def test_every_load_keeps_the_saved_optimizer_options_and_their_types(tmp_path):
    ranks = _run_job(tmp_path)
    assert sorted(ranks) == [0, 1]
    formats = {name: ranks[0][name]["format"] for name in CASES}
    # each strategy's default format, and the other one where the strategy offers it
    assert formats == {"ddp": "file", "fsdp": "folder", "fsdp_full": "file", "model_parallel": "folder", "model_parallel_full": "file"}
    problems = []
    for rank, results in sorted(ranks.items()):
        assert sorted(results) == sorted(CASES)
        for name in CASES:
            for how in ("load", "load_raw"):
                found = results[name][how]
                if found["betas"] != "(0.8, 0.95)" or found["betas_type"] != "tuple":
                    problems.append(f"rank {rank}, {name}, {how}: betas {found['betas']} ({found['betas_type']})")
                if found["loaded"] != found["saved"]:
                    problems.append(f"rank {rank}, {name}, {how}: group options {_differences(found['loaded'], found['saved'])}")
    assert not problems, "\n".join(problems)


def _differences(loaded: list[dict[str, str]], saved: list[dict[str, str]]) -> str:
    """The options (of each group) whose loaded value differs from the saved one: "name loaded != saved"."""
    if len(loaded) != len(saved):
        return f"{len(loaded)} groups, {len(saved)} saved"
    return "; ".join(
        f"group {index}: {option} {group.get(option)} != {saved_group.get(option)}"
        for index, (group, saved_group) in enumerate(zip(loaded, saved))
        for option in sorted(group.keys() | saved_group.keys())
        if group.get(option) != saved_group.get(option)
    )
