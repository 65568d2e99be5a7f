"""Pipeline parallelism in ``ModelParallelStrategy``: its checks and parts in this process, then real jobs.

Each job (``support/scripts/pipeline/pp_job.py``, 2 or 4 processes under ``fabric-torch run``) trains the same model
on the same batches as one process of plain torch running the same microbatches (the script with ``--pp 0``), and
must end with the same losses, parameters and optimizer state: fp32 within 1e-6 (losses, relative) and 1e-5
(parameters), fp64 within 1e-12.
"""

from __future__ import annotations

import glob
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from fabric.strategies import ModelParallelStrategy
from fabric.strategies.pipeline_stages import (
    PipelineError,
    PipelineModule,
    _keep_stage_parameters,
    microbatch_count,
    schedule_class,
    stage_indices,
    stage_layout,
)
from support.environment import clean_env
from support.loading import script_path
from support.processes import fabric_run, run

JOB = script_path("pipeline", "pp_job.py")


def _parallelize(module, mesh):
    return module


# ---- checks and parts, in this process -------------------------------------------------------------------------


def test_schedules_are_torchs_by_name_and_a_typo_is_refused_with_the_closest() -> None:
    assert schedule_class("1f1b").__name__ == "Schedule1F1B"
    assert schedule_class("ZBVZeroBubble").__name__ == "ScheduleZBVZeroBubble"
    with pytest.raises(ValueError, match=r"pipeline_schedule='Interleaved1FB' is not valid; accepted: \[.*'GPipe'.*\]; did you"
                       r" mean 'Interleaved1F1B'\?"):
        ModelParallelStrategy(_parallelize, pipeline_parallel_size=2, pipeline_split=["b"], pipeline_schedule="Interleaved1FB")


@pytest.mark.parametrize(
    ("schedule", "names", "said"),
    [
        ("1F1B", 3, "pipeline_split has 3 name(s), which make 4 stage(s); pipeline_schedule='1F1B' runs one stage per rank,"
                    " so pipeline_parallel_size=2 needs 2 stage(s): 1 name(s)"),
        ("ZBVZeroBubble", 1, "runs two stages per rank, so pipeline_parallel_size=2 needs 4 stage(s): 3 name(s)"),
        ("Interleaved1F1B", 4, "runs a whole number of stages per rank, so pipeline_parallel_size=2 needs 4 stage(s)"),
    ],
)
def test_a_split_that_does_not_fit_the_schedule_is_refused_with_the_numbers(schedule: str, names: int, said: str) -> None:
    with pytest.raises(ValueError, match="pipeline_split has") as info:
        ModelParallelStrategy(_parallelize, pipeline_parallel_size=2, pipeline_split=[f"m{i}" for i in range(names)], pipeline_schedule=schedule)
    assert said in str(info.value)


def test_stages_are_placed_looped_or_in_a_v() -> None:
    assert stage_layout(schedule_class("1F1B"), 4, 3) == (1, False)
    assert stage_layout(schedule_class("Interleaved1F1B"), 2, None) == (2, False)
    assert stage_layout(schedule_class("DualPipeV"), 2, 3) == (2, True)
    assert [stage_indices(rank, 2, 2, False) for rank in (0, 1)] == [[0, 2], [1, 3]]
    assert [stage_indices(rank, 2, 2, True) for rank in (0, 1)] == [[0, 3], [1, 2]]


@pytest.mark.parametrize(
    ("kwargs", "error", "said"),
    [
        ({"pipeline_parallel_size": 0}, ValueError, "pipeline_parallel_size=0 is not valid; accepted: an int >= 1"),
        ({"pipeline_parallel_size": 2, "pipeline_split": "layers.4"}, TypeError, "pipeline_split='layers.4' is not valid"),
        ({"pipeline_parallel_size": 2, "pipeline_split": ["a", "a"]}, ValueError, "names a module twice"),
        ({"microbatches": 0}, ValueError, "microbatches=0 is not valid"),
    ],
)
def test_bad_pipeline_arguments_are_refused_naming_the_value(kwargs, error, said) -> None:
    with pytest.raises(error) as info:
        ModelParallelStrategy(_parallelize, **kwargs)
    assert said in str(info.value)


