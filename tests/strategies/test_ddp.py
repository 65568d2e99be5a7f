"""DDPStrategy: unit tests, then real 2-process jobs (gloo on CPU) for the popen and the spawn start methods.

The jobs run the checks of ``support/scripts/ddp/checks.py`` in both ranks and hand back what each rank saw;
one job per start method serves many tests here (starting processes is the expensive part).
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook

from fabric import Fabric
from fabric.plugins.environments import LightningEnvironment
from fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from fabric.strategies.launchers import MultiprocessingLauncher, RankFailedError, SubprocessScriptLauncher
from fabric.utilities.group_lifetime import _process_group_threads_alive
from support.environment import isolate, job_environment
from support.scripts.ddp import checks
from support.scripts.ddp.harness import SCRIPTS, popen_results

JOB_TIMEOUT = 120


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher variables from the developer's shell; a free port for a job started from this process."""
    isolate(monkeypatch)


# ---- without processes ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "start_method", "launcher_type"),
    [
        ("ddp", "popen", SubprocessScriptLauncher),
        ("ddp_spawn", "spawn", MultiprocessingLauncher),
        ("ddp_fork", "fork", MultiprocessingLauncher),
        ("ddp_notebook", "fork", MultiprocessingLauncher),
        ("ddp_forkserver", "forkserver", MultiprocessingLauncher),
    ],
)
def test_registry_names_pick_start_method_and_launcher(clean_env, name, start_method, launcher_type):
    fabric = Fabric(accelerator="cpu", strategy=name, devices=2)
    strategy = fabric.strategy
    assert isinstance(strategy, DDPStrategy)
    assert strategy._start_method == start_method
    assert isinstance(strategy.launcher, launcher_type)
    assert getattr(strategy.launcher, "requires_function", False) is (launcher_type is MultiprocessingLauncher)
    assert strategy.parallel_devices == [torch.device("cpu")] * 2
    assert isinstance(strategy.cluster_environment, LightningEnvironment)
    assert strategy.num_processes == 2 and strategy.num_nodes == 1
    assert strategy.process_group_backend == "gloo"
    assert strategy.root_device == torch.device("cpu")
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}


def test_find_unused_parameters_names_reach_ddp(clean_env):
    for name in ("ddp_find_unused_parameters_true", "ddp_spawn_find_unused_parameters_true"):
        strategy = Fabric(accelerator="cpu", strategy=name, devices=2).strategy
        assert strategy._ddp_kwargs == {"find_unused_parameters": True}
    assert STRATEGY_REGISTRY["ddp_spawn_find_unused_parameters_true"][1]["start_method"] == "spawn"


def test_bad_start_method_names_value_and_accepted():
    with pytest.raises(ValueError, match=r"start_method='thread'.*'popen', 'spawn', 'fork', 'forkserver'"):
        DDPStrategy(start_method="thread")


@pytest.mark.parametrize("period", [0, -1, 1.5, True, "2"])
def test_bad_model_averaging_period(period):
    with pytest.raises(ValueError, match="model_averaging_period"):
        DDPStrategy(model_averaging_period=period)


def test_model_averaging_defaults_and_checks_hook_and_state():
    strategy = DDPStrategy(model_averaging_period=4)
    assert strategy._ddp_comm_hook is post_localSGD_hook
    assert isinstance(strategy._ddp_comm_state, PostLocalSGDState)
    assert strategy._ddp_comm_state.start_localSGD_iter == 0
    with pytest.raises(ValueError, match="PostLocalSGDState"):
        DDPStrategy(model_averaging_period=4, ddp_comm_state=object())
    with pytest.raises(ValueError, match="post_localSGD_hook"):
        DDPStrategy(model_averaging_period=4, ddp_comm_hook=default_hooks.allreduce_hook)


def test_backend_choice_and_defaults():
    strategy = DDPStrategy(parallel_devices=[torch.device("cpu")] * 2)
    assert strategy.process_group_backend == "gloo"
    assert strategy._timeout == timedelta(seconds=1800)
    assert DDPStrategy(parallel_devices=[torch.device("cuda", 0)], process_group_backend="gloo").process_group_backend == "gloo"
    assert DDPStrategy(parallel_devices=[torch.device("cuda", 0), torch.device("cuda", 1)]).process_group_backend == "nccl"
    assert DDPStrategy(find_unused_parameters=True, static_graph=False)._ddp_kwargs == {
        "find_unused_parameters": True,
        "static_graph": False,
    }


