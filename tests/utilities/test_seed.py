"""Seeding: the same seed gives the same numbers from random, NumPy and torch; the seed reaches children."""

from __future__ import annotations

import logging
import os
import random

import numpy as np
import pytest
import torch

import fabric.utilities.seed as seed_module
from fabric import Fabric, seed_everything
from fabric.utilities.seed import reset_seed, worker_init_function

pytestmark = pytest.mark.usefixtures("clean_fabric_env")


def draw() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(2).tolist(), torch.randint(0, 10**6, (1,)).item()


@pytest.mark.parametrize("seed", [0, 1, 42, 2**32 - 1])
def test_same_seed_same_numbers(seed):
    assert seed_everything(seed) == seed
    first = draw()
    random.random(), np.random.rand(), torch.rand(1)  # move every generator on
    assert seed_everything(seed) == seed
    assert draw() == first


def test_different_seeds_different_numbers():
    seed_everything(1)
    one = draw()
    seed_everything(2)
    two = draw()
    assert all(a != b for a, b in zip(one, two))


def test_seed_is_exported_for_child_processes():
    seed_everything(123)
    assert os.environ["FABRIC_GLOBAL_SEED"] == "123"
    assert os.environ["FABRIC_SEED_WORKERS"] == "0"
    seed_everything(124, workers=True)
    assert os.environ["FABRIC_SEED_WORKERS"] == "1"


def test_without_a_seed_the_environment_decides(monkeypatch):
    monkeypatch.setenv("FABRIC_GLOBAL_SEED", "77")
    assert seed_everything() == 77
    from_env = draw()
    seed_everything(77)
    assert draw() == from_env


def test_without_any_seed_zero_is_used_with_a_warning():
    with pytest.warns(UserWarning, match="No seed given; seeding with 0"):
        assert seed_everything() == 0
    assert os.environ["FABRIC_GLOBAL_SEED"] == "0"


def test_invalid_seed_from_the_environment(monkeypatch):
    monkeypatch.setenv("FABRIC_GLOBAL_SEED", "abc")
    with pytest.raises(ValueError, match="FABRIC_GLOBAL_SEED='abc' is not an integer seed"):
        seed_everything()


@pytest.mark.parametrize("seed", [-1, 2**32])
def test_seed_out_of_range(seed):
    with pytest.raises(ValueError, match=f"seed={seed} is out of range; accepted: 0 to 4294967295"):
        seed_everything(seed)


@pytest.mark.parametrize("seed", [1.5, True, [1], "abc"])
def test_seed_of_a_wrong_type(seed):
    with pytest.raises(TypeError, match="takes an int"):
        seed_everything(seed)


def test_seed_as_a_string_of_digits_or_numpy_int():
    assert seed_everything("17") == 17  # e.g. straight from argparse or os.environ, as Lightning accepts
    assert seed_everything(np.int64(18)) == 18


