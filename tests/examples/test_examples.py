"""The examples run as users run them (fresh interpreters), train, and agree with each other."""

from __future__ import annotations

import importlib.util
import itertools
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO

pytestmark = pytest.mark.procs

EXAMPLES = REPO / "examples"
SHORT = ["--epochs", "3", "--samples", "512", "--seed", "7"]
_EPOCH = re.compile(r"^epoch (\d+) loss (\S+)$", re.MULTILINE)
_FINAL = re.compile(r"^final loss \S+ \(exact (\S+)\)$", re.MULTILINE)


def start_example(name: str, args: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
    env = dict(env, CUDA_VISIBLE_DEVICES="")  # both loops on the CPU, whatever the machine has
    return subprocess.Popen(
        [sys.executable, str(EXAMPLES / name), *args],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(process: subprocess.Popen, timeout: float = 200) -> subprocess.CompletedProcess:
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
        pytest.fail(f"{process.args} ran longer than {timeout} s\nstdout:\n{stdout}\nstderr:\n{stderr}")
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def run_example(name: str, args: list[str], env: dict[str, str], cwd: Path, timeout: float = 200) -> subprocess.CompletedProcess:
    return finish(start_example(name, args, env, cwd), timeout)


def losses(result: subprocess.CompletedProcess) -> tuple[list[float], float]:
    assert result.returncode == 0, f"exit code {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    epochs = [(int(n), float(value)) for n, value in _EPOCH.findall(result.stdout)]
    finals = _FINAL.findall(result.stdout)
    assert len(finals) == 1, result.stdout
    assert [n for n, _ in epochs] == [1, 2, 3], result.stdout
    values = [value for _, value in epochs]
    final = float(finals[0])
    assert all(math.isfinite(value) for value in values) and math.isfinite(final)
    assert all(later < earlier for earlier, later in itertools.pairwise(values)), f"loss does not decrease: {values}"
    assert final == pytest.approx(values[-1], abs=1e-8)
    return values, final


@pytest.mark.timeout(300)
def test_fabric_loop_matches_the_raw_loop(tmp_path, subprocess_env):
    # both run at once: most of their time is importing torch
    raw = start_example("raw_pytorch.py", SHORT, subprocess_env, tmp_path)
    fabric_args = [*SHORT, "--accelerator", "cpu", "--devices", "1", "--precision", "32-true"]
    ours = start_example("fabric_loop.py", fabric_args, subprocess_env, tmp_path)
    raw_epochs, raw_final = losses(finish(raw))
    our_epochs, our_final = losses(finish(ours))
    # same seed, same order of random draws, same arithmetic: not close, identical
    assert our_epochs == raw_epochs
    assert our_final == raw_final


@pytest.mark.timeout(250)
def test_fabric_loop_in_bf16_mixed(tmp_path, subprocess_env):
    result = run_example("fabric_loop.py", [*SHORT, "--accelerator", "cpu", "--precision", "bf16-mixed"], subprocess_env, tmp_path)
    losses(result)


@pytest.mark.skipif(importlib.util.find_spec("fabric.strategies.ddp") is None, reason="the DDP strategy has not landed yet")
@pytest.mark.timeout(300)
def test_fabric_loop_as_two_processes(tmp_path, subprocess_env):
    result = run_example("fabric_loop.py", [*SHORT, "--accelerator", "cpu", "--devices", "2"], subprocess_env, tmp_path, timeout=240)
    losses(result)  # printed once (by rank 0), over the data of both processes
