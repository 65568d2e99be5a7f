"""Sharding data across ranks: what each rank of a real 2-process job iterates, plus in-process sampler checks.

The 2-process part reads the results of the popen job in ``support/scripts/ddp`` (run once per session and
shared with ``test_ddp.py``): each rank recorded the items its loaders yielded.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, TensorDataset, WeightedRandomSampler

from fabric.utilities.data import DistributedSamplerWrapper, shard_dataloader
from fabric.wrappers import FabricDataLoader
from support.scripts.ddp.checks import Reversed
from support.scripts.ddp.harness import popen_results

JOB_TIMEOUT = 120


@pytest.fixture
def data(tmp_path_factory):
    ranks = popen_results(tmp_path_factory)["ranks"]
    return ranks[0]["data"], ranks[1]["data"]


def _assert_disjoint_cover(shards, everything):
    assert not set(shards[0]) & set(shards[1]), shards
    assert sorted(shards[0] + shards[1]) == sorted(everything)


@pytest.mark.procs
@pytest.mark.timeout(JOB_TIMEOUT)
def test_shuffled_shards_are_disjoint_cover_and_reshuffle_each_epoch(data):
    rank0, rank1 = data
    assert rank0["shuffled_sampler"] == rank1["shuffled_sampler"] == "DistributedSampler"
    epochs = list(zip(rank0["shuffled_epochs"], rank1["shuffled_epochs"]))
    for shards in epochs:
        assert len(shards[0]) == len(shards[1]) == 10
        _assert_disjoint_cover(list(shards), list(range(20)))
    # a new order every epoch although the script never called set_epoch
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs[0][0] != list(range(0, 20, 2))


@pytest.mark.procs
@pytest.mark.timeout(JOB_TIMEOUT)
def test_ordered_loader_is_sharded_in_order(data):
    rank0, rank1 = data
    assert rank0["ordered"] == list(range(0, 20, 2))
    assert rank1["ordered"] == list(range(1, 20, 2))


@pytest.mark.procs
@pytest.mark.timeout(JOB_TIMEOUT)
def test_users_own_sampler_is_kept_and_sharded(data):
    rank0, rank1 = data
    assert rank0["custom_sampler"] == "DistributedSamplerWrapper"
    _assert_disjoint_cover([rank0["custom"], rank1["custom"]], list(range(20)))
    # the user's order (reversed) survives: each rank takes every other position of it
    assert rank0["custom"] == list(range(19, -1, -2))
    assert rank1["custom"] == list(range(18, -1, -2))


@pytest.mark.procs
@pytest.mark.timeout(JOB_TIMEOUT)
def test_without_distributed_sampler_every_rank_sees_everything(data):
    rank0, rank1 = data
    assert rank0["full"] == rank1["full"] == list(range(20))


# ---- in-process: the sampler machinery with explicit ranks -----------------------------------------------


def _shards(make_loader, epochs=2):
    """Items per rank and epoch, iterating through FabricDataLoader as Fabric would."""
    out = []
    for rank in (0, 1):
        loader = FabricDataLoader(shard_dataloader(make_loader(), num_replicas=2, rank=rank))
        out.append([[int(i) for (batch,) in loader for i in batch] for _ in range(epochs)])
    return out


def test_weighted_sampler_draw_is_shared_and_split():
    dataset = TensorDataset(torch.arange(12))

    def make_loader():
        generator = torch.Generator().manual_seed(3)  # the same draw on every rank
        sampler = WeightedRandomSampler(torch.ones(12), num_samples=12, replacement=False, generator=generator)
        return DataLoader(dataset, batch_size=5, sampler=sampler)

    rank0, rank1 = _shards(make_loader, epochs=1)
    _assert_disjoint_cover([rank0[0], rank1[0]], list(range(12)))


def test_wrapper_pads_uneven_lengths_like_distributed_sampler():
    wrapper0 = DistributedSamplerWrapper(Reversed(5), num_replicas=2, rank=0, shuffle=False)
    wrapper1 = DistributedSamplerWrapper(Reversed(5), num_replicas=2, rank=1, shuffle=False)
    assert len(wrapper0) == len(wrapper1) == 3
    assert list(wrapper0) == [4, 2, 0]
    assert list(wrapper1) == [3, 1, 4]  # padded with the start of the draw, as DistributedSampler pads


def test_random_sampler_becomes_seeded_distributed_sampler(monkeypatch):
    monkeypatch.setenv("FABRIC_GLOBAL_SEED", "123")
    loader = shard_dataloader(DataLoader(range(10), batch_size=2, shuffle=True), num_replicas=2, rank=1)
    assert isinstance(loader.sampler, DistributedSampler)
    assert loader.sampler.shuffle and loader.sampler.seed == 123 and loader.sampler.rank == 1
    assert not isinstance(loader.sampler, RandomSampler)


def test_an_existing_distributed_sampler_is_kept():
    sampler = DistributedSampler(range(10), num_replicas=2, rank=0, shuffle=False)
    loader = shard_dataloader(DataLoader(range(10), batch_size=2, sampler=sampler), num_replicas=2, rank=0)
    assert loader.sampler is sampler
