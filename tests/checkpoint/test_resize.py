"""Resuming mid-epoch on another number of processes (DDP and FSDP): every sample of the epoch is used
once (plus the padding a DistributedSampler adds), the run continues from the saved step, and the same
resize of the same checkpoint gives the same parameters bit for bit. A user's loader with a state of its
own gets every saving rank's state through its ``resized_state_dict``; one without it is refused, on every
rank, before anything is loaded. Real processes, each job with a timeout; the protocol's dispatch in one.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

from fabric import Fabric
from fabric.checkpoint import SAVED_RANKS_KEY, CheckpointMismatchError
from fabric.checkpoint.resume.resize import epoch_order, rank_share
from support.environment import job_environment
from support.loading import script_path
from support.scripts.resize.loaders import ResizableShardLoader, ShardPositionLoader

JOB = script_path("resize", "job.py")
SAMPLES, BATCH, STEPS = 50, 3, 2
OWN_SAMPLES = 48  # the job's loaders with a state of their own (support/scripts/resize/loaders.py)


def start(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(JOB), str(out), *args], env=job_environment(), capture_output=True, text=True, timeout=240
    )


def run(out: Path, *args: str) -> None:
    result = start(out, *args)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


def reports(out: Path, tag: str, processes: int) -> list[dict]:
    return [json.loads((out / f"{tag}-rank{rank}.json").read_text()) for rank in range(processes)]


@pytest.mark.procs
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("strategy", "saved_on", "resumed_on"),
    [("ddp", 4, 2), ("ddp", 2, 3), ("ddp", 2, 1), ("fsdp", 4, 2), ("fsdp", 2, 3)],
)
def test_a_resized_run_uses_every_sample_once_and_is_reproducible(tmp_path, strategy, saved_on, resumed_on):
    run(tmp_path, "save", strategy, str(saved_on), str(STEPS))
    for tag in ("a", "b"):
        run(tmp_path, "resume", strategy, str(resumed_on), tag)
    first = [sample for report in reports(tmp_path, "save", saved_on) for sample in report["used"]]
    assert len(first) == STEPS * BATCH * saved_on
    resumed = reports(tmp_path, "a", resumed_on)
    assert all(report["resumed_at"] == STEPS for report in resumed)
    rest = [sample for report in resumed for sample in report["used"]]
    counts = Counter(first + rest)
    assert set(counts) == set(range(SAMPLES)), "samples skipped"
    left = SAMPLES - len(first)
    padding = math.ceil(left / resumed_on) * resumed_on - left  # as DistributedSampler pads an epoch
    assert sum(counts.values()) == SAMPLES + padding and max(counts.values()) <= 2, counts
    again = reports(tmp_path, "b", resumed_on)
    assert [r["used"] for r in again] == [r["used"] for r in resumed]
    a, b = torch.load(tmp_path / "a-params.pt"), torch.load(tmp_path / "b-params.pt")
    assert all(torch.equal(a[name], b[name]) for name in a), "the same resize twice gave other parameters"


def test_the_rest_of_an_epoch_is_split_as_the_sampler_splits_a_whole_one():
    record = {"length": 10, "shuffle": True, "seed": 3, "drop_last": False, "num_replicas": 2}
    order = epoch_order(record, epoch=1)
    generator = torch.Generator()
    generator.manual_seed(3 + 1)
    assert order == torch.randperm(10, generator=generator).tolist()  # DistributedSampler's draw
    shares = [rank_share(order[4:], 4, rank, drop_last=False) for rank in range(4)]
    assert [len(share) for share in shares] == [2, 2, 2, 2]
    assert Counter(sample for share in shares for sample in share) == Counter(order[4:] + order[4:6])  # 6 left, 2 repeated
    assert [rank_share(order[4:], 4, rank, drop_last=True) for rank in range(4)] == [[order[4 + r]] for r in range(4)]


# ---- a loader of the user's with a state of its own -------------------------------------------------------


@pytest.mark.procs
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("strategy", "saved_on", "resumed_on"), [("ddp", 2, 1), ("ddp", 2, 3), ("fsdp", 2, 3)])
def test_a_stateful_user_loader_continues_on_another_number_of_processes(tmp_path, strategy, saved_on, resumed_on):
    run(tmp_path, "save", strategy, str(saved_on), str(STEPS), "resizable")
    for tag in ("a", "b"):
        run(tmp_path, "resume", strategy, str(resumed_on), tag, "resizable")
    first = [sample for report in reports(tmp_path, "save", saved_on) for sample in report["used"]]
    assert len(first) == STEPS * BATCH * saved_on
    resumed = reports(tmp_path, "a", resumed_on)
    assert all(report["resumed_at"] == STEPS for report in resumed)
    rest = [sample for report in resumed for sample in report["used"]]
    assert sorted(first + rest) == list(range(OWN_SAMPLES)), "a sample skipped or used twice"
    again = reports(tmp_path, "b", resumed_on)
    assert [r["used"] for r in again] == [r["used"] for r in resumed]
    a, b = torch.load(tmp_path / "a-params.pt"), torch.load(tmp_path / "b-params.pt")
    assert all(torch.equal(a[name], b[name]) for name in a), "the same resize twice gave other parameters"


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_a_stateful_loader_without_the_protocol_is_refused_on_every_rank_before_anything_loads(tmp_path):
    run(tmp_path, "save", "ddp", "2", str(STEPS), "fixed")
    result = start(tmp_path, "resume", "ddp", "3", "a", "fixed")
    assert result.returncode != 0, result.stdout[-2000:]
    for report in reports(tmp_path, "a", 3):
        error = report["error"]
        assert error.startswith("CheckpointMismatchError: "), error
        for part in ("state['loader']", "ShardPositionLoader", "saved by 2 process(es) and this run has 3",
                     "resized_state_dict(states, world_size, rank)", "leave the loader out of the state you load"):
            assert part in error, (part, error)
        assert report["model_unchanged"] and report["optimizer_state"] == 0, report
        assert report["loader_loaded"] == [] and report["step"] == 0, report
    assert "saved by 2 process(es) and this run has 3" in result.stderr


def own_loader(fabric: Fabric, cls: type = ResizableShardLoader) -> ShardPositionLoader:
    return cls(torch.arange(12), 2, fabric.global_rank, fabric.world_size, seed=1)


def test_the_entry_stays_the_loaders_own_state_and_every_rank_is_kept_beside(tmp_path):
    fabric = Fabric(accelerator="cpu", devices=1)
    loader = fabric.setup_dataloaders(own_loader(fabric), use_distributed_sampler=False)
    iterator = iter(loader)
    next(iterator), next(iterator)
    fabric.save(tmp_path / "ckpt.pt", {"loader": loader, "step": 2})
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert saved["loader"] == loader.dataloader.state_dict()  # as Lightning Fabric writes it
    assert saved[SAVED_RANKS_KEY] == {"world_size": 1, "states": {"loader": [saved["loader"]]}}
    assert SAVED_RANKS_KEY not in fabric.load(tmp_path / "ckpt.pt") and fabric.load(tmp_path / "ckpt.pt", {"loader": loader}) == {"step": 2}

    fabric.save(tmp_path / "filtered.pt", {"loader": loader}, filter={"loader": lambda name, value: name == "position"})
    saved = torch.load(tmp_path / "filtered.pt", weights_only=True)
    assert saved["loader"] == {"position": 2} and saved[SAVED_RANKS_KEY]["states"] == {"loader": [{"position": 2}]}
    with pytest.raises(ValueError, match="the checkpoint's own record"):
        fabric.save(tmp_path / "clash.pt", {"loader": loader, SAVED_RANKS_KEY: 1})


def test_a_checkpoint_without_the_record_loads_the_entry_as_before(tmp_path):
    fabric = Fabric(accelerator="cpu", devices=1)
    entry = {"rest": [4, 5], "position": 1}
    torch.save({"loader": entry, "step": 3}, tmp_path / "lightning.pt")  # as Lightning Fabric (or fabric before the record) writes it
    loader = fabric.setup_dataloaders(own_loader(fabric, ShardPositionLoader), use_distributed_sampler=False)
    assert fabric.load(tmp_path / "lightning.pt", {"loader": loader}) == {"step": 3}
    assert loader.dataloader.loaded == [entry]


def saved_by_two(tmp_path: Path) -> tuple[Path, list[dict]]:
    """A checkpoint as 2 processes write it (model, optimizer, their loader states), made in one process."""
    model = nn.Linear(2, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    order = list(range(12))
    states = [{"rest": order, "position": 2}, {"rest": order, "position": 2}]
    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "loader": states[0], "step": 4}
    torch.save({**checkpoint, SAVED_RANKS_KEY: {"world_size": 2, "states": {"loader": states}}}, tmp_path / "two.pt")
    return tmp_path / "two.pt", states


def test_a_loader_that_cannot_take_another_number_of_processes_fails_the_load_before_anything_changes(tmp_path):
    fabric = Fabric(accelerator="cpu", devices=1)
    path, _ = saved_by_two(tmp_path)
    model = fabric.setup_module(nn.Linear(2, 2))
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters()))
    loader = fabric.setup_dataloaders(own_loader(fabric, ShardPositionLoader), use_distributed_sampler=False)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    state = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0}
    with pytest.raises(CheckpointMismatchError, match=r"state\['loader'\]: .*saved by 2 process\(es\) and this run has 1, but ShardPositionLoader"):
        fabric.load(path, state)
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())
    assert optimizer.state_dict()["state"] == {} and loader.dataloader.loaded == [] and state["step"] == 0
    fabric.load(path, {"model": model, "optimizer": optimizer, "step": 0})  # the way out: leave the loader out


def test_a_resizable_loader_gets_every_saved_rank_state_and_this_runs_layout(tmp_path):
    fabric = Fabric(accelerator="cpu", devices=1)
    path, states = saved_by_two(tmp_path)
    loader = fabric.setup_dataloaders(own_loader(fabric), use_distributed_sampler=False)
    calls = []
    resize = loader.dataloader.resized_state_dict
    loader.dataloader.resized_state_dict = lambda *args: calls.append(args) or resize(*args)
    assert sorted(fabric.load(path, {"loader": loader})) == ["model", "optimizer", "step"]  # not the record
    assert calls == [(states, 1, 0)]
    # ranks 0 and 1 of 2 each used 2 batches of 2 of their share (every 2nd sample): 0, 2, 4, 6 and 1, 3, 5, 7
    assert loader.dataloader.loaded == [{"rest": [8, 9, 10, 11], "position": 0}]
    assert [batch.tolist() for batch in loader] == [[8, 9], [10, 11]]


def test_the_protocol_is_asked_only_on_another_number_of_processes():
    fabric = Fabric(accelerator="cpu", devices=1)
    states = [{"rest": list(range(12)), "position": 1}] * 3
    resizable = fabric.setup_dataloaders(own_loader(fabric), use_distributed_sampler=False)
    fixed = fabric.setup_dataloaders(own_loader(fabric, ShardPositionLoader), use_distributed_sampler=False)
    assert resizable.saved_ranks_beside and fixed.saved_ranks_beside
    entry = {"rest": [5], "position": 7}
    for loader in (resizable, fixed):  # the same number: the entry, as Lightning Fabric loads it
        assert loader.state_from_saved_ranks(entry, states[:1]) is entry
    # rank r of 3 used the first batch of 2 of every 3rd sample from r: 0, 3 and 1, 4 and 2, 5
    assert resizable.state_from_saved_ranks(entry, states) == {"rest": [6, 7, 8, 9, 10, 11], "position": 0}
    with pytest.raises(CheckpointMismatchError, match="saved by 3 process"):
        fixed.state_from_saved_ranks(entry, states)
    with pytest.raises(ValueError, match="cannot share evenly"):  # the loader's own refusal
        ResizableShardLoader(torch.arange(12), 2, 0, 1).resized_state_dict(states, 4, 0)
    plain = fabric.setup_dataloaders(torch.utils.data.DataLoader(torch.arange(4)))
    assert not plain.saved_ranks_beside  # our own position: every rank's state is in the entry itself


def test_a_loader_resized_on_load_reports_the_saved_epoch_as_its_position_before_it_runs():
    """``position()`` (what ``ddp_ft`` tells its peers) and ``state_dict()`` agree after a resized load."""
    from torch.utils.data import DataLoader, DistributedSampler

    from fabric.checkpoint.per_rank import PER_RANK_KEY
    from fabric.checkpoint.resume.loader_progress import LoaderProgress

    data = list(range(SAMPLES))

    def loader(replicas: int, rank: int) -> DataLoader:
        return DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, num_replicas=replicas, rank=rank, seed=5))

    saved = []
    for rank in range(2):
        progress = LoaderProgress(loader(2, rank), rank, 2)
        epochs = progress.iterate(), progress.iterate()
        for _ in epochs[0]:
            pass
        next(epochs[1])  # one batch into epoch 1
        saved.append(progress.state_dict())
    resized = LoaderProgress(loader(3, 1), 1, 3)
    resized.load_state_dict({PER_RANK_KEY: saved})
    state = resized.state_dict()
    assert (state["epoch"], state["batches_consumed"], state["start"]) == (1, 0, 2 * BATCH)
    assert resized.position() == (1, 0)
