"""Behaviour a Lightning Fabric user relies on when switching the import: signatures, wrappers, callbacks, helpers, errors.

Each test pins one public behaviour of Lightning Fabric 2.6.6 (or a deliberate, documented difference:
README "Differences from Lightning Fabric"). Where a test says "observed", the same calls were run with
lightning-fabric 2.6.6 on torch 2.13.0 (CPU) in a scratch environment and gave what the test asserts.

The signatures of Lightning's ``Fabric`` are in ``support/lightning_fabric_2_6_6_signatures.json``, written
by ``scripts/lightning_signatures.py`` (its docstring says how to regenerate it); Lightning itself is never
imported here.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import sys
import warnings
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, SequentialSampler

from fabric import Fabric
from fabric.strategies import DataParallelStrategy
from fabric.utilities.rank_zero import LightningDeprecationWarning
from fabric.wrappers import is_wrapped, unwrap
from support import TESTS
from support.environment import isolate, job_environment
from support.loading import script_path
from support.public_members import describe
from support.scripts.ddp import dropin_checks

pytestmark = pytest.mark.usefixtures("clean_fabric_env")

LIGHTNING_SIGNATURES = TESTS / "support" / "lightning_fabric_2_6_6_signatures.json"

#: Our public members that Lightning's Fabric lacks, each with the reason we add it.
EXTRA_MEMBERS = {
    "batch_to_device": "moves a batch as the strategy does (DataParallel keeps it on the CPU); Lightning has it on its strategies only",
    "reduce_boolean_decision": "the strategy's agreement on one flag, e.g. any rank asks to stop; Lightning has it on its strategies only",
    "preempted": "a collective flag: the cluster warned a rank that it will take the machine (docs/preemption.md)",
    "pipeline_step": "a step of a pipeline-parallel model (docs/pipeline.md); Lightning has no pipeline parallelism",
}
#: Our parameters that Lightning's methods lack, each with the reason; they come after Lightning's, with defaults.
EXTRA_PARAMETERS = {
    ("save", "async_save"): "writes the checkpoint in the background once the tensors are copied off",
}


def cpu_fabric(**kwargs) -> Fabric:
    return Fabric(accelerator="cpu", devices=1, **kwargs)


def dp_fabric() -> Fabric:
    """One process whose module is wrapped (DataParallel): the smallest set-up where a method can bypass a wrapper.

    (On a machine with a GPU, DataParallel always uses the GPUs, so the test does too.)
    """
    return Fabric(accelerator="cuda" if torch.cuda.is_available() else "cpu", devices=1, strategy=DataParallelStrategy())


# ---- Lightning Fabric 2.6.6's public API, member by member ----------------------------------------------


def lightning_members() -> dict[str, dict]:
    record = json.loads(LIGHTNING_SIGNATURES.read_text())
    assert (record["package"], record["version"], record["class"]) == ("lightning-fabric", "2.6.6", "lightning_fabric.Fabric")
    return record["members"]


def test_every_lightning_member_is_here_with_its_kind():
    ours, theirs = describe(Fabric), lightning_members()
    assert len(theirs) > 30  # the file really lists Fabric's members
    missing = sorted(set(theirs) - set(ours))
    assert not missing, f"Lightning Fabric 2.6.6 has these public members and we do not: {missing}"
    for name, member in theirs.items():
        assert ours[name]["kind"] == member["kind"], name
        if member["kind"] == "property":
            assert ours[name]["settable"] == member["settable"], name
    unexplained = sorted(set(ours) - set(theirs) - set(EXTRA_MEMBERS))
    assert not unexplained, f"public members Lightning lacks: add each to EXTRA_MEMBERS with its reason: {unexplained}"
    assert set(EXTRA_MEMBERS) <= set(ours) - set(theirs)  # no stale entry


@pytest.mark.parametrize("name", sorted(n for n, m in json.loads(LIGHTNING_SIGNATURES.read_text())["members"].items() if "parameters" in m))
def test_every_lightning_parameter_has_the_same_name_kind_and_default(name):
    theirs = lightning_members()[name]["parameters"]
    ours = describe(Fabric)[name]["parameters"]
    extras = [p for p in ours if (name, p["name"]) in EXTRA_PARAMETERS]
    assert [p for p in ours if p not in extras] == theirs, f"Fabric.{name}: parameters differ from Lightning Fabric 2.6.6's"
    variadic_keywords = [i for i, p in enumerate(ours) if p["kind"] == "VAR_KEYWORD"]
    last_of_theirs = max((ours.index(p) for p in theirs if p["kind"] != "VAR_KEYWORD"), default=-1)
    for extra in extras:  # an addition never shifts or captures an argument written for Lightning
        assert ours.index(extra) > last_of_theirs, (name, extra)
        assert extra["kind"] == "KEYWORD_ONLY" or extra["default"] is not None, (name, extra)
        assert not variadic_keywords or ours.index(extra) < variadic_keywords[0], (name, extra)


def test_extra_parameters_are_ours_alone():
    theirs = lightning_members()
    for member, parameter in EXTRA_PARAMETERS:
        assert parameter not in [p["name"] for p in theirs[member]["parameters"]]
        assert parameter in inspect.signature(getattr(Fabric, member)).parameters


def test_the_constructor_takes_keywords_only():
    """Observed: ``lightning_fabric.Fabric("cpu")`` raises TypeError (every argument is keyword-only)."""
    with pytest.raises(TypeError, match="positional"):
        Fabric("cpu")  # type: ignore[misc]


# ---- setup(..., scheduler=) and _reapply_compile, side by side with Lightning ----------------------------------------


def model_and_sgd(lr: float = 1.0) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(2, 1)
    return model, torch.optim.SGD(model.parameters(), lr=lr)


def test_setup_returns_the_scheduler_last_as_given():
    """Observed on lightning-fabric 2.6.6: ``setup(model, opt, scheduler=s)`` returns ``(module, opt, s)``, ``s`` itself
    (not wrapped); with two optimizers ``(module, opt1, opt2, s)``; ``scheduler=None`` adds nothing; after
    ``optimizer.step(); scheduler.step()`` the learning rate is 0.5 (StepLR, gamma 0.5) and nothing warns."""
    fabric = cpu_fabric()
    model, optimizer = model_and_sgd()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    returned = fabric.setup(model, optimizer, scheduler=scheduler)
    assert len(returned) == 3 and returned[2] is scheduler and scheduler.optimizer is optimizer
    wrapped_model, wrapped_optimizer, _ = returned
    assert unwrap(wrapped_model) is model and wrapped_optimizer.optimizer is optimizer
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        fabric.backward(wrapped_model(torch.ones(1, 2)).sum())
        wrapped_optimizer.step()
        scheduler.step()
    assert wrapped_optimizer.param_groups[0]["lr"] == 0.5 == optimizer.param_groups[0]["lr"]

    model, first = model_and_sgd()
    second = torch.optim.Adam(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(first, step_size=1)
    returned = fabric.setup(model, first, second, scheduler=scheduler)
    assert [type(x).__name__ for x in returned] == ["FabricModule", "FabricSGD", "FabricAdam", "StepLR"]
    assert returned[3] is scheduler
    assert len(fabric.setup(*model_and_sgd(), scheduler=None)) == 2


def test_setup_with_reapply_compile_false_wraps_the_compiled_module_as_it_is():
    """Lightning's ``_reapply_compile=False`` (observed on 2.6.6: the forward module is the user's ``OptimizedModule``, not
    compiled again). There its ``.module`` raises TypeError and its keys start with ``_orig_mod.``; here ``.module`` is
    the user's model and the keys are the model's (README "Differences from Lightning Fabric")."""
    for setup in (lambda f, m: f.setup(m, _reapply_compile=False), lambda f, m: f.setup_module(m, True, False)):
        plain = nn.Linear(2, 2)
        compiled = torch.compile(plain, backend="eager")
        model = setup(cpu_fabric(), compiled)
        assert model._forward_module is compiled and model.module is plain
        assert sorted(model.state_dict()) == ["bias", "weight"]
        torch.testing.assert_close(model(torch.ones(1, 2)), plain(torch.ones(1, 2)))


def test_the_same_module_set_up_twice_on_one_device_gets_a_second_wrapper():
    """Observed on lightning-fabric 2.6.6: accepted, a new wrapper around the same module (single device and ddp_spawn;
    under DDP gradients still average, see ``test_ddp_the_same_module_set_up_twice_still_averages``)."""
    fabric = cpu_fabric()
    model = nn.Linear(2, 1)
    first, second = fabric.setup(model), fabric.setup_module(model)
    assert first is not second and first.module is model and second.module is model


# ---- sharded_model(), run() and launch(), side by side with Lightning ----------------------------------------------------


def test_sharded_model_warns_that_it_is_deprecated_and_does_nothing():
    """Observed on lightning-fabric 2.6.6: ``sharded_model()`` warns a ``LightningDeprecationWarning`` (a DeprecationWarning
    shown by default) naming ``init_module``, and on a single device returns a ``nullcontext`` under which a model is
    created as usual (on the CPU, float32, also with precision "bf16-true")."""
    for precision in ("32-true", "bf16-true"):
        fabric = cpu_fabric(precision=precision)
        with pytest.warns(LightningDeprecationWarning, match=r"sharded_model\(\) is deprecated.*init_module\(\)") as record:
            context = fabric.sharded_model()
        assert record[0].filename == __file__  # the warning points at the caller's line
        assert isinstance(context, nullcontext)
        with context:
            model = nn.Linear(2, 2)
        assert model.weight.device.type == "cpu" and model.weight.dtype == torch.float32


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_the_deprecation_is_shown_by_default(tmp_path, subprocess_env):
    """Observed on lightning-fabric 2.6.6: without any warning filter, a call from a user's module (not ``__main__``, where
    Python hides a DeprecationWarning) prints the warning on stderr, at Lightning's own line; ours names the user's."""
    import subprocess

    (tmp_path / "user_code.py").write_text("def build(fabric):\n    with fabric.sharded_model():\n        pass\n")
    program = "from fabric import Fabric; import user_code; user_code.build(Fabric(accelerator='cpu', devices=1))"
    result = subprocess.run(
        [sys.executable, "-c", program], cwd=tmp_path, env=subprocess_env, capture_output=True, text=True, timeout=100
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "user_code.py:2: LightningDeprecationWarning: Fabric.sharded_model() is deprecated" in result.stderr


def test_sharded_model_before_launch_is_refused_after_the_warning():
    """Observed on lightning-fabric 2.6.6: with DDP on 2 devices, before ``launch()``, it warns, then raises RuntimeError."""
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    with pytest.warns(LightningDeprecationWarning), pytest.raises(RuntimeError, match=r"sharded_model\(\) was called before Fabric\.launch\(\)"):
        fabric.sharded_model()


class RunsItself(Fabric):
    def run(self, x, y=1):
        return {"x": x, "y": y, "world_size": self.world_size}


def test_run_launches_and_calls_the_override():
    """Observed on lightning-fabric 2.6.6: a subclass's ``run(3, y=4)`` returns the override's value; ``Fabric.run`` of the
    base class returns None; ``run`` after ``launch`` and ``launch`` after ``run`` both work; ``run`` twice runs twice."""
    fabric = RunsItself(accelerator="cpu", devices=1)
    assert fabric.run(3, y=4) == {"x": 3, "y": 4, "world_size": 1}
    assert fabric.launch() is None
    assert fabric.run(5) == {"x": 5, "y": 1, "world_size": 1}
    assert cpu_fabric().run(1, 2, a=3) is None
    launched = RunsItself(accelerator="cpu", devices=1)
    launched.launch()
    assert launched.run(2)["x"] == 2


def test_launch_again_runs_again():
    """Observed on lightning-fabric 2.6.6 (its docstring: "a no-op when called multiple times and no function is passed"):
    a second ``launch()`` returns None, a second ``launch(function)`` runs the function again."""
    fabric = cpu_fabric()
    assert fabric.launch() is None and fabric.launch() is None
    assert fabric.launch(lambda f: 1) == 1 and fabric.launch(lambda f, k: k, 2) == 2


@pytest.mark.parametrize(("function", "named"), [(None, "got None"), (lambda: 1, "takes no argument")])
def test_launch_refuses_what_it_cannot_call_with_the_fabric(function, named):
    """Observed on lightning-fabric 2.6.6: ``launch(None)`` and ``launch(lambda: 1)`` raise TypeError before anything starts."""
    with pytest.raises(TypeError, match=named):
        cpu_fabric().launch(function)


# ---- FabricModule: device, dtype, methods other than forward -------------------------------------------


@pytest.mark.parametrize(("precision", "dtype"), [("32-true", torch.float32), ("64-true", torch.float64), ("bf16-true", torch.bfloat16)])
def test_module_device_and_dtype(precision, dtype):
    model = cpu_fabric(precision=precision).setup(nn.Linear(2, 2))
    assert model.device == torch.device("cpu")
    assert model.dtype == dtype


def test_device_and_dtype_of_a_module_without_parameters():
    model = cpu_fabric().setup(nn.ReLU())
    assert model.device == torch.device("cpu") and model.dtype == torch.float32


def test_an_unmarked_method_that_bypasses_the_wrapper_raises():
    fabric = dp_fabric()
    model = fabric.setup(dropin_checks.StepModel())
    with pytest.raises(RuntimeError, match=r"StepModel.evaluate\(\).*mark_forward_method\('evaluate'\)"):
        model.evaluate(fabric.to_device(torch.ones(2, 4)))
    # methods that run no submodule are fine; so is everything without a wrapper
    assert model.extra_repr() == ""
    single = cpu_fabric().setup(dropin_checks.StepModel())
    assert single.evaluate(torch.ones(2, 4)).shape == ()


def test_a_marked_method_runs_through_the_wrapper():
    model = dp_fabric().setup(dropin_checks.StepModel())
    calls = []
    model._forward_module.register_forward_pre_hook(lambda module, args: calls.append(type(module).__name__))
    model.mark_forward_method("training_step")
    loss = model.training_step(torch.ones(2, 4))
    assert calls == ["DataParallel"] and loss.shape == ()
    assert "forward" not in model.module.__dict__  # the redirection is undone after the call
    model.mark_forward_method(model.module.evaluate)  # a bound method works as well as its name
    model.evaluate(torch.ones(2, 4))
    assert calls == ["DataParallel", "DataParallel"]


def test_mark_forward_method_checks_its_argument():
    model = cpu_fabric().setup(dropin_checks.StepModel())
    with pytest.raises(TypeError, match="takes a method or its name, got int"):
        model.mark_forward_method(1)
    with pytest.raises(ValueError, match="forward always runs through the strategy"):
        model.mark_forward_method("forward")
    with pytest.raises(AttributeError, match=r"StepModel\.missing is not a method"):
        model.mark_forward_method("missing")


# ---- torch.compile ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("make_fabric", [cpu_fabric, dp_fabric], ids=["single_device", "dp"])
def test_setup_of_a_compiled_module_compiles_the_wrapper_again(make_fabric):
    from torch._dynamo.eval_frame import OptimizedModule

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    compiled = torch.compile(plain, backend="eager")
    fabric = make_fabric()
    model, optimizer = fabric.setup(compiled, torch.optim.SGD(plain.parameters(), lr=0.1))
    ones = fabric.to_device(torch.ones(3, 4))
    assert isinstance(model._forward_module, OptimizedModule)
    assert model._forward_module.dynamo_ctx is compiled.dynamo_ctx  # the same backend and options
    assert model.module is plain and unwrap(model) is plain
    assert sorted(model.state_dict()) == sorted(plain.state_dict())  # no wrapper prefixes
    expected = plain(ones)
    torch.testing.assert_close(model(ones), expected)
    fabric.backward(model(ones).sum())
    optimizer.step()
    assert all(p.grad is not None for p in plain.parameters())


def test_setup_module_of_a_compiled_module():
    from torch._dynamo.eval_frame import OptimizedModule

    plain = nn.Linear(3, 2)
    model = dp_fabric().setup_module(torch.compile(plain, backend="eager"))
    assert isinstance(model._forward_module, OptimizedModule) and model.module is plain
    assert type(model._forward_module._orig_mod).__name__ == "DataParallel"
    assert sorted(model.state_dict()) == ["bias", "weight"]


def test_is_wrapped_sees_through_compile():
    model = cpu_fabric().setup(nn.Linear(2, 2))
    compiled = torch.compile(model, backend="eager")
    assert is_wrapped(compiled) and not is_wrapped(torch.compile(nn.Linear(2, 2), backend="eager"))
    assert unwrap(compiled) is model.module
    with pytest.raises(ValueError, match="already set up"):
        cpu_fabric().setup(compiled)


# ---- the real 2-process DDP job ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    """The job runs as a subclass's ``run`` method, which launches the two processes (as in Lightning Fabric)."""
    directory = tmp_path_factory.mktemp("dropin_job")
    with pytest.MonkeyPatch.context() as mp:
        isolate(mp)
        return dropin_checks.DropinFabric(accelerator="cpu", strategy="ddp_spawn", devices=2).run(str(directory))


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_ddp_run_of_a_subclass_returns_rank_zero_value(ddp_results):
    assert ddp_results["run_on"] == (0, 2)


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_ddp_with_reapply_compile_false_wraps_the_compiled_module(ddp_results):
    """As Lightning 2.6.6 does with ``_reapply_compile=False``: DDP around the user's compiled module (keys stay the model's)."""
    assert ddp_results["not_recompiled_outer"] == "DistributedDataParallel"
    assert ddp_results["not_recompiled_inner"] == "OptimizedModule"
    assert ddp_results["not_recompiled_keys"] == ddp_results["compiled_keys"]
    assert ddp_results["not_recompiled_grads_agree"] is True


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_ddp_the_same_module_set_up_twice_still_averages(ddp_results):
    """Observed with lightning-fabric 2.6.6 (ddp_spawn, 2 CPU processes, inputs 1 and 2): both wrappers give [[1.5, 1.5]]."""
    assert ddp_results["set_up_twice_grads"] == [[[1.5, 1.5]]] * 3


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_ddp_marked_method_synchronizes_gradients(ddp_results):
    assert ddp_results["marked_method_grads_agree"] is True
    assert "mark_forward_method('evaluate')" in ddp_results["unmarked_method"]


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_ddp_compiled_module_is_wrapped_inside_and_synchronizes(ddp_results):
    assert ddp_results["compiled_forward_module"] == "OptimizedModule"
    assert ddp_results["compiled_inner"] == "DistributedDataParallel"
    assert ddp_results["compiled_keys"] == ["layers.0.bias", "layers.0.weight", "layers.2.bias", "layers.2.weight"]
    assert ddp_results["compiled_grads_agree"] is True


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_ddp_is_shared_filesystem(ddp_results):
    assert ddp_results["shared_filesystem"] is True


