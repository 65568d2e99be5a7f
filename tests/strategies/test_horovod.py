"""HorovodStrategy in real jobs: `horovodrun --gloo -np 2 -H localhost:2` on the CPU.

Each job is a script in ``support/scripts/horovod/`` that writes what it computed to a folder; the tests here
recompute the expected values with NumPy. Jobs are grouped (one horovodrun start-up costs seconds)
and each runs once per module through a fixture. Skipped only when Horovod is not installed;
`make horovod` builds it, and CI does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from support import REPO
from support.environment import clean_env
from support.loading import script_path

# the jobs' subject is the strategy (collectives, training, checkpoints): warm ranks; horovodrun's launcher too, as a
# program (its middlemen's os.setsid() is answered as the stand-in's would be: support/warm_ranks.py)
pytestmark = [pytest.mark.procs]

pytest.importorskip("horovod", reason="Horovod is not installed; `make horovod` (scripts/build_horovod.sh) builds it")

ROOT = REPO
SCRIPTS = script_path("horovod", "training.py").parent
EXAMPLE = ROOT / "examples" / "horovod_train.py"
JOB_TIMEOUT = 90  # seconds for one job; each test's own timeout is larger so this message wins


def _horovodrun() -> str:
    found = shutil.which("horovodrun", path=str(Path(sys.executable).parent)) or shutil.which("horovodrun")
    if found is None:
        pytest.fail("horovod is importable but `horovodrun` is not on the PATH next to this Python")
    return found


def start(command: list[str]) -> tuple[subprocess.Popen[str], float]:
    """Start ``command`` from the repository root, in its own process group."""
    # no FABRIC_* variable of the caller (e.g. `fabric run` options) may change the jobs' Fabric(...)
    env = clean_env(OMP_NUM_THREADS="1")  # two ranks share the CPU cores
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    return process, time.monotonic()


def finish(started: tuple[subprocess.Popen[str], float], timeout: float = JOB_TIMEOUT) -> tuple[int, str, float]:
    """Wait for a started command; return (exit code, output, seconds). Never hangs."""
    process, start_time = started
    try:
        output, _ = process.communicate(timeout=max(1.0, timeout - (time.monotonic() - start_time)))
    except subprocess.TimeoutExpired:
        # horovodrun ends its workers on SIGTERM; SIGKILL whatever is left of the group after that
        os.killpg(process.pid, signal.SIGTERM)
        try:
            output, _ = process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
        pytest.fail(f"{' '.join(map(str, process.args))} did not finish in {timeout}s; output:\n{output[-6000:]}")
    return process.returncode, output, time.monotonic() - start_time


def run(command: list[str], timeout: float = JOB_TIMEOUT) -> tuple[int, str, float]:
    return finish(start(command), timeout)


def horovodrun_command(script: Path, *args: str) -> list[str]:
    return [_horovodrun(), "--gloo", "-np", "2", "-H", "localhost:2", sys.executable, str(script), *args]


def horovod_job(script: Path, *args: str, timeout: float = JOB_TIMEOUT) -> tuple[int, str, float]:
    return run(horovodrun_command(script, *args), timeout=timeout)


RESULT_JOBS = ("collectives.py", "training.py")


@pytest.fixture(scope="module")
def result_jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The two jobs that write results, started together (each one's start-up overlaps the other's)."""
    jobs = {}
    for script in RESULT_JOBS:
        folder = tmp_path_factory.mktemp(script.removesuffix(".py"))
        jobs[script] = (start(horovodrun_command(SCRIPTS / script, str(folder))), folder)
    yield jobs
    for started, _ in jobs.values():
        if started[0].poll() is None:  # a test failed before collecting this job
            os.killpg(started[0].pid, signal.SIGTERM)
            started[0].communicate()


