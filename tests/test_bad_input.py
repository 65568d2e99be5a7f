"""The issue's checklist of bad input: each one gives a clear error naming the value and changes nothing.

"Changes nothing": a checkpoint file keeps its bytes, a model and optimizer keep their tensors, and
no file appears where a failed call would have written one.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from fabric import Fabric
from fabric.plugins.io import CheckpointLoadError
from support import PYTHON
from support.environment import job_environment
from support.processes import run

pytestmark = pytest.mark.usefixtures("clean_fabric_env")


def cpu_fabric() -> Fabric:
    return Fabric(accelerator="cpu", devices=1)


def trained_pair(hidden: int = 8, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [t.detach().clone() for t in model.state_dict().values()]
    for per_param in optimizer.state.values():
        tensors += [v.clone() for v in per_param.values() if isinstance(v, torch.Tensor)]
    return tensors + [torch.tensor(group["lr"]) for group in optimizer.param_groups]


def assert_unchanged(model: nn.Module, optimizer: torch.optim.Optimizer, before: list[torch.Tensor]) -> None:
    after = snapshot(model, optimizer)
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    model, optimizer = trained_pair(seed=1)
    path = tmp_path / "good.pt"
    cpu_fabric().save(path, {"model": model, "optimizer": optimizer, "step": 3})
    return path


# ---- names ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"strategy": "dpp"}, "strategy='dpp'"),
        ({"accelerator": "tpu"}, "accelerator='tpu'"),
        ({"precision": "17-mixed"}, "precision='17-mixed'"),
    ],
)
def test_unknown_names(kwargs, named):
    with pytest.raises(ValueError, match="accepted") as info:
        Fabric(**kwargs)
    assert named in str(info.value) and "accepted" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"accelerator": "cpu", "devices": 0}, "devices=0"),
        ({"accelerator": "cpu", "devices": -2}, "devices=-2"),
        ({"accelerator": "cpu", "devices": 2.5}, "devices=2.5"),
        ({"accelerator": "cpu", "num_nodes": 0}, "num_nodes=0"),
        ({"accelerator": "cpu", "num_nodes": -1}, "num_nodes=-1"),
    ],
)
def test_devices_and_num_nodes_out_of_range(kwargs, named):
    with pytest.raises(ValueError, match="accepted") as info:
        Fabric(**kwargs)
    assert named in str(info.value)


# ---- set-up and launching ---------------------------------------------------------------------------


def test_setup_twice():
    fabric = cpu_fabric()
    model, optimizer = trained_pair()
    fmodel, foptimizer = fabric.setup(model, optimizer)
    before = snapshot(model, optimizer)
    with pytest.raises(ValueError, match="model was already set up"):
        fabric.setup(fmodel)
    with pytest.raises(ValueError, match="optimizer was already set up"):
        fabric.setup(nn.Linear(1, 1), foptimizer)
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(list(range(4))))
    with pytest.raises(ValueError, match="dataloader was already set up"):
        fabric.setup_dataloaders(loader)
    assert_unchanged(model, optimizer, before)


def scheduled_pair() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    model, optimizer = trained_pair()
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)


def test_setup_of_a_scheduler_without_its_optimizer():
    """Lightning 2.6.6 returns the module alone and drops the scheduler (README "Differences from Lightning Fabric")."""
    model, optimizer, scheduler = scheduled_pair()
    before = snapshot(model, optimizer)
    with pytest.raises(ValueError, match=r"got a StepLR but no optimizer.*fabric\.setup\(model, optimizer, scheduler=scheduler\)"):
        cpu_fabric().setup(model, scheduler=scheduler)
    assert_unchanged(model, optimizer, before)


def test_setup_of_a_scheduler_among_the_optimizers():
    """Lightning 2.6.6 wraps the scheduler as if it were an optimizer (a ``FabricStepLR``)."""
    model, optimizer, scheduler = scheduled_pair()
    with pytest.raises(TypeError, match=r"got a learning-rate scheduler \(StepLR\); pass it by name: .*scheduler=scheduler"):
        cpu_fabric().setup(model, optimizer, scheduler)


@pytest.mark.parametrize("scheduler", ["cosine", 0.5])
def test_setup_of_a_scheduler_that_is_not_one(scheduler):
    """Lightning 2.6.6 hands ``scheduler="cosine"`` back as it is."""
    model, optimizer = trained_pair()
    with pytest.raises(TypeError, match=rf"setup\(scheduler=...\) takes a learning-rate scheduler .* got {type(scheduler).__name__}"):
        cpu_fabric().setup(model, optimizer, scheduler=scheduler)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "64-true"])
def test_backward_of_a_tensor_that_is_not_a_scalar(precision):
    """Lightning 2.6.6 gives torch's "grad can be implicitly created only for scalar outputs", naming no shape."""
    fabric = Fabric(accelerator="cpu", devices=1, precision=precision)
    model = fabric.setup(nn.Linear(2, 3))
    output = model(torch.ones(4, 2))
    with pytest.raises(RuntimeError, match=r"needs a scalar tensor .* got one of shape \(4, 3\); reduce it first \(e\.g\. loss\.mean\(\)") as info:
        fabric.backward(output)
    assert info.value.__cause__ is None and info.value.__suppress_context__  # one message, not torch's under it
    assert model.weight.grad is None
    fabric.backward(output, torch.ones_like(output))  # with its gradient, as torch allows
    fabric.backward(model(torch.ones(1, 2))[:, :1])  # one element: a scalar enough
    assert model.weight.grad is not None


