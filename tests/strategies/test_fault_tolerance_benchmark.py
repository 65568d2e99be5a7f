"""``benchmarks/fault_tolerance.py``'s rule for a credible ratio: pairs of runs in alternating order, a pair set aside
when its runs had different CPU left to them, and no ratio at all rather than one from runs under different load."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import pytest

from support import REPO
from support.loading import load_file

bench = load_file(REPO / "benchmarks" / "fault_tolerance.py", "fault_tolerance_bench")


def _scripted(loads: list[tuple[float, float]], ratio: float = 1.05) -> tuple[Any, list[tuple[str, int]]]:
    """A ``run`` for ``measure_pairs`` whose pair ``i`` had foreign loads ``loads[i]`` (ddp, ddp_ft); and its calls."""
    calls: list[tuple[str, int]] = []

    def run(variant: str, pair: int) -> dict[str, Any]:
        calls.append((variant, pair))
        load = loads[pair][0 if variant == "ddp" else 1]
        return {"step_ms": 100.0 * (ratio if variant == "ddp_ft" else 1.0), "foreign_cores": load}

    return run, calls


def test_cpu_left_apart_is_relative_to_the_cpu_left():
    assert bench.cpu_left_apart({"ddp": 0.05, "ddp_ft": 0.15}, cores=2) == pytest.approx(0.1 / 1.95)
    # the same 0.1 cores weigh more on a busy machine
    assert bench.cpu_left_apart({"ddp": 1.45, "ddp_ft": 1.35}, cores=2) == pytest.approx(0.1 / 0.65)
    assert bench.cpu_left_apart({"ddp": 0.5, "ddp_ft": 2.0}, cores=2) == 1.0  # a run had nothing left


def test_pairs_alternate_their_order_and_stop_once_enough_ran_under_the_same_load():
    run, calls = _scripted([(0.05, 0.06)] * 10)
    pairs = bench.measure_pairs(run, needed=3, most=6, tolerance=0.05, cores=2)
    assert [p["order"] for p in pairs] == [["ddp", "ddp_ft"], ["ddp_ft", "ddp"], ["ddp", "ddp_ft"]]
    assert calls == [("ddp", 0), ("ddp_ft", 0), ("ddp_ft", 1), ("ddp", 1), ("ddp", 2), ("ddp_ft", 2)]
    verdict = bench.judge_pairs(pairs, needed=3, tolerance=0.05, goal=1.10)
    assert verdict["ratio"] == pytest.approx(1.05) and verdict["verdict"] == "OK" and verdict["set_aside"] == []


def test_a_pair_under_different_load_is_set_aside_and_replaced():
    run, _ = _scripted([(0.05, 0.9), (0.05, 0.06), (0.1, 0.1), (0.07, 0.05)])
    pairs = bench.measure_pairs(run, needed=3, most=6, tolerance=0.05, cores=2)
    assert [p["same_load"] for p in pairs] == [False, True, True, True]
    verdict = bench.judge_pairs(pairs, needed=3, tolerance=0.05, goal=1.10)
    assert verdict["set_aside"] == [1] and verdict["pairs_same_load"] == 3 and verdict["ratio"] == pytest.approx(1.05)


def test_no_ratio_when_too_few_pairs_ran_under_the_same_load():
    # after 3 pairs, 1 under the same load, 1 pair left of most=4: 3 cannot be reached, so no fourth pair runs
    run, calls = _scripted([(0.0, 1.0), (0.05, 0.05), (1.2, 0.3), (0.0, 0.0)], ratio=0.8)
    pairs = bench.measure_pairs(run, needed=3, most=4, tolerance=0.05, cores=2)
    assert len(pairs) == 3 and len(calls) == 6
    verdict = bench.judge_pairs(pairs, needed=3, tolerance=0.05, goal=1.10)
    assert verdict["ratio"] is None and verdict["verdict"] == "no ratio"
    assert verdict["set_aside"] == [1, 3]
    assert "only 1 of 3 pairs" in verdict["no_ratio_because"]
    assert "pair 1 (foreign load ddp 0.00, ddp_ft 1.00 cores" in verdict["no_ratio_because"]


def test_the_spread_is_over_the_pairs_under_the_same_load_only():
    pairs = [{"pair": i + 1, "ratio": ratio, "same_load": same, "foreign_cores": {"ddp": 0.0, "ddp_ft": 0.0}, "cpu_left_apart": 0.0}
             for i, (ratio, same) in enumerate([(1.02, True), (0.5, False), (1.04, True), (1.10, True), (1.06, True), (1.08, True)])]
    verdict = bench.judge_pairs(pairs, needed=5, tolerance=0.05, goal=1.10)
    assert verdict["ratio"] == pytest.approx(1.06)
    assert (verdict["min"], verdict["max"]) == (1.02, 1.10)
    assert verdict["q1"] == pytest.approx(1.04) and verdict["q3"] == pytest.approx(1.08)


@pytest.mark.procs
def test_the_load_meter_counts_the_cpu_of_listed_processes_as_its_own():
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nend = time.monotonic() + 20\nwhile time.monotonic() < end: pass"])
    try:
        foreign, own = bench.LoadMeter(), bench.LoadMeter()  # the spinner: someone else's process, then one of ours
        start = time.time()
        while time.time() - start < 1.5:
            foreign.sample([])
            own.sample([spinner.pid])
            time.sleep(0.1)
        window = (start + 0.2, start + 1.3)
        moved = foreign.foreign_cores(*window) - own.foreign_cores(*window)
        # the spinner's share of a core, whatever else runs on the machine: at least a fifth of one, at most one
        assert 0.2 <= moved <= 1.05
    finally:
        spinner.kill()
        spinner.wait(timeout=10)
