"""FSDPStrategy and ModelParallelStrategy: unit tests, then real torchrun jobs of 2 and 4 processes (gloo, CPU).

The jobs (``support/scripts/sharding/train_job.py``) train the same tiny model sharded and in one process and
record the differences; each job runs once per session and serves several tests.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fabric import Fabric
from fabric.plugins.precision import precision_for
from fabric.strategies import STRATEGY_REGISTRY, FSDPStrategy, ModelParallelStrategy
from fabric.strategies.fsdp import _selected, mixed_precision_policy, reduces_gradients_by_summing
from fabric.strategies.sharding import clip_grad_norm_over_shards
from support.environment import isolate, job_environment
from support.loading import script_path
from support.scripts.ddp.harness import JobFailed

SCRIPTS = script_path("sharding", "train_job.py").parent
TOLERANCE = 1e-5
_jobs: dict[int, Any] = {}


@pytest.fixture
def clean_env(monkeypatch):
    isolate(monkeypatch)


# ---- without processes ------------------------------------------------------------------------------


def test_registry_names(clean_env):
    fabric = Fabric(accelerator="cpu", strategy="fsdp", devices=2)
    assert isinstance(fabric.strategy, FSDPStrategy)
    assert fabric.strategy.cpu_offload is None and fabric.strategy.sharding_strategy == "FULL_SHARD"
    assert fabric.strategy.process_group_backend == "gloo"
    assert Fabric(accelerator="cpu", strategy="fsdp_cpu_offload", devices=2).strategy.cpu_offload is True
    assert {"fsdp", "fsdp_cpu_offload"} <= set(STRATEGY_REGISTRY)


def test_fsdp_arguments_are_checked_where_they_enter():
    with pytest.raises(ValueError, match=r"sharding_strategy='FULL'.*'FULL_SHARD', 'SHARD_GRAD_OP', 'NO_SHARD', 'HYBRID_SHARD'"):
        FSDPStrategy(sharding_strategy="FULL")
    with pytest.raises(ValueError, match=r"state_dict_type='local'.*'sharded', 'full'"):
        FSDPStrategy(state_dict_type="local")
    with pytest.raises(TypeError, match=r"cpu_offload='yes'"):
        FSDPStrategy(cpu_offload="yes")
    with pytest.raises(TypeError, match=r"auto_wrap_policy=\{'Linear'\}"):
        FSDPStrategy(auto_wrap_policy={"Linear"})
    with pytest.raises(ValueError, match=r"device_mesh=\(2, 2\) is for sharding_strategy='HYBRID_SHARD'"):
        FSDPStrategy(device_mesh=(2, 2))
    with pytest.raises(ValueError, match=r"device_mesh=\(2, 0\) is not valid"):
        FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(2, 0))
    with pytest.raises(ValueError, match="not both"):
        FSDPStrategy(activation_checkpointing=nn.Linear, activation_checkpointing_policy={nn.Linear})
    from torch.distributed.fsdp import ShardingStrategy

    assert FSDPStrategy(sharding_strategy=ShardingStrategy.SHARD_GRAD_OP).sharding_strategy == "SHARD_GRAD_OP"
    assert FSDPStrategy(activation_checkpointing=[nn.Linear])._checkpointing_policy == {nn.Linear}


def test_model_parallel_arguments_are_checked():
    with pytest.raises(TypeError, match="parallelize_fn=3 must be a function"):
        ModelParallelStrategy(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"tensor_parallel_size=0 is not valid; accepted: 'auto' or an int >= 1"):
        ModelParallelStrategy(lambda m, mesh: m, tensor_parallel_size=0)
    with pytest.raises(RuntimeError, match=r"device_mesh exists only after Fabric\.launch"):
        ModelParallelStrategy(lambda m, mesh: m).device_mesh  # noqa: B018 - reading the property is what raises


def _tree() -> nn.Module:
    return nn.Sequential(nn.Sequential(nn.Linear(10, 10), nn.ReLU()), nn.Linear(10, 1000), nn.Sequential(nn.Linear(2, 2)))


def test_wrap_policies_pick_submodules_children_first():
    root = _tree()
    assert _selected(root, {nn.Linear}, include_root=False) == [root[0][0], root[1], root[2][0]]
    assert _selected(root, lambda m: isinstance(m, nn.Sequential), include_root=False) == [root[0], root[2]]
    # an FSDP1 policy as Lightning users pass it: parameters not already in a chosen child count
    from functools import partial

    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

    policy = partial(size_based_auto_wrap_policy, min_num_params=100)
    assert _selected(root, policy, include_root=False) == [root[0][0], root[1]]


def test_mixed_precision_follows_the_precision_plugin():
    assert mixed_precision_policy(precision_for("32-true", "cpu")) is None
    policy = mixed_precision_policy(precision_for("bf16-mixed", "cpu"))
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.bfloat16
    assert mixed_precision_policy(precision_for("16-mixed", "cuda")).param_dtype == torch.float16


def test_cuda_placement_logic_without_a_gpu():
    """NCCL on CUDA devices, CPU offload only off the CPU (where it would fail and change nothing)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    strategy = FSDPStrategy(cpu_offload=True, parallel_devices=[torch.device("cuda", 0), torch.device("cuda", 1)])
    assert strategy.process_group_backend == "nccl"
    strategy._device_mesh = "mesh"
    assert isinstance(strategy._fully_shard_arguments()["offload_policy"], CPUOffloadPolicy)
    assert strategy._fully_shard_arguments()["reshard_after_forward"] is True
    assert strategy._materialization_device() == torch.device("cpu")  # fully_shard wants offloaded shards there
    assert FSDPStrategy(parallel_devices=[torch.device("cuda", 0)])._materialization_device() == torch.device("cuda", 0)
    on_cpu = FSDPStrategy(cpu_offload=True, sharding_strategy="SHARD_GRAD_OP", parallel_devices=[torch.device("cpu")] * 2)
    on_cpu._device_mesh = "mesh"
    assert "offload_policy" not in on_cpu._fully_shard_arguments()
    assert on_cpu._fully_shard_arguments()["reshard_after_forward"] is False
    assert on_cpu.process_group_backend == "gloo"


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_norm_of_plain_tensors_matches_torch(norm_type):
    torch.manual_seed(0)
    ours = [nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(ours, theirs):
        a.grad = torch.randn_like(a) * 4
        b.grad = a.grad.clone()
    total = clip_grad_norm_over_shards(ours, 1.0, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type)
    assert torch.allclose(total, expected)
    assert all(torch.allclose(a.grad, b.grad) for a, b in zip(ours, theirs))


def test_clip_norm_refuses_nonfinite_gradients():
    param = nn.Parameter(torch.zeros(2))
    param.grad = torch.tensor([float("nan"), 1.0])
    with pytest.raises(RuntimeError, match="error_if_nonfinite=False"):
        clip_grad_norm_over_shards([param], 1.0)


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_model_parallel_under_the_spawn_launcher(clean_env):
    """start_method="spawn": two workers run the function; rank 0's result comes back here."""
    from support.scripts.sharding.model import parallelize
    from support.scripts.sharding.train_job import spawned_check

    strategy = ModelParallelStrategy(parallelize, start_method="spawn")
    result = Fabric(accelerator="cpu", devices=2, strategy=strategy).launch(spawned_check)
    assert result["world_size"] == 2 and result["mesh"] == (1, 2)
    assert len(result["norms"]) == 2 and all(n > 0 for n in result["norms"])


# ---- real jobs -------------------------------------------------------------------------------------------


def torchrun_job(processes: int, tmp_path_factory: Any, *extra: str) -> dict[int, dict[str, Any]]:
    """Run ``train_job.py`` under torchrun once per session; every rank's results (and ``"outdir"``)."""
    if processes not in _jobs:
        outdir = tmp_path_factory.mktemp(f"sharding_{processes}")
        try:
            _jobs[processes] = _run_torchrun(processes, outdir, extra)
        except BaseException as err:  # every test of this job reports the failure; none re-runs it
            _jobs[processes] = err
    if isinstance(_jobs[processes], BaseException):
        raise _jobs[processes]
    return _jobs[processes]


def _run_torchrun(processes: int, outdir: Path, extra: tuple[str, ...]) -> dict[Any, Any]:
    env = job_environment()
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={processes}",
        f"--master-port={env['MASTER_PORT']}", str(SCRIPTS / "train_job.py"), str(outdir), *extra,
    ]  # fmt: skip
    result = subprocess.run(command, env=env, cwd=outdir, capture_output=True, text=True, timeout=420)
    if result.returncode != 0:
        raise JobFailed(f"torchrun job failed with {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr[-6000:]}")
    results: dict[Any, Any] = {r: torch.load(outdir / f"rank{r}.pt", weights_only=True) for r in range(processes)}
    results["outdir"] = outdir
    return results