# ---- callbacks -------------------------------------------------------------------------------------------------


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def on_epoch_end(self, epoch):
        self.calls.append(("on_epoch_end", {"epoch": epoch}))

    def on_after_optimizer_step(self, strategy, optimizer):
        self.calls.append(("on_after_optimizer_step", {"strategy": strategy, "optimizer": optimizer}))


class TakesEverything:
    def __init__(self) -> None:
        self.kwargs: dict = {}

    def on_epoch_end(self, **kwargs):
        self.kwargs = kwargs


def test_call_passes_each_callback_only_what_it_accepts():
    narrow, wide = Recorder(), TakesEverything()
    fabric = cpu_fabric(callbacks=[narrow, wide])
    fabric.call("on_epoch_end", epoch=3, loss=0.5)
    assert narrow.calls == [("on_epoch_end", {"epoch": 3})]
    assert wide.kwargs == {"epoch": 3, "loss": 0.5}


def test_a_callback_attribute_that_is_not_callable_is_skipped_with_a_warning():
    class Odd:
        on_epoch_end = 5

    recorder = Recorder()
    fabric = cpu_fabric(callbacks=[Odd(), recorder])
    with pytest.warns(UserWarning, match="Odd.on_epoch_end: it is not callable"):
        fabric.call("on_epoch_end", epoch=1)
    assert recorder.calls == [("on_epoch_end", {"epoch": 1})]