def test_collectives_without_process_group_are_identities_but_validate():
    strategy = DDPStrategy(parallel_devices=[torch.device("cpu")], cluster_environment=LightningEnvironment())
    t = torch.tensor([1.0, 2.0])
    assert strategy.all_reduce(t, reduce_op="sum") is t
    assert strategy.reduce(5) == 5  # not a tensor: returned as it is
    assert strategy.broadcast({"a": 1}) == {"a": 1}
    strategy.barrier("nothing to wait for")
    with pytest.raises(ValueError, match=r"reduce_op='prod'.*'mean'"):
        strategy.all_reduce(t, reduce_op="prod")
    with pytest.raises(TypeError, match="reduce_op"):
        strategy.all_reduce(t, reduce_op=1.5)


def test_backward_sync_control_needs_the_ddp_module():
    control = DDPStrategy().backward_sync_control
    with control.no_backward_sync(torch.nn.Linear(1, 1), enabled=False):
        pass
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        control.no_backward_sync(torch.nn.Linear(1, 1), enabled=True)


@pytest.mark.parametrize("call", ["setup", "all_reduce", "all_gather", "broadcast", "barrier", "reduce_boolean_decision", "setup_dataloaders"])
def test_ddp_calls_before_launch_raise(clean_env, call):
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    calls = {
        "setup": lambda: fabric.setup(torch.nn.Linear(1, 1)),
        "all_reduce": lambda: fabric.all_reduce(torch.ones(1)),
        "all_gather": lambda: fabric.all_gather(torch.ones(1)),
        "broadcast": lambda: fabric.broadcast(1),
        "barrier": lambda: fabric.barrier(),
        "reduce_boolean_decision": lambda: fabric.reduce_boolean_decision(True),
        "setup_dataloaders": lambda: fabric.setup_dataloaders(torch.utils.data.DataLoader(range(4))),
    }
    with pytest.raises(RuntimeError, match=r"before Fabric.launch\(\)"):
        calls[call]()


def test_spawn_launch_needs_a_function(clean_env):
    fabric = Fabric(accelerator="cpu", strategy="ddp_spawn", devices=2)
    with pytest.raises(TypeError, match="need a function"):
        fabric.launch()


# ---- popen: `python script.py`, Fabric starts rank 1 -------------------------------------------------


@pytest.fixture
def popen(tmp_path_factory):
    return popen_results(tmp_path_factory)


def _both(results, *keys):
    """The value under ``keys`` from each rank's results."""
    values = []
    for rank in (0, 1):
        value = results["ranks"][rank] if "ranks" in results else results[rank]
        for key in keys:
            value = value[key]
        values.append(value)
    return values


def check_ranks(ranks):
    for rank in (0, 1):
        core = ranks[rank]["core"]
        assert core["global_rank"] == rank == core["dist_rank"] == core["local_rank"]
        assert core["world_size"] == 2 == core["dist_world_size"]
        assert core["node_rank"] == 0
        assert core["is_global_zero"] is (rank == 0)
        assert core["device"] == "cpu"
        assert core["backend"] == "gloo"
        assert core["wrapped_type"] == "DistributedDataParallel"
        assert core["sampler_kwargs"] == {"num_replicas": 2, "rank": rank}


def check_gradients_and_steps(ranks):
    for rank in (0, 1):
        core = ranks[rank]["core"]
        assert core["initial_weights_equal"], "seed_everything must give the same initial weights on every rank"
        ddp, local = core["ddp_grads"], core["local_grads"]
        assert not torch.allclose(local[0], local[1]), "the ranks' data should give different local gradients"
        assert torch.equal(ddp[0], ddp[1]), "gradients must be identical on every rank after backward"
        torch.testing.assert_close(ddp[0], local.mean(0))
        params = core["params_after_step"]
        assert torch.equal(params[0], params[1])
        torch.testing.assert_close(params[0], core["expected_params_after_step"])


def check_training(ranks):
    for rank in (0, 1):
        core = ranks[rank]["core"]
        losses = core["losses"]
        assert losses[-1] < 0.05 * losses[0], losses
        assert torch.equal(core["trained_params"][0], core["trained_params"][1])
    assert ranks[0]["core"]["losses"] == ranks[1]["core"]["losses"]