def _ranks(job: dict[Any, Any]) -> list[tuple[int, dict[str, Any]]]:
    return [(rank, results) for rank, results in job.items() if isinstance(rank, int)]


@pytest.fixture(scope="module")
def job2(tmp_path_factory):
    return torchrun_job(2, tmp_path_factory)


@pytest.fixture(scope="module")
def job4(job2, tmp_path_factory):
    """The 4-rank job also loads the checkpoints the 2-rank job wrote (resharding 2 -> 4)."""
    return torchrun_job(4, tmp_path_factory, str(job2["outdir"] / "checkpoints"))


@pytest.mark.procs
@pytest.mark.timeout(480)
@pytest.mark.parametrize("check", ["fsdp", "shard_grad_op_joint", "no_shard", "accumulate"])
def test_fsdp_training_equals_one_process_at_2(job2, check):
    """FULL_SHARD; SHARD_GRAD_OP with auto-wrap, activation checkpointing and setup(model, optimizer);
    NO_SHARD; no_backward_sync accumulation over two micro-batches vs the big batch."""
    for rank, results in _ranks(job2):
        assert results[check]["max_diff"] <= TOLERANCE, (rank, results[check])
        if "norm_diff" in results[check]:
            assert results[check]["norm_diff"] <= TOLERANCE, (rank, results[check])
            assert results[check]["clipped"] > 0  # the clipping really changed the gradients