def test_optimizer_step_calls_on_after_optimizer_step():
    recorder = Recorder()
    fabric = cpu_fabric(callbacks=recorder)
    _model, optimizer = fabric.setup(nn.Linear(2, 1), torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1))
    optimizer.step()
    optimizer.step(closure=lambda: torch.tensor(0.0))
    assert [name for name, _ in recorder.calls] == ["on_after_optimizer_step"] * 2
    kwargs = recorder.calls[0][1]
    assert kwargs["strategy"] is fabric.strategy and kwargs["optimizer"] is optimizer.optimizer
    separately = fabric.setup_optimizers(torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1))
    separately.step()
    assert len(recorder.calls) == 3


@pytest.mark.parametrize("argument", [{"callbacks": 5}, {"callbacks": "mine"}, {"callbacks": [Recorder(), 1.5]}])
def test_callbacks_of_a_wrong_type(argument):
    with pytest.raises(TypeError, match=r"Fabric\(callbacks=...\) got"):
        cpu_fabric(**argument)


@pytest.mark.parametrize("loggers", ["x", 3, [object()]])
def test_loggers_of_a_wrong_type(loggers):
    with pytest.raises(TypeError, match=r"Fabric\(loggers=...\) got .*anything with log_metrics"):
        cpu_fabric(loggers=loggers)