def check_sync_grads(ranks):
    for rank in (0, 1):
        core = ranks[rank]["core"]
        assert torch.equal(core["sync_gathered"], torch.tensor([[1.0] * 3, [2.0] * 3]))
        # rank r's loss is (r + 1) * sum(gathered[other]): the gradient lands on the other rank
        assert torch.equal(core["sync_grad"], torch.full((3,), float(2 - rank)))


def check_collectives(ranks):
    for rank in (0, 1):
        core = ranks[rank]["core"]
        assert core["reduce_sum"]["a"] == torch.tensor(3)
        torch.testing.assert_close(core["reduce_sum"]["b"][0], torch.tensor(2.0))
        assert torch.equal(core["reduce_sum"]["b"][1], torch.tensor([1, 10]))
        assert torch.equal(core["reduce_sum"]["c"][0], torch.tensor(1))  # booleans are counted
        assert isinstance(core["reduce_sum"]["c"], tuple)
        mean = core["reduce_mean"]
        assert mean["a"].dtype == torch.float32 and mean["a"] == 1.5  # an integer mean is a float
        torch.testing.assert_close(mean["b"][1], torch.tensor([0.5, 5.0]))
        torch.testing.assert_close(mean["c"][0], torch.tensor(0.5))
        assert core["reduce_max"]["a"] == 2 and core["reduce_min"]["a"] == 1
        assert core["reduce_max"]["b"][0] == 1.5 and core["reduce_min"]["b"][0] == 0.5
        assert core["reduce_max"]["c"][0].item() is True and core["reduce_min"]["c"][0].item() is False
        assert core["reduce_op_enum"] == 3
        assert core["reduce_avg_enum_int"] == 0.5
        assert torch.equal(core["reduce_input_untouched"], torch.tensor([1.0]))
        assert torch.equal(core["gather_scalar"], torch.tensor([0, 1]))
        assert torch.equal(core["gather_nested"]["n"], torch.tensor([0, 1]))
        assert torch.equal(core["gather_nested"]["t"][0], torch.tensor([[0, 1], [1, 2]]))
        assert torch.equal(core["broadcast_tensor"], torch.tensor([10, 11, 12]))
        assert core["broadcast_other_shape"] == [3]
        assert core["broadcast_object"] == {"from": 0, "text": "hello"}
        assert core["decision_any"] is True and core["decision_all"] is False
        assert core["decision_all_true"] is True and core["decision_none"] is False
        assert core["bad_op_name"].startswith("ValueError") and "'median'" in core["bad_op_name"]
        assert "'sum'" in core["bad_op_name"] and "'mean'" in core["bad_op_name"]
        assert core["bad_op_type"].startswith("TypeError") and "3" in core["bad_op_type"]


def check_accumulation(ranks):
    for rank in (0, 1):
        acc = ranks[rank]["accumulation"]
        inside = acc["inside_grads"]
        assert not torch.allclose(inside[0], inside[1]), "inside no_backward_sync the gradients must stay local"
        torch.testing.assert_close(inside[rank], acc["inside_local_expected"])
        assert torch.equal(acc["accumulated"][0], acc["accumulated"][1])
        torch.testing.assert_close(acc["accumulated"][rank], acc["big_batch"])
        blocked = acc["blocked_grads"]
        assert not torch.allclose(blocked[0], blocked[1]), "block_backward_sync() must keep the gradients local"
        torch.testing.assert_close(blocked[rank], acc["blocked_local_expected"])
        after = acc["after_block_grads"]
        assert torch.equal(after[0], after[1]), "after the block, gradients are synchronized again"


def check_checkpoint(ranks):
    for rank in (0, 1):
        ckpt = ranks[rank]["checkpoint"]
        assert ckpt["save_calls"] == (1 if rank == 0 else 0), "only rank 0 writes the file"
        assert "checkpoint.pt" in ckpt["files"]
        assert ckpt["loaded_equal"] and ckpt["loaded_step"] == 7 and ckpt["optimizer_state_loaded"]
        assert ckpt["remainder"] == []
        expected_keys = ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert ckpt["file_model_keys"] == expected_keys
        assert ckpt["strategy_state_dict_keys"] == expected_keys
        assert ckpt["fabric_module_keys"] == expected_keys
        assert ckpt["strategy_loaded_into_ddp"]


@pytest.mark.procs
@pytest.mark.timeout(JOB_TIMEOUT)
def test_popen_ranks_world_size_device(popen):
    check_ranks(popen["ranks"])
    assert [popen["ranks"][r]["launch_returned_in_rank"] for r in (0, 1)] == [0, 1]