def test_backward_errors_of_other_kinds_stay_torchs():
    with pytest.raises(RuntimeError, match="does not require grad"):
        cpu_fabric().backward(torch.ones(3))


@pytest.mark.parametrize(
    ("name", "call"),
    [
        ("all_reduce", lambda f: f.all_reduce(torch.ones(1))),
        ("all_gather", lambda f: f.all_gather(torch.ones(1))),
        ("broadcast", lambda f: f.broadcast(1)),
        ("barrier", lambda f: f.barrier()),
        ("reduce_boolean_decision", lambda f: f.reduce_boolean_decision(True)),
    ],
)
def test_collectives_before_launch(name, call):
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    with pytest.raises(RuntimeError, match=rf"Fabric\.{name}\(\) was called before Fabric\.launch\(\)"):
        call(fabric)


def test_save_and_load_before_launch_touch_nothing(tmp_path, checkpoint):
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    with pytest.raises(RuntimeError, match=r"Fabric\.save\(\) was called before Fabric\.launch\(\)"):
        fabric.save(tmp_path / "new.pt", {"step": 1})
    assert not (tmp_path / "new.pt").exists()
    model, optimizer = trained_pair(seed=2)
    before, data = snapshot(model, optimizer), checkpoint.read_bytes()
    with pytest.raises(RuntimeError, match=r"Fabric\.load\(\) was called before Fabric\.launch\(\)"):
        fabric.load(checkpoint, {"model": model, "optimizer": optimizer})
    assert_unchanged(model, optimizer, before)
    assert checkpoint.read_bytes() == data


@pytest.mark.parametrize("not_callable", ["train", 3])
def test_launch_of_a_non_callable(not_callable):
    with pytest.raises(TypeError, match=f"takes a callable, got {not_callable!r}"):
        Fabric(accelerator="cpu", strategy="ddp_spawn", devices=2).launch(not_callable)


def test_launch_of_an_unpicklable_function_under_spawn():
    fabric = Fabric(accelerator="cpu", strategy="ddp_spawn", devices=2)
    with pytest.raises(RuntimeError) as info:
        fabric.launch(lambda fabric: None)
    message = str(info.value)
    assert "<lambda>" in message and "could not be pickled" in message  # what and why
    assert "top level" in message and "ddp_fork" in message  # what to do
    assert multiprocessing.active_children() == []  # nothing was started


# A REPL or notebook (sys.ps1, set by Python's REPL and by every IPython shell, Jupyter's kernels included;
# `python -i` sets sys.flags.interactive) is refused before anything starts. A program whose __main__ has
# no file (`python -c`, pytest-xdist's workers) is not a session: it launches functions from modules, and
# only what it cannot do is refused, by the launcher that needs it.


def _train(fabric: Fabric) -> None:
    pass


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn", "ddp_forkserver"])
def test_launch_from_a_repl_or_notebook(monkeypatch, strategy):
    monkeypatch.setattr(sys, "ps1", "In : ", raising=False)
    fabric = Fabric(accelerator="cpu", strategy=strategy, devices=2)
    with pytest.raises(RuntimeError, match="cannot be launched from an interactive session"):
        fabric.launch(_train)
    assert multiprocessing.active_children() == []