# ---- input checks and errors -------------------------------------------------------------------------------------


def test_setup_dataloaders_refuses_what_is_not_a_dataloader():
    fabric = cpu_fabric()
    with pytest.raises(TypeError, match=r"takes torch\.utils\.data\.DataLoader objects, got list"):
        fabric.setup_dataloaders([torch.ones(2), torch.zeros(2)])
    with pytest.raises(TypeError, match="got generator"):
        fabric.setup_dataloaders(x for x in range(3))


def test_no_backward_sync_needs_a_set_up_module():
    with pytest.raises(TypeError, match="takes the module returned by setup"), cpu_fabric().no_backward_sync(nn.Linear(2, 2)):
        pass


@pytest.mark.parametrize("devices", [1.5, object(), [0], "abc", True])
def test_devices_of_a_wrong_type_raise_type_error(devices):
    with pytest.raises(TypeError, match="is not valid for the CPU accelerator"):
        Fabric(accelerator="cpu", devices=devices)
    with pytest.raises(ValueError, match="is not valid for the CPU accelerator"):  # and, as before, a ValueError
        Fabric(accelerator="cpu", devices=devices)


def test_a_strategy_of_a_wrong_type_raises_value_error():
    with pytest.raises(ValueError, match="must be a name or a Strategy instance, not object"):
        Fabric(accelerator="cpu", strategy=object())