def test_a_batch_must_divide_into_the_microbatches() -> None:
    assert microbatch_count((torch.zeros(8, 3),), torch.zeros(8), 4) == 8
    with pytest.raises(ValueError, match=r"a batch of 6 does not divide into microbatches=4; accepted: batch sizes that are"
                       r" a multiple of 4"):
        microbatch_count((torch.zeros(6, 3),), None, 4)
    with pytest.raises(ValueError, match=r"different batch sizes \[6, 8\]"):
        microbatch_count((torch.zeros(8, 3),), torch.zeros(6), 2)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(2, 4)
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(4)])
        self.scale = nn.Parameter(torch.ones(4))
        self.register_buffer("steps", torch.zeros(()), persistent=False)


def test_the_pipeline_module_keeps_the_whole_models_names_before_and_after_the_split_and_changes_no_stage() -> None:
    model = _Net()
    pipeline = PipelineModule(model)
    assert list(pipeline.state_dict()) == list(model.state_dict())
    with pytest.raises(PipelineError, match=r"fabric.pipeline_step\(model, \*inputs, target=target, loss_fn=loss_fn\)"):
        pipeline(torch.zeros(1, 2))
    optimizer = torch.optim.SGD(pipeline.parameters(), lr=0.1, momentum=0.9)
    pipeline.follow(optimizer)
    for parameter in model.parameters():
        parameter.grad = torch.ones_like(parameter)
    optimizer.step()  # momentum for every parameter of the whole model
    # this rank's two stages (as a tracing split leaves them): layers 0-1 with the embedding, layers 3 with `scale`
    first, second = nn.Module(), nn.Module()
    first.embed, first.layers = model.embed, nn.Module()
    first.layers.add_module("0", model.layers[0])
    first.layers.add_module("1", model.layers[1])
    second.layers = nn.Module()
    second.layers.add_module("3", model.layers[3])
    second.scale = model.scale
    before = [dict(stage.named_parameters()) for stage in (first, second)]
    pipeline.split([first, second], [0, 2], lambda module, index: (module, index), 4)
    assert sorted(pipeline.state_dict()) == sorted(k for k in model.state_dict() if not k.startswith("layers.2."))
    assert [dict(stage.named_parameters()) for stage in (first, second)] == before  # the stages themselves unchanged
    kept = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert kept == {id(p) for p in pipeline.parameters()} and id(model.layers[2].weight) not in kept
    assert set(optimizer.state) == set(pipeline.parameters())  # the momentum of the kept parameters stays
    assert pipeline.whole_model is None and pipeline.whole_model_keys == frozenset(model.state_dict())


def test_a_stage_that_does_not_keep_the_whole_models_names_is_refused_naming_the_rule() -> None:
    model = _Net()
    renamed = nn.Module()
    renamed.first = model.layers[0]  # `first.weight`: the whole model calls it `layers.0.weight`
    with pytest.raises(PipelineError, match=r"stage 1 of the split names its tensors \['first.bias', 'first.weight'\], which are"
                       r" not names of the whole model .* A split function can deep-copy the model"):
        PipelineModule(model).split([renamed], [1], lambda module, index: None, 2)


def test_zero_grad_starts_the_count_of_summed_microbatches_again() -> None:
    model = _Net()
    pipeline = PipelineModule(model)
    optimizer = torch.optim.SGD(pipeline.parameters(), lr=0.1)
    pipeline.follow(optimizer)
    for parameter in model.parameters():
        parameter.grad = torch.full_like(parameter, 6.0)
    pipeline.note_microbatches(4)
    optimizer.zero_grad(set_to_none=False)  # zeroed, not None: the count must start again all the same
    for parameter in model.parameters():
        parameter.grad += 6.0
    pipeline.note_microbatches(3)
    pipeline.average_gradients()
    assert all(torch.equal(p.grad, torch.full_like(p, 2.0)) for p in model.parameters())