_LAUNCH_UNDER_C = """
from fabric import Fabric
from support.scripts.launchers.mp_funcs import world_size_of
print("world size", Fabric(accelerator="cpu", strategy="ddp_spawn", devices=2).launch(world_size_of))
"""

_REFUSED_UNDER_C = """
from fabric import Fabric
def defined_here(fabric): pass
for strategy in ("ddp_spawn", "ddp"):
    try:
        Fabric(accelerator="cpu", strategy=strategy, devices=2).launch(defined_here)
    except RuntimeError as err:
        print(strategy, "refused:", err)
"""


@pytest.mark.procs
@pytest.mark.timeout(200)
def test_launch_from_python_c_and_python_i():
    launched = run([PYTHON, "-c", _LAUNCH_UNDER_C], timeout=100, env=job_environment())
    assert "world size 2" in launched.stdout
    refused = run([PYTHON, "-c", _REFUSED_UNDER_C], timeout=40, env=job_environment()).stdout
    assert "ddp_spawn refused: The function passed to launch() (defined_here) is defined in" in refused
    assert "ddp refused: The 'popen' launcher starts the other processes by running your script again" in refused
    interactive = run([PYTHON, "-i", "-c", _LAUNCH_UNDER_C], timeout=40, env=job_environment(), check=False)
    assert "DDPStrategy cannot be launched from an interactive session" in interactive.stderr
    assert "world size" not in interactive.stdout


# ---- loading bad files ------------------------------------------------------------------------------


def _assert_load_fails_and_changes_nothing(path: Path, error: type[Exception], *named: str) -> None:
    model, optimizer = trained_pair(seed=5)
    before = snapshot(model, optimizer)
    data = path.read_bytes() if path.exists() else None
    with pytest.raises(error) as info:
        cpu_fabric().load(path, {"model": model, "optimizer": optimizer})
    assert str(path) in str(info.value)
    for text in named:
        assert text in str(info.value)
    assert_unchanged(model, optimizer, before)
    assert (path.read_bytes() if path.exists() else None) == data


def test_load_of_a_missing_file(tmp_path):
    _assert_load_fails_and_changes_nothing(tmp_path / "missing.pt", FileNotFoundError)
    assert not (tmp_path / "missing.pt").exists()


def test_load_of_an_empty_file(tmp_path):
    (tmp_path / "empty.pt").touch()
    _assert_load_fails_and_changes_nothing(tmp_path / "empty.pt", CheckpointLoadError, "empty")


@pytest.mark.parametrize("fraction", [0.05, 0.5, 0.95])
def test_load_of_a_truncated_file(tmp_path, checkpoint, fraction):
    data = checkpoint.read_bytes()
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(data[: int(len(data) * fraction)])
    _assert_load_fails_and_changes_nothing(truncated, CheckpointLoadError)


class RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_load_of_a_payload_carrying_file(tmp_path):
    model, optimizer = trained_pair(seed=1)
    path = tmp_path / "payload.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "x": RunsCode(str(tmp_path / "ran"))}, path)
    _assert_load_fails_and_changes_nothing(path, CheckpointLoadError, "weights_only=False")
    assert not (tmp_path / "ran").exists()


def test_load_into_a_model_of_another_shape(checkpoint):
    model, optimizer = trained_pair(hidden=16, seed=5)  # the checkpoint's hidden size is 8
    before, data = snapshot(model, optimizer), checkpoint.read_bytes()
    with pytest.raises(RuntimeError) as info:
        cpu_fabric().load(checkpoint, {"model": model, "optimizer": optimizer})
    message = str(info.value)
    assert "'0.weight'" in message  # the first key that does not fit
    assert "(8, 4)" in message and "(16, 4)" in message
    assert_unchanged(model, optimizer, before)
    assert checkpoint.read_bytes() == data