def test_strict_key_mismatch_is_a_runtime_error_and_a_key_error(tmp_path):
    from fabric.utilities.exceptions import CheckpointMismatchError

    fabric = cpu_fabric()
    path = tmp_path / "other.pt"
    torch.save({"other.weight": torch.ones(1)}, path)
    model = nn.Linear(2, 2)
    before = model.weight.detach().clone()
    for load in (lambda: fabric.load_raw(path, model), lambda: fabric.load(tmp_path / "full.pt", {"model": model})):
        fabric.save(tmp_path / "full.pt", {"model": {"other.weight": torch.ones(1)}})
        with pytest.raises(RuntimeError, match="missing keys") as info:
            load()
        assert isinstance(info.value, KeyError) and isinstance(info.value, CheckpointMismatchError)
        assert "does not fit Linear" in str(info.value) and not str(info.value).startswith('"')
    assert torch.equal(model.weight, before)


def test_load_with_a_state_that_is_not_a_dict(tmp_path):
    fabric = cpu_fabric()
    fabric.save(tmp_path / "c.pt", {"step": 1})
    with pytest.raises(TypeError, match=r"load\(state=...\) takes a dict .* got str"):
        fabric.load(tmp_path / "c.pt", state="notadict")


def test_loading_a_text_file_says_it_is_no_checkpoint(tmp_path):
    from fabric.plugins.io import CheckpointLoadError

    path = tmp_path / "notes.txt"
    path.write_text("these are my notes, not a checkpoint\n")
    with pytest.raises(CheckpointLoadError, match="is not a checkpoint file") as info:
        cpu_fabric().load(path)
    assert "KeyError" not in str(info.value) and str(path) in str(info.value)