def test_lightning_variables_are_written_and_read(monkeypatch):
    seed_everything(11, workers=True)
    assert os.environ["PL_GLOBAL_SEED"] == "11" and os.environ["PL_SEED_WORKERS"] == "1"
    for name in ("FABRIC_GLOBAL_SEED", "PL_GLOBAL_SEED", "FABRIC_SEED_WORKERS", "PL_SEED_WORKERS"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("PL_GLOBAL_SEED", "55")  # a job script written for Lightning Fabric
    monkeypatch.setenv("PL_SEED_WORKERS", "1")
    assert seed_everything() == 55
    from_env = draw()
    seed_everything(55)
    assert draw() == from_env
    del os.environ["FABRIC_GLOBAL_SEED"], os.environ["FABRIC_SEED_WORKERS"]
    monkeypatch.setenv("PL_SEED_WORKERS", "1")
    monkeypatch.setattr(seed_module, "_seeded_here", False)  # as in a freshly started (spawned) rank
    reset_seed()  # a freshly started rank: seeds from Lightning's variables
    assert draw() == from_env
    assert os.environ["FABRIC_SEED_WORKERS"] == "1"


def test_invalid_lightning_seed_variable(monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "x1")
    with pytest.raises(ValueError, match="PL_GLOBAL_SEED='x1' is not an integer seed"):
        seed_everything()


def test_pl_worker_init_function_is_the_worker_seeding():
    from fabric.utilities.seed import pl_worker_init_function

    assert _worker_draw(1000, 1, 0) == (torch.manual_seed(1001), pl_worker_init_function(1, rank=0), draw())[2]


def test_verbose_false_is_silent(caplog, recwarn):
    with caplog.at_level(logging.DEBUG, logger="fabric"):
        assert seed_everything(verbose=False) == 0  # no seed anywhere: 0, without the warning
        seed_everything(3, verbose=False)
    assert caplog.records == [] and len(recwarn) == 0


def test_seed_record_is_info_from_the_seed_module_with_the_rank(caplog, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with caplog.at_level(logging.INFO, logger="fabric"):
        seed_everything(7)
        monkeypatch.setenv("RANK", "3")
        seed_everything(8)  # every rank logs, with its rank in front, as in Lightning Fabric
    records = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    assert records == [
        ("fabric.utilities.seed", logging.INFO, "Seed set to 7"),
        ("fabric.utilities.seed", logging.INFO, "[rank: 3] Seed set to 8"),
    ]


@pytest.mark.procs
def test_seed_record_is_shown_by_default(subprocess_env):
    import subprocess
    import sys

    code = "import fabric; fabric.seed_everything(42)"
    result = subprocess.run([sys.executable, "-c", code], env=subprocess_env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "Seed set to 42" in result.stderr


def test_verbose_logs_the_seed(caplog):
    with caplog.at_level(logging.INFO, logger="fabric"):
        seed_everything(5)
        seed_everything(6, verbose=False)
    messages = [record.getMessage() for record in caplog.records]
    assert "Seed set to 5" in messages and "Seed set to 6" not in messages


def test_fabric_method_is_the_same_seeding():
    Fabric.seed_everything(9)
    first = draw()
    Fabric(accelerator="cpu").seed_everything(9)
    assert draw() == first
    assert os.environ["FABRIC_SEED_WORKERS"] == "1"


def test_reset_seed_seeds_only_a_process_that_has_not_seeded(monkeypatch):
    seed_everything(31, workers=True)
    first = draw()
    state = torch.get_rng_state()
    reset_seed()  # this process seeded: its generators stay where the draws left them
    assert torch.equal(torch.get_rng_state(), state)
    monkeypatch.setattr(seed_module, "_seeded_here", False)  # a spawned worker starts unseeded
    reset_seed()
    assert draw() == first
    assert os.environ["FABRIC_SEED_WORKERS"] == "1"
    del os.environ["FABRIC_GLOBAL_SEED"]
    reset_seed()  # nothing to do


def _worker_draw(base_seed: int, worker_id: int, rank: int) -> tuple:
    torch.manual_seed(base_seed + worker_id)  # what a DataLoader gives each worker
    worker_init_function(worker_id, rank=rank)
    return draw()


def test_worker_init_function_gives_distinct_reproducible_streams():
    streams = {(w, r): _worker_draw(1000, w, r) for w in range(3) for r in range(2)}
    assert len({s[0] for s in streams.values()}) == 6  # python random differs for every worker of every rank
    assert len({s[1] for s in streams.values()}) == 6  # so does NumPy (identical in forked workers otherwise)
    assert _worker_draw(1000, 2, 1) == streams[(2, 1)]
    assert _worker_draw(2000, 2, 1) != streams[(2, 1)]


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_worker_init_function_in_real_workers():
    seed_everything(3)
    dataset = torch.utils.data.TensorDataset(torch.arange(4))

    def collate(batch):
        return float(np.random.rand())

    loader = torch.utils.data.DataLoader(
        dataset, batch_size=1, num_workers=2, worker_init_fn=worker_init_function, collate_fn=collate
    )
    values = list(loader)
    assert len(set(values)) == 4  # without it, both forked workers would draw the same NumPy numbers
    seed_everything(3)
    assert list(loader) == values


def _numpy_draw(batch):
    return float(np.random.rand())


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_seed_everything_workers_gives_set_up_loaders_the_seeding_worker_init_fn():
    fabric = Fabric(accelerator="cpu", devices=1)
    dataset = torch.utils.data.TensorDataset(torch.arange(4))
    own = torch.utils.data.DataLoader(dataset, worker_init_fn=print)

    fabric.seed_everything(5, workers=False, verbose=False)
    assert fabric.setup_dataloaders(torch.utils.data.DataLoader(dataset)).worker_init_fn is None

    fabric.seed_everything(5, workers=True, verbose=False)
    loader = fabric.setup_dataloaders(
        torch.utils.data.DataLoader(dataset, batch_size=1, num_workers=2, collate_fn=_numpy_draw)
    )
    assert loader.worker_init_fn.func is worker_init_function
    assert fabric.setup_dataloaders(own).worker_init_fn is print  # a loader's own function is kept
    values = list(loader)
    assert len(set(values)) == 4  # without seeding, both forked workers would draw the same NumPy numbers
    fabric.seed_everything(5, workers=True, verbose=False)
    assert list(loader) == values
