"""fabric.utilities.throughput: rates over a window of running totals, FLOPs counting, logging through Fabric."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fabric import Fabric
from fabric.utilities.rank_zero import rank_zero_only
from fabric.utilities.throughput import Throughput, ThroughputMonitor, get_available_flops, measure_flops


def test_rates_appear_once_the_window_is_full():
    throughput = Throughput(window_size=3, world_size=2, available_flops=100)
    seen = []
    for i in range(1, 5):
        throughput.update(time=i * 0.5, batches=i, samples=4 * i, lengths=40 * i, flops=10)
        seen.append(throughput.compute())
    assert seen[0] == {"time": 0.5, "batches": 1, "samples": 4, "lengths": 40}
    assert seen[1] == {"time": 1.0, "batches": 2, "samples": 8, "lengths": 80}
    expected_rates = {
        "device/batches_per_sec": 2.0, "device/samples_per_sec": 8.0, "device/items_per_sec": 80.0,
        "batches_per_sec": 4.0, "samples_per_sec": 16.0, "items_per_sec": 160.0,
        "device/flops_per_sec": 20.0, "flops_per_sec": 40.0, "device/mfu": 0.2,
    }  # fmt: skip
    assert seen[2] == {"time": 1.5, "batches": 3, "samples": 12, "lengths": 120, **expected_rates}
    assert seen[3] == {"time": 2.0, "batches": 4, "samples": 16, "lengths": 160, **expected_rates}
    throughput.reset()
    assert throughput.compute() == {}


def test_one_device_has_no_job_totals_and_separator_is_used():
    throughput = Throughput(window_size=2, separator=".")
    throughput.update(time=1.0, batches=1, samples=2)
    throughput.update(time=3.0, batches=3, samples=6)
    assert throughput.compute() == {"time": 3.0, "batches": 3, "samples": 6, "device.batches_per_sec": 1.0, "device.samples_per_sec": 2.0}


def test_bad_updates_and_arguments_change_nothing():
    throughput = Throughput(window_size=2)
    throughput.update(time=1.0, batches=1, samples=1)
    with pytest.raises(ValueError, match=r"larger than the one before: got 1\.0 after 1\.0"):
        throughput.update(time=1.0, batches=2, samples=2)
    with pytest.raises(ValueError, match="samples=1 must be >= batches=2"):
        throughput.update(time=2.0, batches=2, samples=1)
    with pytest.raises(ValueError, match="lengths=1 must be >= samples=2"):
        throughput.update(time=2.0, batches=2, samples=2, lengths=1)
    with pytest.raises(RuntimeError, match="lengths must be passed to every update"):
        throughput.update(time=2.0, batches=2, samples=2, lengths=5)
    with pytest.raises(ValueError, match="window_size=1 must be an int >= 2"):
        Throughput(window_size=1)
    with pytest.raises(ValueError, match="world_size=0"):
        Throughput(world_size=0)


def test_measure_flops_on_the_meta_device():
    with torch.device("meta"):
        model = nn.Linear(32, 16)
        x = torch.randn(8, 32)
    forward = measure_flops(model, lambda: model(x))
    assert forward == 2 * 8 * 32 * 16  # one multiply-add per weight and sample
    # backward adds the weight gradient's product (the input needs no gradient)
    assert measure_flops(model, lambda: model(x), lambda y: y.sum()) == 2 * forward


class Recording:
    def __init__(self):
        self.logged = []

    def log_metrics(self, metrics, step=None):
        self.logged.append((step, dict(metrics)))


def test_monitor_logs_through_fabric_on_rank_zero_only(monkeypatch):
    logger = Recording()
    fabric = Fabric(accelerator="cpu", devices=1, loggers=logger)
    monitor = ThroughputMonitor(fabric, window_size=2)
    assert monitor.world_size == 1 and monitor.available_flops is None  # no FLOPs figure for a CPU
    monitor.update(time=1.0, batches=1, samples=2)
    monitor.compute_and_log()
    monitor.update(time=2.0, batches=2, samples=4)
    assert monitor.compute_and_log()["device/samples_per_sec"] == 2.0
    monitor.compute_and_log(step=10)
    assert [step for step, _ in logger.logged] == [0, 1, 10]
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    assert monitor.compute_and_log() == {} and len(logger.logged) == 3


def test_no_flops_figure_off_gpus():
    assert get_available_flops(torch.device("cpu"), torch.bfloat16) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_flops_figure_of_this_gpu():
    flops = get_available_flops(torch.device("cuda", 0), torch.bfloat16)
    assert flops is None or flops > 1e12