# ---- to_device -------------------------------------------------------------------------------------------------------


def test_to_device_returns_what_is_already_on_the_device():
    fabric = cpu_fabric()
    x, y = torch.ones(2), torch.zeros(2)
    pair, listed = (x, y), [x, y]
    assert fabric.to_device(pair) is pair and fabric.to_device(x) is x
    # a list comes back new, as from Lightning's collection walk: changing it leaves the caller's list alone
    moved_list = fabric.to_device(listed)
    assert moved_list is not listed and moved_list[0] is x and moved_list[1] is y
    nested = {"x": x, "more": (y, 3)}
    moved = fabric.to_device(nested)
    assert moved["x"] is x and moved["more"][0] is y and moved["more"][1] == 3
    module = nn.Linear(2, 2)
    assert fabric.to_device(module) is module


def test_to_device_moves_what_is_elsewhere():
    fabric = Fabric(accelerator="cpu", devices=1, precision="64-true")
    meta_pair = (torch.empty(2, device="meta"), torch.ones(2))

    class Recording(torch.Tensor):
        pass

    sub = torch.ones(2).as_subclass(Recording)
    assert fabric.to_device(sub).device.type == "cpu"  # a subclass takes the general path
    with pytest.raises(NotImplementedError):  # meta tensors have no data: the move is really attempted
        fabric.to_device(meta_pair)


# ---- public helpers with Lightning's names ----------------------------------------------------------------------------


