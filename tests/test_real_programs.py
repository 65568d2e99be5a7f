"""What real Lightning Fabric programs (its examples, applications built on it) rely on beyond the API's names:
a LightningModule attached to Fabric, torch.distributed usable right after ``Fabric()`` under ``fabric run``,
collectives objects with groups of their own, loggers whose experiment works on every rank, a metric named
"step", a loader with its own state, the random generators left where the script put them, the threads each
rank gets. Each multi-process test runs a real job with a timeout."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric
from fabric.loggers import CSVLogger
from fabric.loggers.logger import NoOpExperiment, rank_zero_experiment
from fabric.utilities.rank_zero import rank_zero_only
from support import PYTHON
from support.environment import clean_env
from support.loading import script_path
from support.processes import fabric_run, run

CORES = len(os.sched_getaffinity(0))


def _reports(out: Path, ranks: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(ranks)]


# ---- one 2-process job: fabric run, fabric.launch() with popen and spawn ---------------------------------


def _check_patterns(reports: list[dict[str, Any]], threads: int) -> None:
    for rank, report in enumerate(reports):
        assert report["all_reduce"] == 3.0
        assert report["module_fabric_is_ours"] and report["module_optimizers"] == [True]
        assert report["module_is_callback"], "the LightningModule-style module must receive fabric.call hooks"
        assert report["grads_agree"], "training_step must run through DDP (gradients synchronized)"
        assert report["rng_kept_by_setup"]
        assert report["threads"] == threads
        assert report["experiment"] == ("CSVLogger" if rank == 0 else "NoOpExperiment")


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_patterns_under_fabric_run(tmp_path: Path) -> None:
    run(fabric_run("--accelerator", "cpu", "--devices", "2", script_path("dropin", "real_patterns.py"), tmp_path), timeout=110)
    reports = _reports(tmp_path, 2)
    _check_patterns(reports, threads=max(1, CORES // 2))
    for report in reports:
        assert report["joined_at_creation"], "under fabric run, Fabric() must join the process group at once"
        assert report["rng_kept_by_join"], "joining must not reseed a process that has seeded"


@pytest.mark.procs
@pytest.mark.timeout(120)
@pytest.mark.parametrize("launch", ["popen", "spawn"])
def test_patterns_under_launch(tmp_path: Path, launch: str) -> None:
    run([PYTHON, str(script_path("dropin", "real_patterns.py")), str(tmp_path), "--launch", launch], timeout=110)
    reports = _reports(tmp_path, 2)
    _check_patterns(reports, threads=max(1, CORES // 2))
    for report in reports:
        assert not report["joined_at_creation"], "without fabric run, the group is joined at launch()"
        if launch == "popen":
            assert report["rng_kept_by_join"] and not report["rng_is_seed_state"]
        else:  # a spawned worker starts unseeded and takes the seed the parent set
            assert report["rng_is_seed_state"]


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_a_thread_count_the_user_set_is_kept(tmp_path: Path) -> None:
    env = clean_env(OMP_NUM_THREADS="2")
    run([PYTHON, str(script_path("dropin", "real_patterns.py")), str(tmp_path), "--launch", "popen"], timeout=110, env=env)
    assert [report["threads"] for report in _reports(tmp_path, 2)] == [2, 2]


@pytest.mark.procs
@pytest.mark.timeout(150)
def test_collectives_with_groups_of_their_own_beside_ddp(tmp_path: Path) -> None:
    run(fabric_run("--accelerator", "cpu", "--devices", "3", script_path("dropin", "decoupled.py"), tmp_path), timeout=140)
    player, first, second = _reports(tmp_path, 3)
    assert first["weights"] == second["weights"], "the trainers' DDP over their own group must keep them equal"
    assert player["weights"] == first["weights"], "the player must receive the trained weights over its group"
    assert player["group_size"] == 2


# ---- single-process checks -------------------------------------------------------------------------------


class _LightningStyle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self._fabric: Any = None
        self._fabric_optimizers: list[Any] = []
        self.layer = nn.Linear(2, 2)
        self.calls: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def on_validation_epoch_end(self) -> None:
        self.calls.append("on_validation_epoch_end")

    def on_after_optimizer_step(self, strategy: Any, optimizer: Any) -> None:
        self.calls.append("on_after_optimizer_step")


def test_setup_attaches_a_lightning_style_module_once() -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    module = _LightningStyle()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    model, fabric_optimizer = fabric.setup(module, optimizer)
    assert module._fabric is fabric and module._fabric_optimizers == [fabric_optimizer]
    fabric.call("on_validation_epoch_end")
    model(torch.ones(1, 2)).sum().backward()
    fabric_optimizer.step()  # the module's own optimizer-step hook runs, as a callback's does
    assert module.calls == ["on_validation_epoch_end", "on_after_optimizer_step"]
    other = _LightningStyle()
    fabric.setup_module(other)
    assert other._fabric is fabric and other._fabric_optimizers == []
    fabric.call("on_validation_epoch_end")
    assert module.calls.count("on_validation_epoch_end") == 2 and other.calls == ["on_validation_epoch_end"]


def test_a_plain_module_is_not_attached() -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    module = nn.Linear(2, 2)
    fabric.setup(module)
    assert not hasattr(module, "_fabric")
    assert fabric._callbacks == []


def test_step_methods_run_through_the_wrapper_by_default() -> None:
    model = Fabric(accelerator="cpu", devices=1).setup_module(nn.Linear(2, 2))
    assert {"training_step", "validation_step", "test_step", "predict_step"} <= model._forward_methods


def test_no_backward_sync_refuses_a_module_not_set_up_at_the_call() -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    with pytest.raises(TypeError, match="takes the module returned by setup"):
        fabric.no_backward_sync(nn.Linear(2, 2))  # no `with`: the call itself raises


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_a_mesh_that_does_not_fit_raises_value_and_runtime_error(tmp_path: Path) -> None:
    code = (
        "from fabric import Fabric\n"
        "from fabric.strategies import ModelParallelStrategy\n"
        "f = Fabric(accelerator='cpu', devices=1, strategy=ModelParallelStrategy(lambda m, mesh: m, data_parallel_size=1,"
        " tensor_parallel_size=2))\n"
        "try:\n    f.launch()\nexcept Exception as e:\n"
        "    print(isinstance(e, ValueError), isinstance(e, RuntimeError), e)\n"
    )
    script = tmp_path / "mesh.py"
    script.write_text(code)
    result = run([PYTHON, str(script)], timeout=55)
    ours = [line for line in result.stdout.splitlines() if not line.startswith("[Gloo]")]  # torch 2.8 prints gloo's log
    assert ours and ours[0].startswith("True True"), result.stdout


# ---- loggers ------------------------------------------------------------------------------------------


def test_experiment_off_rank_zero_accepts_any_call(tmp_path: Path) -> None:
    previous = rank_zero_only.rank
    rank_zero_only.rank = 1
    try:
        experiment = CSVLogger(tmp_path).experiment
        assert isinstance(experiment, NoOpExperiment)
        assert experiment.add_text("a", "b") is None and experiment[3].add_image("x", 1) is None
        experiment["key"] = 1
    finally:
        rank_zero_only.rank = previous
    assert list(tmp_path.iterdir()) == []


def test_rank_zero_experiment_decorates_a_users_logger() -> None:
    class Mine:
        @property
        @rank_zero_experiment
        def experiment(self) -> str:
            return "the writer"

    previous = rank_zero_only.rank
    try:
        rank_zero_only.rank = 0
        assert Mine().experiment == "the writer"
        rank_zero_only.rank = 2
        assert isinstance(Mine().experiment, NoOpExperiment)
    finally:
        rank_zero_only.rank = previous


def test_csv_metric_named_step_goes_to_the_step_column(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path, name="e", version=0, flush_logs_every_n_steps=1)
    logger.log_metrics({"step": 7, "loss": 0.5})  # no step argument: the metric is the step
    logger.log_metrics({"step": 8, "loss": 0.25}, step=8)  # both, as applications log them
    logger.log_metrics({"loss": 0.125})
    with open(tmp_path / "e" / "version_0" / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert rows == [{"step": "7", "loss": "0.5"}, {"step": "8", "loss": "0.25"}, {"step": "2", "loss": "0.125"}]


# ---- a loader with its own state ---------------------------------------------------------------------


class CountingLoader(DataLoader):
    """A loader with a state of its own (like torchdata's StatefulDataLoader): how many batches it handed out."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.handed_out = 0
        self.loaded: list[Any] = []

    def __iter__(self) -> Any:
        for batch in super().__iter__():
            self.handed_out += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {"handed_out": self.handed_out}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded.append(state_dict)
        self.handed_out = state_dict["handed_out"]


def test_a_stateful_loader_keeps_its_own_state_in_the_checkpoint(tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    data = TensorDataset(torch.arange(8.0))
    loader = fabric.setup_dataloaders(CountingLoader(data, batch_size=2))
    iterator = iter(loader)
    next(iterator), next(iterator), next(iterator)
    fabric.save(tmp_path / "ckpt.pt", {"loader": loader, "step": 3})
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["loader"] == {"handed_out": 3}  # as Lightning writes it

    fresh = fabric.setup_dataloaders(CountingLoader(data, batch_size=2))
    fabric.load(tmp_path / "ckpt.pt", {"loader": fresh})
    assert fresh.dataloader.loaded == [{"handed_out": 3}] and fresh.dataloader.handed_out == 3
    assert not fresh.per_rank_state


def test_a_stateful_loader_refuses_our_position_record(tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    data = TensorDataset(torch.arange(8.0))
    plain = fabric.setup_dataloaders(DataLoader(data, batch_size=2))
    next(iter(plain))
    fabric.save(tmp_path / "ckpt.pt", {"loader": plain})
    stateful = fabric.setup_dataloaders(CountingLoader(data, batch_size=2))
    with pytest.raises(ValueError, match="keeps a state of its own"):
        fabric.load(tmp_path / "ckpt.pt", {"loader": stateful})
    assert stateful.dataloader.loaded == []


# ---- names programs import -------------------------------------------------------------------------------


def test_names_lightning_programs_import() -> None:
    from fabric.plugins.collectives import Collective, SingleDeviceCollective, TorchCollective
    from fabric.plugins.collectives.collective import CollectibleGroup
    from fabric.utilities.types import _PATH, LRScheduler, Optimizable, ReduceLROnPlateau, Steppable, _Stateful

    optimizer = torch.optim.Adam(nn.Linear(1, 1).parameters())
    assert isinstance(optimizer, Optimizable) and isinstance(optimizer, Steppable) and isinstance(optimizer, _Stateful)
    assert not isinstance(object(), Optimizable)
    assert issubclass(TorchCollective, Collective) and issubclass(SingleDeviceCollective, Collective)
    single = SingleDeviceCollective().create_group()
    assert isinstance(single.group, CollectibleGroup) and single.world_size == 1
    assert single.all_reduce(torch.ones(1)).item() == 1.0
    assert _PATH is not None and LRScheduler is torch.optim.lr_scheduler.LRScheduler
    assert ReduceLROnPlateau is torch.optim.lr_scheduler.ReduceLROnPlateau
    with pytest.raises(ValueError, match="accepted"):
        TorchCollective._convert_to_native_op("average-ish")
    with pytest.raises(RuntimeError, match="create_group"):
        SingleDeviceCollective().group  # noqa: B018


@pytest.mark.procs
def test_submodules_are_reached_as_attributes_of_the_lazy_packages() -> None:
    code = (
        "import sys, fabric, fabric.utilities, fabric.strategies, fabric.plugins\n"
        "assert 'torch.distributed.fsdp' not in sys.modules\n"
        "print(fabric.utilities.types.Optimizable.__name__, fabric.strategies.fsdp.FSDPStrategy.__name__,"
        " fabric.plugins.collectives.TorchCollective.__name__, fabric.loggers.CSVLogger.__name__)\n"
        "try:\n    fabric.utilities.no_such_module\nexcept AttributeError as err:\n    print(err)\n"
    )
    result = run([PYTHON, "-c", code], timeout=60)
    assert result.stdout.splitlines() == [
        "Optimizable FSDPStrategy TorchCollective CSVLogger",
        "module 'fabric.utilities' has no attribute 'no_such_module'",
    ]


def test_the_private_unwrap_lightnings_own_example_imports() -> None:
    from fabric.wrappers import _unwrap_objects

    fabric = Fabric(accelerator="cpu", devices=1)
    module = nn.Linear(2, 2)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    unwrapped = _unwrap_objects({"model": model, "optimizers": [optimizer], "step": 3})
    assert unwrapped["model"] is module and unwrapped["optimizers"][0] is optimizer.optimizer and unwrapped["step"] == 3