def test_an_optimizer_over_a_parameter_of_another_model_cannot_follow_the_split() -> None:
    with pytest.raises(PipelineError, match="holds a parameter that is not the model's"):
        _keep_stage_parameters(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1.0), {}, {})


# ---- real jobs -------------------------------------------------------------------------------------------------

PAIRS = [
    # (processes, arguments, what it shows)
    pytest.param(2, ["--schedule", "GPipe", "--eval", "--setup-together"], id="GPipe-2-eval-setup"),
    pytest.param(2, ["--schedule", "1F1B", "--accumulate", "2", "--clip", "0.5"], id="1F1B-2-accumulate-clip"),
    pytest.param(2, ["--schedule", "Interleaved1F1B", "--dtype", "float64", "--optimizer", "adamw"], id="Interleaved1F1B-2-fp64"),
    pytest.param(2, ["--schedule", "ZBVZeroBubble", "--eval"], id="ZBVZeroBubble-2-eval"),
    pytest.param(2, ["--schedule", "1F1B", "--split", "function"], id="1F1B-2-split-function"),
    pytest.param(4, ["--pp", "4", "--schedule", "GPipe"], id="GPipe-4"),
    pytest.param(4, ["--pp", "4", "--schedule", "1F1B", "--clip", "0.5"], id="1F1B-4-clip"),
    pytest.param(4, ["--pp", "4", "--schedule", "Interleaved1F1B", "--microbatches", "8"], id="Interleaved1F1B-4"),
    pytest.param(4, ["--pp", "4", "--schedule", "ZBVZeroBubble", "--microbatches", "8", "--eval"], id="ZBVZeroBubble-4-eval"),
    pytest.param(4, ["--dp", "2", "--shard", "fsdp", "--optimizer", "adamw"], id="pp2-dp2-FSDP2"),
    pytest.param(4, ["--dp", "2", "--shard", "ddp"], id="pp2-dp2-DDP"),
    pytest.param(4, ["--tp", "2", "--accumulate", "2"], id="pp2-tp2"),
]


def _ranks(out: Path) -> tuple[dict, list, dict, list]:
    params, state, losses, evals = {}, {}, None, []
    for path in sorted(glob.glob(str(out / "rank*.pt"))):
        result = torch.load(path, weights_only=False)
        params.update(result["params"])
        state.update(result["state"])
        assert losses is None or result["losses"] == losses, "every rank returns the same step losses"
        losses = result["losses"]
        evals.append(result.get("eval_loss"))
    return params, state, losses or [], evals


def compare_with_reference(out: Path, float64: bool) -> None:
    reference = torch.load(out / "reference.pt")
    params, state, losses, evals = _ranks(out)
    loss_tolerance, tensor_tolerance = (1e-12, 1e-12) if float64 else (1e-6, 1e-5)
    assert len(losses) == len(reference["losses"])
    for got, want in zip(losses, reference["losses"]):
        assert abs(got - want) <= loss_tolerance * abs(want), (losses, reference["losses"])
    assert set(params) == set(reference["params"])
    for name, value in reference["params"].items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=tensor_tolerance, msg=name)
    assert set(state) == set(reference["state"])
    for name, values in reference["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                torch.testing.assert_close(state[name][key], value, rtol=0, atol=tensor_tolerance, msg=f"{name} {key}")
    if "eval_loss" in reference:
        assert all(abs(value - reference["eval_loss"]) <= loss_tolerance * abs(reference["eval_loss"]) for value in evals), evals


@pytest.mark.procs
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("processes", "arguments"), PAIRS)
def test_a_pipeline_equals_one_process_running_the_same_microbatches(tmp_path: Path, processes: int, arguments: list[str]) -> None:
    arguments = arguments if "--pp" in arguments else ["--pp", "2", *arguments]
    run([sys.executable, str(JOB), str(tmp_path), *arguments, "--pp", "0"], timeout=120, env=clean_env())
    run(fabric_run("--devices", processes, JOB, tmp_path, *arguments), timeout=200, env=clean_env(OMP_NUM_THREADS="1"))
    compare_with_reference(tmp_path, float64="float64" in arguments)
    if "--setup-together" in arguments:  # a plain forward and fabric.backward are refused, naming pipeline_step
        for path in glob.glob(str(tmp_path / "rank*.pt")):
            refused = torch.load(path, weights_only=False)["refused"]
            assert len(refused) == 2 and all("fabric.pipeline_step(model, *inputs, target=target, loss_fn=loss_fn)" in text for text in refused)


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_a_true_precision_converts_the_inputs_as_a_forward_does(tmp_path: Path) -> None:
    run(fabric_run("--devices", 2, "--precision", "bf16-true", JOB, tmp_path, "--pp", "2", "--steps", "2"), timeout=100,
        env=clean_env(OMP_NUM_THREADS="1"))
    _, _, losses, _ = _ranks(tmp_path)
    assert len(losses) == 2 and all(0 < loss < 10 for loss in losses)