@pytest.mark.procs
@pytest.mark.timeout(480)
def test_bf16_mixed_under_fsdp(job2):
    for _rank, results in _ranks(job2):
        measured = results["bf16_mixed"]
        assert measured["output_dtype"] == torch.float32 and measured["param_dtype"] == torch.float32
        assert measured["autocast_dtype"] == torch.bfloat16
        # bfloat16 arithmetic: close to float32, not equal; and it trains
        assert 1e-5 < measured["relative_output_diff"] < 5e-2, measured
        assert measured["losses"][-1] < measured["losses"][0], measured


@pytest.mark.procs
@pytest.mark.timeout(480)
def test_wrongly_ordered_set_up_says_how_to_order_it(job2):
    for _rank, results in _ranks(job2):
        messages = results["misuse"]
        assert "before FSDPStrategy sharded it" in messages["optimizer_before_setup_module"]
        assert "Call setup_module(model) first" in messages["optimizer_before_setup_module"]
        assert "SGD has already stepped" in messages["stepped_optimizer"]
        assert messages["after_good_setup"] == "FabricOptimizer" or messages["after_good_setup"].endswith("AdamW")


@pytest.mark.procs
@pytest.mark.timeout(480)
def test_fsdp_shards_parameters_at_2(job2):
    assert job2[0]["fsdp"]["local_numel"] * 2 == job2[0]["no_shard"]["local_numel"]


@pytest.mark.procs
@pytest.mark.timeout(480)
def test_collectives_under_fsdp(job2):
    for _rank, results in _ranks(job2):
        assert results["collectives"] == {"sum": 1.0, "gathered": [0, 1], "broadcast": {"from": 0}, "any_stop": True}


@pytest.mark.procs
@pytest.mark.timeout(480)
def test_empty_init_never_allocates_the_full_model(job2):
    for _rank, results in _ranks(job2):
        measured = results["empty_init"]
        assert measured["on_meta"] and measured["finite"] and measured["replicas_agree"]
        assert measured["local_bytes"] <= measured["full_bytes"] / 2 * 1.01
        # the process's peak memory grew by less than one full copy of the model would take
        assert measured["peak_growth"] < 0.8 * measured["full_bytes"], measured