def test_data_helpers():
    from fabric.utilities.data import AttributeDict, has_iterable_dataset, has_len, sized_len, suggested_max_num_workers

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    assert has_iterable_dataset(DataLoader(Stream())) and not has_iterable_dataset(DataLoader(range(3)))
    assert has_len(DataLoader(range(3))) and not has_len(DataLoader(Stream()))
    with pytest.warns(UserWarning, match="has length 0"):
        assert has_len([])
    assert sized_len([1, 2]) == 2 and sized_len(iter([1])) is None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert suggested_max_num_workers(1) == max(1, cpus - 1)
    assert suggested_max_num_workers(10_000) == 1
    with pytest.raises(ValueError, match="local_world_size=0 must be >= 1"):
        suggested_max_num_workers(0)

    hparams = AttributeDict(lr=0.1, batch_size=32)
    hparams.epochs = 3
    assert hparams["epochs"] == 3 and hparams.lr == 0.1
    del hparams.epochs
    assert "epochs" not in hparams
    with pytest.raises(AttributeError, match="'AttributeDict' object has no attribute 'nope'"):
        hparams.nope  # noqa: B018 - the attribute lookup is what raises
    assert repr(hparams) == '"batch_size": 32\n"lr":         0.1'
    assert repr(AttributeDict()) == ""


def test_distributed_sampler_wrapper_behaves_like_distributed_sampler():
    from torch.utils.data import DistributedSampler

    from fabric.utilities.distributed import DistributedSamplerWrapper, ReduceOp, group, is_shared_filesystem

    data = list(range(8))
    wrapped = DistributedSamplerWrapper(SequentialSampler(data), num_replicas=2, rank=0)
    plain = DistributedSampler(data, num_replicas=2, rank=0)  # shuffle=True by default, in both
    assert list(wrapped) == list(plain) != [0, 2, 4, 6]
    ordered = DistributedSamplerWrapper(SequentialSampler(data), num_replicas=2, rank=1, shuffle=False)
    assert list(ordered) == [1, 3, 5, 7]

    class EpochAware(SequentialSampler):
        epoch = None

        def set_epoch(self, epoch):
            self.epoch = epoch

    inner = EpochAware(data)
    DistributedSamplerWrapper(inner, num_replicas=2, rank=0).set_epoch(4)
    assert inner.epoch == 4
    assert ReduceOp.SUM is torch.distributed.ReduceOp.SUM and group.WORLD is torch.distributed.group.WORLD
    assert is_shared_filesystem(cpu_fabric().strategy)  # one process: trivially shared