@pytest.mark.procs
@pytest.mark.cold
@pytest.mark.timing
@pytest.mark.timeout(120)
def test_a_stage_rank_killed_mid_schedule_ends_the_job_within_seconds_naming_it(tmp_path: Path) -> None:
    """Rank 1 (the last stage) SIGKILLs itself in its second step, while rank 0 is blocked in a send or receive."""
    started = time.monotonic()
    result = run(fabric_run("--devices", 2, JOB, tmp_path, "--pp", "2", "--steps", "4", "--die-rank", "1", "--die-at", "1"),
                 timeout=100, env=clean_env(OMP_NUM_THREADS="1"), check=False)
    took = time.monotonic() - started
    assert result.returncode == 128 + 9 or result.returncode == -9 or result.returncode == 137, result.stderr[-3000:]
    assert "rank 1 was killed by SIGKILL" in result.stderr, result.stderr[-3000:]
    assert took < 40, took


# ---- checkpoints ---------------------------------------------------------------------------------------------------


def _run_in(processes: int | str, out: Path, *arguments: str) -> None:
    if processes == "plain":  # one process, a plain Fabric
        run([sys.executable, str(JOB), str(out), *arguments, "--pp", "-1"], timeout=150, env=clean_env(OMP_NUM_THREADS="1"))
    else:
        run(fabric_run("--devices", processes, JOB, out, *arguments), timeout=200, env=clean_env(OMP_NUM_THREADS="1"))