@pytest.mark.procs
@pytest.mark.timeout(480)
@pytest.mark.parametrize("check", ["fsdp", "hybrid", "tp", "tp_accumulate"])
def test_training_equals_one_process_at_4(job4, check):
    """FSDP and HYBRID_SHARD (2 x 2) over 4 ranks; tensor parallel 2 x data parallel 2 (also accumulating)."""
    for rank, results in _ranks(job4):
        assert results[check]["max_diff"] <= TOLERANCE, (rank, results[check])
        if "norm_diff" in results[check]:
            assert results[check]["norm_diff"] <= TOLERANCE, (rank, results[check])


@pytest.mark.procs
@pytest.mark.timeout(480)
def test_tensor_parallel_mesh_and_empty_init_at_4(job4):
    for _rank, results in _ranks(job4):
        assert results["tp_mesh"] == {"shape": (2, 2), "names": ("data_parallel", "tensor_parallel")}
        measured = results["tp_empty_init"]
        assert measured["on_meta"] and measured["finite"] and measured["replicas_agree"], measured
        assert measured["local_bytes"] <= measured["full_bytes"] / 4 * 1.05
        assert measured["peak_growth"] < 0.5 * measured["full_bytes"], measured  # measured first in the job
        assert results["empty_init"]["local_bytes"] <= results["empty_init"]["full_bytes"] / 4 * 1.01


@pytest.mark.procs
@pytest.mark.timeout(480)
def test_sharded_and_full_checkpoints_resume_exactly_at_2(job2):
    """A folder of shards (one file per rank plus metadata) and a full file that torch.load reads; each
    loaded into fresh sharded objects gives the saved weights and, after 2 more steps, the same weights
    as an uninterrupted run (so the optimizer state came back too)."""
    for rank, results in _ranks(job2):
        saved = results["checkpoint"]
        assert saved["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "fabric-objects.pt"]
        assert saved["load_raw_diff"] <= TOLERANCE
        for name in ("sharded", "full.pt"):
            assert saved[name]["loaded_diff"] <= TOLERANCE and saved[name]["resumed_diff"] <= TOLERANCE, (rank, name, saved[name])
            assert saved[name]["remainder"] == {"step": 3}
    assert job2[0]["checkpoint"]["full_file_diff"] <= TOLERANCE and job2[0]["checkpoint"]["full_file_step"] == 3


@pytest.mark.procs
@pytest.mark.timeout(480)
def test_folder_of_shards_loads_into_a_plain_model_in_this_process(job2):
    from fabric.checkpoint.formats import load_sharded
    from support.scripts.sharding.model import make_net, max_difference, reference_run

    model = make_net(seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    remainder = load_sharded(job2["outdir"] / "checkpoints" / "sharded", {"model": model, "optimizer": optimizer})
    assert remainder == {"step": 3}
    after3, _ = reference_run(3, None)
    assert max_difference(dict(model.named_parameters()), after3) <= TOLERANCE
    assert len(optimizer.state) == len(list(model.parameters()))  # AdamW's moments came back too


@pytest.mark.procs
@pytest.mark.timeout(480)
@pytest.mark.parametrize("check", ["reshard_fsdp", "reshard_tp", "full_to_tp"])
def test_checkpoints_of_2_ranks_load_into_4(job4, check):
    """Shards written by 2 FSDP ranks into 4 FSDP ranks and into tensor parallel 2 x 2; the full file too."""
    for rank, results in _ranks(job4):
        assert results[check]["loaded_diff"] <= TOLERANCE and results[check]["resumed_diff"] <= TOLERANCE, (rank, results[check])


@pytest.mark.parametrize(
    ("version", "backend", "expected"),
    [
        ("2.8.0+cu128", "gloo", True),  # fully_shard asks gloo for an average, which sums
        ("2.7.1", "gloo", True),
        ("2.8.0", "nccl", False),  # NCCL averages
        ("2.9.0", "gloo", False),  # fully_shard sums and divides itself on gloo from 2.9 on
        ("2.10.0a0+git1234", "gloo", False),
        ("2.13.0+cpu", "gloo", False),
    ],
)
def test_fsdp_sums_gradients_itself_on_gloo_before_torch_2_9(version, backend, expected):
    assert reduces_gradients_by_summing(version, backend) is expected