@pytest.fixture(params=["single file", "full file", "sharded folder"])
def any_format(request, tmp_path) -> Path:
    """The same checkpoint in each format, all written in this process (see ``_load_any``)."""
    from fabric.checkpoint.formats.full import save_full
    from fabric.checkpoint.formats.sharded import save_sharded

    model, optimizer = trained_pair(seed=1)
    state = {"model": model, "optimizer": optimizer, "step": 3, "name": "run-a", "stats": {"mean": torch.ones(2)}}
    path = tmp_path / request.param.replace(" ", "_")
    if request.param == "single file":
        cpu_fabric().save(path, state)
    elif request.param == "full file":
        save_full(path, state)
    else:
        save_sharded(path, state)
    return path


@pytest.mark.parametrize(
    ("key", "given", "needs"),
    [
        ("model", "not a module", "holds a module's state dict under that key, which loads into a torch.nn.Module"),
        ("optimizer", 5, "holds an optimizer's state dict under that key, which loads into a torch.optim.Optimizer"),
        ("model", torch.zeros(2), "holds a module's state dict under that key, which loads into a torch.nn.Module"),
    ],
    ids=["str-for-a-module", "int-for-an-optimizer", "tensor-for-a-module"],
)
def test_load_into_a_value_that_is_not_what_the_entry_needs(any_format, key, given, needs):
    """A str, an int or a tensor where the checkpoint holds a module's or an optimizer's state: refused, naming the
    key, the type given and what the entry needs, before anything changes (Lightning Fabric replaced the value)."""
    from fabric.checkpoint.errors import CheckpointMismatchError

    model, optimizer = trained_pair(seed=5)
    before, data = snapshot(model, optimizer), _bytes_of(any_format)
    state = {"model": model, "optimizer": optimizer, "step": 0, key: given}
    with pytest.raises(CheckpointMismatchError) as info:
        _load_any(any_format, state)
    message = str(info.value)
    assert f"state[{key!r}] is a {type(given).__name__}" in message and needs in message, message
    assert isinstance(info.value, (TypeError, KeyError, ValueError))
    assert state[key] is given and state["step"] == 0
    assert_unchanged(model, optimizer, before)
    assert _bytes_of(any_format) == data


def test_plain_values_are_still_replaced_by_plain_entries(any_format):
    """Ints, strings and a plain dict of tensors (given as a dict or None) take the saved value, as in Lightning Fabric."""
    model, optimizer = trained_pair(seed=5)
    state = {"model": model, "optimizer": optimizer, "step": 0, "name": None, "stats": {}}
    assert _load_any(any_format, state) == {}
    assert state["step"] == 3 and state["name"] == "run-a" and torch.equal(state["stats"]["mean"], torch.ones(2))
    state = {"name": "", "stats": None}
    _load_any(any_format, state, strict=False)
    assert state["name"] == "run-a" and torch.equal(state["stats"]["mean"], torch.ones(2))


def _load_any(path: Path, state: dict, strict: bool = True) -> dict:
    """``fabric.load`` (a single file through the strategy's hooks, a sharded folder), or a full file as a sharded
    strategy reads it (whole tensors handed over by the distributed state-dict API)."""
    if path.name == "full_file":
        from fabric.checkpoint.formats.full import load_full

        return load_full(path, state, strict=strict)
    return cpu_fabric().load(path, state, strict=strict)


def _bytes_of(path: Path) -> dict[str, bytes]:
    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    return {str(file): file.read_bytes() for file in files if file.is_file()}


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_mismatched_collective_shapes_are_named_in_torch_debug_mode(tmp_path):
    """Ranks that all_reduce tensors of different shapes: gloo aborts (nothing hangs); with
    TORCH_DISTRIBUTED_DEBUG=DETAIL, as docs/never_hang.md says, the error names the collective and both shapes."""
    import subprocess
    import sys

    from support.environment import job_environment

    script = tmp_path / "mismatch.py"
    script.write_text(
        "import torch\nfrom fabric import Fabric\n"
        "fabric = Fabric(accelerator='cpu', devices=2, strategy='ddp')\nfabric.launch()\n"
        "fabric.all_reduce(torch.ones(3 if fabric.global_rank == 0 else 4))\n"
    )
    env = job_environment(TORCH_DISTRIBUTED_DEBUG="DETAIL")
    result = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=100)
    assert result.returncode != 0
    # whichever rank's report comes first names the shapes, its own first
    shapes_named = "Tensor shapes: 3vs 4" in result.stderr or "Tensor shapes: 4vs 3" in result.stderr
    assert "OpType=ALLREDUCE" in result.stderr and shapes_named, result.stderr[-3000:]