@pytest.mark.procs
@pytest.mark.timeout(JOB_TIMEOUT)
def test_popen_gradients_are_the_mean_of_local_gradients(popen):
    check_gradients_and_steps(popen["ranks"])


@pytest.mark.procs
@pytest.mark.timeout(JOB_TIMEOUT)
def test_popen_training_converges_with_identical_replicas(popen):
    check_training(popen["ranks"])


@pytest.mark.procs
@pytest.mark.timeout(JOB_TIMEOUT)
def test_popen_all_gather_sync_grads(popen):
    check_sync_grads(popen["ranks"])


@pytest.mark.procs
@pytest.mark.timeout(JOB_TIMEOUT)
def test_popen_collectives(popen):
    check_collectives(popen["ranks"])


@pytest.mark.procs
@pytest.mark.timeout(JOB_TIMEOUT)
def test_popen_no_backward_sync_accumulates_the_big_batch_gradient(popen):
    check_accumulation(popen["ranks"])


@pytest.mark.procs
@pytest.mark.timeout(JOB_TIMEOUT)
def test_popen_checkpoint_written_by_rank0_loaded_by_all(popen):
    check_checkpoint(popen["ranks"])


@pytest.mark.procs
@pytest.mark.timeout(JOB_TIMEOUT)
def test_popen_print_and_rank_zero_first(popen):
    assert popen["stdout"].count(checks.PRINT_MARKER) == 1
    assert f"{checks.PRINT_MARKER} 0" in popen["stdout"]
    assert popen["ranks"][1]["rank_zero_first"] is True, "rank 1 entered before rank 0 had finished the block"


@pytest.mark.procs
@pytest.mark.timeout(JOB_TIMEOUT)
def test_popen_model_averaging_drift_and_agree(popen):
    for rank in (0, 1):
        averaging = popen["ranks"][rank]["averaging"]
        # warm-up steps 0, 1 reduce gradients; then local steps, averaged after steps 2, 4, 6
        assert averaging["local"] == [True, True, True, False, True, False, True]
        assert averaging["default"] == [True] * 7  # gradients reduced within the machine keep replicas equal


@pytest.mark.procs
@pytest.mark.timeout(JOB_TIMEOUT)
def test_popen_fp16_compressed_comm_hook(popen):
    for rank in (0, 1):
        hook = popen["ranks"][rank]["comm_hook"]
        assert hook["hook_calls"] >= 1
        assert torch.equal(hook["grads"][0], hook["grads"][1])
        torch.testing.assert_close(hook["grads"][0], hook["local_grads"].mean(0), rtol=2e-3, atol=2e-3)


# ---- spawn: fabric.launch(fn) from this process ---------------------------------------------------------


@pytest.fixture(scope="module")
def spawn(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        isolate(mp)
        directory = tmp_path_factory.mktemp("spawn_job")
        fabric = Fabric(accelerator="cpu", strategy="ddp_spawn", devices=2)
        return fabric.launch(checks.spawn_job, str(directory))


@pytest.mark.procs
@pytest.mark.timeout(JOB_TIMEOUT)
def test_spawn_returns_rank0_value_with_cpu_tensor(spawn):
    assert set(spawn) == {"ranks", "tensor", "pid"}
    assert torch.equal(spawn["tensor"], torch.tensor([0.0, 7.0, 14.0]))
    assert spawn["pid"] != os.getpid()
    check_ranks(spawn["ranks"])


@pytest.mark.procs
@pytest.mark.timeout(JOB_TIMEOUT)
def test_spawn_gradients_steps_and_training(spawn):
    check_gradients_and_steps(spawn["ranks"])
    check_training(spawn["ranks"])


@pytest.mark.procs
@pytest.mark.timeout(JOB_TIMEOUT)
def test_spawn_collectives_and_sync_grads(spawn):
    check_collectives(spawn["ranks"])
    check_sync_grads(spawn["ranks"])


@pytest.mark.procs
@pytest.mark.timeout(JOB_TIMEOUT)
def test_spawn_accumulation_and_checkpoint(spawn):
    check_accumulation(spawn["ranks"])
    check_checkpoint(spawn["ranks"])


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_fork_launch_returns_rank0_tensor(clean_env):
    fabric = Fabric(accelerator="cpu", strategy="ddp_fork", devices=2)
    result = fabric.launch(checks.fork_job)
    assert torch.equal(result["sum"], torch.tensor([3.0, 20.0]))
    assert result["initialized_after_teardown"] is False, "teardown() leaves the process group"
    assert result["local_rank"] == "0"
    assert not dist.is_initialized(), "the launching process must not join the group"
    assert "LOCAL_RANK" not in os.environ


# ---- a failing rank ends the whole job ------------------------------------------------------------------


@pytest.mark.procs
@pytest.mark.timeout(60)
@pytest.mark.parametrize("failing_rank", [0, 1])
def test_popen_failing_rank_ends_the_job_quickly(tmp_path, failing_rank):
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "failing_job.py"), str(failing_rank)],
        env=job_environment(), cwd=tmp_path, capture_output=True, text=True, timeout=50,
    )
    assert result.returncode != 0
    assert f"rank {failing_rank} fails on purpose" in result.stderr
    assert time.monotonic() - start < 30, "the peer waiting in a barrier must not hold the job up"


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_spawn_failing_rank_raises_in_the_caller(clean_env):
    fabric = Fabric(accelerator="cpu", strategy="ddp_spawn", devices=2)
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        fabric.launch(checks.failing_job, 1)
    assert time.monotonic() - start < 30, "the peer waiting in a barrier must not hold the job up"
    # rank 0 then fails too ("connection reset" in its barrier): the launcher must report the cause, not the echo
    assert "rank 1 fails on purpose" in str(info.value)
    assert info.value.rank == 1