@pytest.mark.procs
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("saving", "loading", "data_parallel"),
    [
        pytest.param((2, ["--pp", "2"]), (4, ["--pp", "4"]), 1, id="pp2-into-pp4"),
        pytest.param((2, ["--pp", "2"]), (4, ["--pp", "4", "--split-first"]), 1, id="pp2-into-pp4-split-stages"),
        pytest.param((4, ["--pp", "2", "--dp", "2", "--shard", "fsdp"]), ("plain", ["--dp", "2"]), 2, id="pp2xdp2-into-one-process"),
        pytest.param((2, ["--pp", "1", "--dp", "2", "--shard", "fsdp"]), (4, ["--pp", "2", "--dp", "2", "--shard", "fsdp"]), 2,
                     id="pp1-into-pp2xdp2"),
    ],
)
def test_a_checkpoint_of_one_layout_goes_on_exactly_in_another(tmp_path: Path, saving, loading, data_parallel: int) -> None:
    """Two steps in one layout, saved (AdamW: its moments go along); two more in another, loaded before its first step
    (into the whole model, which the split then cuts) or after the split (``--split-first``: each rank loads its part).
    The four steps equal one process running the same microbatches."""
    checkpoint = tmp_path / "checkpoint"
    _run_in(saving[0], tmp_path / "first", *saving[1], "--optimizer", "adamw", "--steps", "2", "--save", str(checkpoint))
    _run_in(loading[0], tmp_path / "then", *loading[1], "--optimizer", "adamw", "--steps", "2", "--first-step", "2", "--load", str(checkpoint))
    run([sys.executable, str(JOB), str(tmp_path / "then"), "--dp", str(data_parallel), "--optimizer", "adamw", "--steps", "4", "--pp", "0"],
        timeout=120, env=clean_env())
    reference = torch.load(tmp_path / "then" / "reference.pt")
    params, state = {}, {}
    for path in glob.glob(str(tmp_path / "then" / "*.pt")):
        if not path.endswith("reference.pt"):
            result = torch.load(path, weights_only=False)
            params.update(result["params"])
            state.update(result["state"])
    assert set(params) == set(reference["params"]) and set(state) == set(reference["state"])
    for name, value in reference["params"].items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=1e-5, msg=name)
    for name, values in reference["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[name][key], values[key], rtol=0, atol=1e-5, msg=f"{name} {key}")


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_a_run_resumed_mid_epoch_on_the_same_layout_is_the_uninterrupted_run_and_consolidates(tmp_path: Path) -> None:
    """pp=2 x dp=2 (FSDP2) with a shuffled set-up loader: 3 steps, saved, 3 more after a resume, equal to 6 steps in one
    go, bit for bit; `fabric-torch consolidate` makes one file of the whole model from the pipeline's checkpoint."""
    layout = ["--pp", "2", "--dp", "2", "--shard", "fsdp", "--optimizer", "adamw", "--loader"]
    checkpoint = tmp_path / "checkpoint"
    _run_in(4, tmp_path / "whole", *layout, "--steps", "6")
    _run_in(4, tmp_path / "first", *layout, "--steps", "3", "--save", str(checkpoint))
    _run_in(4, tmp_path / "resumed", *layout, "--steps", "3", "--load", str(checkpoint))
    whole, _, losses, _ = _ranks(tmp_path / "whole")
    resumed, _, resumed_losses, _ = _ranks(tmp_path / "resumed")
    assert losses == _ranks(tmp_path / "first")[2] + resumed_losses
    assert set(whole) == set(resumed) and all(torch.equal(whole[name], resumed[name]) for name in whole)
    run([sys.executable, "-m", "fabric", "consolidate", str(checkpoint), str(tmp_path / "one.pt")], timeout=100, env=clean_env())
    consolidated = torch.load(tmp_path / "one.pt", weights_only=True)
    saved = _ranks(tmp_path / "first")[0]
    assert set(consolidated["model"]) == set(saved)
    assert all(torch.equal(consolidated["model"][name], saved[name]) for name in saved)
    assert len(consolidated["optimizer"]["state"]) == len(saved)  # every stage's moments


@pytest.mark.procs
@pytest.mark.timeout(200)
def test_a_checkpoint_of_another_model_is_refused_on_every_stage_naming_the_keys(tmp_path: Path) -> None:
    """A checkpoint of 8 hidden layers into 10, on 2 stages: the keys are the whole model's on every rank, so each
    rank (also the one whose stage has no new layer) refuses it, naming them, before anything changes."""
    checkpoint = tmp_path / "checkpoint"
    _run_in(2, tmp_path / "first", "--pp", "2", "--steps", "1", "--save", str(checkpoint))
    result = run(fabric_run("--devices", 2, JOB, tmp_path / "then", "--pp", "2", "--layers", "10", "--split-first", "--load", checkpoint),
                 timeout=150, env=clean_env(OMP_NUM_THREADS="1"), check=False)
    assert result.returncode != 0
    assert "rank 0, 1 raised CheckpointMismatchError" in result.stderr, result.stderr[-3000:]
    assert "missing keys ['layers.8.bias', 'layers.8.weight', 'layers.9.bias', 'layers.9.weight']" in result.stderr, result.stderr[-3000:]


def test_one_file_of_a_pipeline_is_refused_naming_consolidate() -> None:
    with pytest.raises(ValueError, match=r"save_distributed_checkpoint=False cannot be used with pipeline_parallel_size=2.*"
                       "fabric-torch consolidate"):
        ModelParallelStrategy(_parallelize, save_distributed_checkpoint=False, pipeline_parallel_size=2, pipeline_split=["x"])