def job_results(jobs: dict[str, Any], script: str) -> list[dict[str, Any]]:
    started, folder = jobs[script]
    code, output, _ = finish(started)
    if code != 0:
        pytest.fail(f"{script} under horovodrun exited with {code}; output:\n{output[-8000:]}")
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.fixture(scope="module")
def collectives(result_jobs: dict[str, Any]) -> list[dict[str, Any]]:
    return job_results(result_jobs, "collectives.py")


@pytest.fixture(scope="module")
def training(result_jobs: dict[str, Any]) -> list[dict[str, Any]]:
    return job_results(result_jobs, "training.py")


# ---- decoding what the scripts wrote -------------------------------------------------------------


def array(leaf: Any) -> np.ndarray:
    return np.asarray(leaf["value"] if isinstance(leaf, dict) and "dtype" in leaf else leaf, dtype=np.float64)


def is_leaf(node: Any) -> bool:
    return not isinstance(node, (dict, list)) or (isinstance(node, dict) and "dtype" in node)


def check_leaves(inputs: list[Any], output: Any, expected: Any, path: str = "") -> None:
    """Walk the nesting of ``output``; at each leaf compare with ``expected(stacked inputs)``."""
    if is_leaf(output):
        stacked = np.stack([array(node) for node in inputs])
        np.testing.assert_allclose(array(output), expected(stacked), rtol=1e-6, atol=1e-6, err_msg=path)
        return
    keys = output.keys() if isinstance(output, dict) else range(len(output))
    assert len(output) == len(inputs[0]), path
    for key in keys:
        check_leaves([node[key] for node in inputs], output[key], expected, f"{path}/{key}")