def test_rank_zero_helpers(monkeypatch, caplog, recwarn):
    from fabric.utilities import rank_zero

    with caplog.at_level(logging.DEBUG, logger="fabric"):
        rank_zero.rank_zero_info("hello %s", "info")
        rank_zero.rank_zero_debug("hello debug")
        rank_zero.rank_zero_warn("careful")
        rank_zero.rank_zero_deprecation("old")
        monkeypatch.setattr(rank_zero.rank_zero_only, "rank", 1)
        rank_zero.rank_zero_info("not on rank 1")
        rank_zero.rank_zero_warn("not on rank 1")
    assert [r.getMessage() for r in caplog.records] == ["hello info", "hello debug"]
    assert [(type(w.message), str(w.message)) for w in recwarn] == [
        (UserWarning, "careful"),
        (rank_zero.LightningDeprecationWarning, "old"),
    ]
    assert rank_zero.rank_prefixed_message("x", 2) == "[rank: 2] x"
    cache = rank_zero.WarningCache()
    monkeypatch.setattr(rank_zero.rank_zero_only, "rank", 0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cache.warn("once")
        cache.warn("once")
    assert len(seen) == 1


def test_misconfiguration_exception():
    from fabric.utilities.exceptions import MisconfigurationException

    assert issubclass(MisconfigurationException, Exception)
    with pytest.raises(MisconfigurationException, match="bad"):
        raise MisconfigurationException("bad")


def test_find_usable_cuda_devices_without_gpus():
    from fabric.accelerators.cuda import find_usable_cuda_devices

    if torch.cuda.is_available():
        pytest.skip("this checks the behaviour on a machine without GPUs")
    assert find_usable_cuda_devices(0) == []
    with pytest.raises(ValueError, match="no CUDA devices"):
        find_usable_cuda_devices(1)
    with pytest.raises(ValueError, match="num_devices=-2"):
        find_usable_cuda_devices(-2)


# ---- a script in the style of Lightning Fabric's examples ---------------------------------------------------------------


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_a_lightning_style_script_runs_on_one_process(tmp_path, subprocess_env):
    import json
    import subprocess

    script = script_path("dropin", "lightning_style.py")
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], env=subprocess_env, capture_output=True, text=True, timeout=200
    )
    assert result.returncode == 0, result.stderr[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    losses = results["classifier"]["losses"]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert results["classifier"]["accuracy"] > 70
    assert "epoch 3: test loss" in result.stdout
    assert "Seed set to 42" in result.stderr  # shown by default, as Lightning Fabric shows it
    assert len(results["kfold"]["fold_accuracies"]) == 3 and all(0 <= a <= 1 for a in results["kfold"]["fold_accuracies"])
    assert all(v == v for v in results["gan"]["d_losses"] + results["gan"]["g_losses"])  # no NaN
    assert sorted(torch.load(tmp_path / "classifier.pt", weights_only=True)["model"]) == ["net.0.bias", "net.0.weight", "net.2.bias", "net.2.weight"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_devices_inputs_and_batches():
    from fabric.accelerators.cuda import find_usable_cuda_devices

    assert find_usable_cuda_devices(1) == [0] and find_usable_cuda_devices() == list(range(torch.cuda.device_count()))
    fabric = Fabric(accelerator="cuda", devices=1, precision="bf16-mixed")
    seen = {}

    class Probe(nn.Linear):
        def forward(self, x):
            seen["input"] = x.dtype
            return super().forward(x)

    model = fabric.setup(Probe(4, 2))
    assert model.device == fabric.device and model.device.type == "cuda" and model.dtype == torch.float32
    x, y = fabric.to_device((torch.ones(3, 4), torch.zeros(3)))
    assert x.device == fabric.device and y.device == fabric.device
    assert fabric.to_device(x) is x
    assert model(x).dtype == torch.float32 and seen["input"] == torch.bfloat16


def run_two_rank_script(name: str, outdir: Path) -> tuple[list[dict], str]:
    """Run ``support/scripts/dropin/<name>`` as a 2-process popen job; return each rank's JSON report and stderr."""
    import json
    import subprocess

    script = script_path("dropin", name)
    result = subprocess.run(
        [sys.executable, str(script), str(outdir)], env=job_environment(), cwd=outdir, capture_output=True, text=True, timeout=150
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads((outdir / f"rank{r}.json").read_text()) for r in range(2)], result.stderr


@pytest.mark.procs
@pytest.mark.timeout(180)
def test_dp_on_the_cpu_runs_ddp_with_sharded_data(tmp_path):
    ranks, stderr = run_two_rank_script("dp_on_cpu.py", tmp_path)
    assert "strategy='dp' is not supported on the CPU; using strategy='ddp'" in stderr
    assert all(r["strategy"] == "DDPStrategy" and r["world_size"] == 2 for r in ranks)
    # each rank got its own half (DataParallel would have handed this one process all of it)
    assert sorted(ranks[0]["seen"] + ranks[1]["seen"]) == list(range(8))
    assert not set(ranks[0]["seen"]) & set(ranks[1]["seen"])


@pytest.mark.procs
@pytest.mark.timeout(180)
def test_fsdp_compiled_module_is_sharded_inside_and_trains(tmp_path):
    ranks, _ = run_two_rank_script("compiled_fsdp.py", tmp_path)
    for rank, report in enumerate(ranks):
        assert report["outer"] == "OptimizedModule" and report["inner"].startswith("FSDP")
        assert report["keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
        # sharding a module twice would fail inside DTensor: refused by name before anything changes
        assert "Sequential cannot be set up: it was already sharded by an earlier setup() of FSDPStrategy" in report["set_up_again"]
        assert report["sharded_model"] == ["nullcontext"] + ["LightningDeprecationWarning"] * (rank == 0)  # warned on rank 0 only
    assert ranks[0]["losses"] == ranks[1]["losses"]  # one model: the mean loss agrees on both ranks
    assert ranks[0]["losses"][-1] < ranks[0]["losses"][0]


def test_utilities_package_names_and_possible_user_warnings():
    import fabric.utilities as utilities
    from fabric.utilities.warnings import PossibleUserWarning, disable_possible_user_warnings

    for name in ("AttributeDict", "suggested_max_num_workers", "is_shared_filesystem", "Throughput", "ThroughputMonitor",
                 "measure_flops", "move_data_to_device", "rank_zero_deprecation", "rank_zero_info", "rank_zero_only",
                 "rank_zero_warn", "disable_possible_user_warnings"):  # fmt: skip
        assert callable(getattr(utilities, name)), name
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        utilities.nothing  # noqa: B018 - the attribute lookup is what raises
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        disable_possible_user_warnings()
        warnings.warn("maybe a mistake", PossibleUserWarning, stacklevel=1)
        warnings.warn("a real one", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["a real one"]