@pytest.mark.procs
@pytest.mark.timeout(150)
def test_a_failed_rank0_save_raises_the_same_error_on_every_rank(clean_env, tmp_path):
    """Rank 0's write fails and the user catches it: no rank is left waiting inside save()."""
    fabric = Fabric(accelerator="cpu", strategy="ddp_spawn", devices=2)
    start = time.monotonic()
    ranks = fabric.launch(checks.save_failure_job, str(tmp_path))
    assert time.monotonic() - start < 90
    for name in ("not_a_folder", "too_big"):
        errors = [ranks[rank][name] for rank in (0, 1)]
        assert all(errors), f"{name}: every rank must raise, got {errors}"
        assert errors[0].split(":")[0] == errors[1].split(":")[0], errors  # the same exception class
        assert errors[0].split(": ", 1)[1] in errors[1], errors  # rank 0's message reaches rank 1
        assert "Rank 0 failed to save the checkpoint" in errors[1]
    assert ranks[0]["too_big"].startswith("OSError") and ranks[1]["too_big"].startswith("OSError")
    assert ranks[0]["good_save"] is None and ranks[1]["good_save"] is None
    # nothing half-written is left where the checkpoints go
    assert ranks[0]["files"] == ["a-file", "good.pt"]


@pytest.mark.procs
@pytest.mark.timeout(90)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads thread names from /proc")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "tensor_parallel"])
def test_no_gloo_thread_outlives_the_exit_hook_with_a_module_level_model(tmp_path, strategy):
    """Nothing of the process group may still run when the interpreter shuts down (else: exit 134).

    DDP pins the group through its reducer; the sharded strategies through DTensor's caches, which keep
    every device mesh they saw (and the mesh its groups) for the life of the process.
    """
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "exit_threads.py"), str(tmp_path), strategy],
        env=job_environment(), cwd=tmp_path, capture_output=True, text=True, timeout=80,
    )
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        names = json.loads((tmp_path / f"threads{rank}.json").read_text())
        left = [name for name in names if "gloo" in name or "tcpstore" in name]
        assert not left, f"rank {rank}: threads of the process group still running at exit: {names}"


@pytest.mark.timeout(30)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads thread names from /proc")
def test_a_running_store_thread_counts_as_a_process_group_thread():
    """On torch 2.9/2.10 the TCPStore's loop ("pt_tcpstore_uv") outlives an FSDP group by a moment: the exit hook waits for it too."""
    libc = ctypes.CDLL(None)
    named, release = threading.Event(), threading.Event()

    def store_loop() -> None:
        libc.prctl(15, b"pt_tcpstore_uv", 0, 0, 0)  # PR_SET_NAME: what /proc/self/task/*/comm shows
        named.set()
        release.wait(10)

    thread = threading.Thread(target=store_loop, daemon=True)
    thread.start()
    try:
        assert named.wait(10)
        assert _process_group_threads_alive()
    finally:
        release.set()
        thread.join(10)