def weights(params: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """(W, b) of a Linear(3, 1), whatever prefix the module's parameter names carry."""
    by_suffix = {name.rsplit(".", 1)[-1]: np.asarray(value, dtype=np.float64) for name, value in params.items()}
    return by_suffix["weight"], by_suffix["bias"]


def linear_mse_grads(w: np.ndarray, b: np.ndarray, x: Any, y: Any) -> np.ndarray:
    """Gradient of mean((x W^T + b - y)^2) with respect to (W, b), flattened."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    residual = 2.0 * (x @ w.T + b - y) / y.size
    return np.concatenate([(residual.T @ x).ravel(), residual.sum(axis=0)])


def flat(grads: dict[str, Any]) -> np.ndarray:
    w, b = weights(grads)
    return np.concatenate([w.ravel(), b.ravel()])


# ---- properties and collectives ------------------------------------------------------------------


@pytest.mark.timeout(150)
def test_ranks_and_properties(collectives: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(collectives):
        assert result["before_launch"] == {"world_size": 2, "global_rank": rank}
        assert result["properties"] == {
            "global_rank": rank,
            "local_rank": rank,
            "node_rank": 0,
            "world_size": 2,
            "num_nodes": 1,
            "is_global_zero": rank == 0,
            "device": "cpu",
            "sampler": {"num_replicas": 2, "rank": rank},
            "launcher": "None",
            "rank_zero_only": rank,
        }


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("op", "reduce"),
    [("sum", np.sum), ("mean", np.mean), ("avg", np.mean), ("max", np.max), ("min", np.min),
     ("default", np.mean), ("reduceop_sum", np.sum)],
)
def test_all_reduce_nested(collectives: list[dict[str, Any]], op: str, reduce: Any) -> None:
    inputs = [result["input"] for result in collectives]
    for result in collectives:
        check_leaves(inputs, result[f"all_reduce_{op}"], lambda stacked: reduce(stacked, axis=0))
    int_leaf = collectives[0][f"all_reduce_{op}"]["list"][0]
    assert int_leaf["dtype"] == ("torch.float32" if reduce is np.mean else "torch.int64")


@pytest.mark.timeout(150)
def test_all_reduce_dtypes_and_inputs(collectives: list[dict[str, Any]]) -> None:
    for result in collectives:
        assert result["all_reduce_int_mean"] == {"dtype": "torch.float32", "value": [1.5, 4.0]}
        assert result["all_reduce_bool_sum"] == {"dtype": "torch.int64", "value": [1, 0]}  # votes counted
        assert result["all_reduce_bf16_sum"] == {"dtype": "torch.bfloat16", "value": [4.0]}
        reduced, original = result["all_reduce_keeps_input"]
        assert reduced["value"] == [2.0, 4.0] and original["value"] == [1.0, 2.0]
        assert result["all_reduce_strategy_passthrough"] == "not a tensor"
        assert result["after_errors"]["value"] == 1.0


@pytest.mark.timeout(150)
def test_all_gather_nested(collectives: list[dict[str, Any]]) -> None:
    inputs = [result["input"] for result in collectives]
    for result in collectives:
        check_leaves(inputs, result["all_gather"], lambda stacked: stacked)
        assert result["all_gather_bool"] == {"dtype": "torch.bool", "value": [[False], [True]]}
        assert result["all_gather_no_grad"] is False


@pytest.mark.timeout(150)
def test_all_gather_sync_grads(collectives: list[dict[str, Any]]) -> None:
    # rank r gathers x_k = [k + 1, 2] and takes sum(gathered * W * (r + 1)), W = [[1, 2], [3, 4]]
    w = np.array([[1.0, 2.0], [3.0, 4.0]])
    gathered = np.array([[1.0, 2.0], [2.0, 2.0]])
    for rank, result in enumerate(collectives):
        np.testing.assert_allclose(result["all_gather_sync_grads"]["gathered"]["value"], gathered)
        # d/dx_rank of the loss summed over every rank, as DDP's differentiable all_gather gives
        expected = sum(w[rank] * (k + 1) for k in range(2))
        np.testing.assert_allclose(result["all_gather_sync_grads"]["grad"]["value"], expected)


@pytest.mark.timeout(150)
def test_broadcast(collectives: list[dict[str, Any]]) -> None:
    for result in collectives:
        assert result["broadcast_tensor"] == {"dtype": "torch.int64", "value": [0, 10, 20, 30]}
        assert result["broadcast_tensor_same_shape"] == {"dtype": "torch.float32", "value": [[0.0, 0.0], [0.0, 0.0]]}
        assert result["broadcast_bf16"] == {"dtype": "torch.bfloat16", "value": [1.5]}
        assert result["broadcast_object"] == {"from": 0, "items": [0, "text", [0]]}
        assert result["broadcast_object_src1"] == "rank 1"


@pytest.mark.timeout(150)
def test_barrier_waits_for_the_late_rank(collectives: list[dict[str, Any]]) -> None:
    assert collectives[0]["barrier_waited"] > 0.8  # rank 1 arrived 1 s late


@pytest.mark.timeout(150)
def test_reduce_boolean_decision(collectives: list[dict[str, Any]]) -> None:
    for result in collectives:
        expected = {"all_rank0_true": False, "any_rank0_true": True, "all_true": True, "any_false": False}
        assert result["decisions"] == expected


@pytest.mark.timeout(150)
def test_collective_argument_errors(collectives: list[dict[str, Any]]) -> None:
    for result in collectives:
        errors = result["errors"]
        assert errors["group"].startswith("ValueError") and "process sets are not supported" in errors["group"]
        assert errors["gather_group"].startswith("ValueError")
        for key, op in (("bad_op", "median"), ("bad_op_non_tensor", "prod")):
            assert errors[key].startswith("ValueError") and f"reduce_op={op!r}" in errors[key]
            assert all(repr(name) in errors[key] for name in ("mean", "avg", "sum", "max", "min"))
        assert errors["bad_src"].startswith("ValueError") and "src=2" in errors["bad_src"]


# ---- training ------------------------------------------------------------------------------------


@pytest.mark.timeout(150)
def test_setup_starts_every_rank_from_rank_zero(training: list[dict[str, Any]]) -> None:
    w0, b0 = weights(training[0]["initial_local"])
    w1, _ = weights(training[1]["initial_local"])
    assert not np.allclose(w0, w1), "the ranks were meant to start from different weights"
    for result in training:
        w, b = weights(result["after_setup"])
        # exact: broadcast copies, and no warm-up optimizer step (weight decay!) touched them
        np.testing.assert_array_equal(w, w0)
        np.testing.assert_array_equal(b, b0)
        assert result["optimizer_state_after_setup"] == 0
        assert result["optimizer_is_sgd"] is True
        assert result["zero_grad_to_none"] is True


@pytest.mark.timeout(150)
def test_gradient_is_the_mean_of_local_gradients(training: list[dict[str, Any]]) -> None:
    w, b = weights(training[0]["after_setup"])
    local = [linear_mse_grads(w, b, r["step"]["x"], r["step"]["y"]) for r in training]
    expected = np.mean(local, axis=0)
    assert not np.allclose(local[0], local[1])
    for result in training:
        np.testing.assert_allclose(flat(result["step"]["grads"]), expected, rtol=1e-5, atol=1e-6)
        # SGD(lr=0.1, momentum=0.9, weight_decay=0.1), first step: p - lr * (g + wd * p)
        params = np.concatenate([w.ravel(), b.ravel()])
        stepped = params - 0.1 * (expected + 0.1 * params)
        np.testing.assert_allclose(flat(result["step"]["params"]), stepped, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["last_outside", "all_inside", "no_block"])
def test_gradient_accumulation(training: list[dict[str, Any]], mode: str) -> None:
    """k micro-batches then one step: the mean over ranks of each rank's big-batch gradient."""
    records = [result[f"accumulate_{mode}"] for result in training]
    w, b = weights(records[0]["start"])
    np.testing.assert_array_equal(flat(records[1]["start"]), np.concatenate([w.ravel(), b.ravel()]))
    big_batch = []
    for record in records:
        x = np.concatenate([np.asarray(mx) for mx, _ in record["micro"]])
        y = np.concatenate([np.asarray(my) for _, my in record["micro"]])
        big_batch.append(linear_mse_grads(w, b, x, y))
    expected = np.mean(big_batch, axis=0)
    for record in records:
        np.testing.assert_allclose(flat(record["grads"]), expected, rtol=1e-5, atol=1e-6)
    if mode != "no_block":
        # inside no_backward_sync nothing was all-reduced: the gradient stayed this rank's own
        for record in records:
            mx, my = record["micro"][0]
            local = linear_mse_grads(w, b, mx, my) / 3
            np.testing.assert_allclose(flat(record["grad_after_first"]), local, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(150)
def test_clip_gradients_sees_averaged_gradients(training: list[dict[str, Any]]) -> None:
    w, b = weights(training[0]["clip"]["start"])
    mean = np.mean([linear_mse_grads(w, b, r["clip"]["x"], r["clip"]["y"]) for r in training], axis=0)
    norm = np.linalg.norm(mean)
    for result in training:
        assert result["clip"]["norm"] == pytest.approx(norm, rel=1e-5)
        np.testing.assert_allclose(flat(result["clip"]["grads"]), mean * 1e-3 / (norm + 1e-6), rtol=1e-4, atol=1e-9)


@pytest.mark.timeout(150)
def test_horovod_synchronize_idiom_on_the_fabric_optimizer(training: list[dict[str, Any]]) -> None:
    w, b = weights(training[0]["idiom"]["start"])
    mean = np.mean([linear_mse_grads(w, b, r["idiom"]["x"], r["idiom"]["y"]) for r in training], axis=0)
    for result in training:
        np.testing.assert_allclose(flat(result["idiom"]["grads"]), mean, rtol=1e-5, atol=1e-6)
        assert result["idiom"]["warnings"] == []


@pytest.mark.timeout(150)
def test_training_converges_with_identical_replicas(training: list[dict[str, Any]]) -> None:
    first, second = (result["train"] for result in training)
    assert first["losses"] == second["losses"]
    assert first["losses"][-1] < 0.15 * first["losses"][0], first["losses"]
    assert first["params"] == second["params"]
    assert first["batches"] == 8  # 256 samples / 2 ranks / batch 16
    # the distributed sampler gave each rank its own half of the data
    assert not set(first["seen_epoch0"]) & set(second["seen_epoch0"])
    assert sorted(first["seen_epoch0"] + second["seen_epoch0"]) == list(range(256))


@pytest.mark.timeout(150)
def test_checkpoint_saved_once_and_loaded_on_every_rank(training: list[dict[str, Any]]) -> None:
    assert [result["saves"] for result in training] == [1, 0]
    trained = training[0]["train"]["params"]
    for result in training:
        loaded = result["loaded"]
        assert loaded["params"] == trained
        assert loaded["adam_state0"] == training[0]["saved_adam_state0"]
        assert loaded["step"] == 7 and loaded["remainder"] == []
        assert loaded["lr"] == 0.05  # the saved learning rate, not the new optimizer's 0.5
        assert loaded["same_groups"] is True  # the Fabric optimizer still sees the loaded groups
        assert result["after_load_step"]["lr"] == pytest.approx(0.025)  # the scheduler still drives it
    assert training[0]["after_load_step"] == training[1]["after_load_step"]


# ---- failures, examples, one process -------------------------------------------------------------


@pytest.mark.cold  # its subject is how a rank's failure ends the job: fresh interpreters
@pytest.mark.timeout(120)
def test_failing_rank_ends_the_job_with_its_error() -> None:
    code, output, seconds = horovod_job(SCRIPTS / "failure.py", timeout=60)
    assert code != 0
    assert "boom from rank 1" in output
    assert seconds < 45, f"the job took {seconds:.1f}s to end after rank 1 failed"


def _final_loss(output: str) -> float:
    lines = re.findall(r"final loss (\S+)", output)
    assert len(lines) == 1, f"expected one 'final loss' line (rank 0 prints), got:\n{output[-4000:]}"
    return float(lines[0])


@pytest.mark.timeout(200)
def test_example_runs_under_horovod_and_ddp_alike() -> None:
    short = ("--steps", "15", "--accumulate", "2")
    # both jobs at once: most of their time is start-up
    horovod = start(horovodrun_command(EXAMPLE, "--strategy", "horovod", *short))
    ddp = start([sys.executable, str(EXAMPLE), "--strategy", "ddp", "--devices", "2", *short])
    code, output, _ = finish(horovod)
    assert code == 0, output[-6000:]
    assert "world_size 2" in output
    horovod_loss = _final_loss(output)
    code, output, _ = finish(ddp)
    assert code == 0, output[-6000:]
    assert "world_size 2" in output
    # same seed, data shards and start weights: the two strategies train the same model
    assert _final_loss(output) == pytest.approx(horovod_loss, rel=2e-3, abs=2e-4)


@pytest.mark.timeout(120)
def test_main_example_runs_under_horovodrun() -> None:
    """The project's main example loop needs no change to run as a Horovod job."""
    script = ROOT / "examples" / "fabric_loop.py"
    if not script.exists():
        pytest.skip("examples/fabric_loop.py is not in this checkout")
    code, output, _ = horovod_job(script, "--strategy", "horovod", "--accelerator", "cpu", "--epochs", "1")
    assert code == 0, output[-6000:]
    assert _final_loss(output) > 0


@pytest.mark.timeout(120)
def test_single_process_without_horovodrun() -> None:
    """`python script.py` with strategy='horovod' runs as one rank (and says how to get more)."""
    code, output, _ = run([sys.executable, str(SCRIPTS / "single_process.py")], timeout=60)
    assert code == 0, output[-6000:]
    assert "horovodrun -np 2" in output  # the warning for devices=2 without horovodrun
    assert "single process ok" in output
