"""``make gpu-check`` itself on the CPU: it says plainly that there is no GPU and exits 2; its parts' plumbing (junit and
log summaries, budgets, timeouts, the JSON written after every part, the summary) and the GPU benchmarks' logic."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from support import REPO
from support.loading import load_file

tool = load_file(REPO / "scripts" / "gpu_check.py", "gpu_check_tool")
bench = load_file(REPO / "benchmarks" / "gpu.py", "gpu_bench")


def _no_gpu_env() -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith(("FABRIC_", "PYTEST_"))}
    env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU machine, even where the suite runs on one with a GPU
    return env


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_make_gpu_check_on_a_cpu_machine_says_no_gpu_and_exits_non_zero(tmp_path):
    out = tmp_path / "out"
    if shutil.which("make"):
        command = ["make", "--no-print-directory", "gpu-check", f"OUT={out}", f"PY={sys.executable}", "GPU_CHECK_ARGS=-k pinned_loader"]
    else:
        command = [sys.executable, "scripts/gpu_check.py", "-k", "pinned_loader", str(out)]
    result = subprocess.run(command, cwd=REPO, env=_no_gpu_env(), capture_output=True, text=True, timeout=110)
    assert result.returncode != 0, result.stdout + result.stderr
    assert "no GPU found (torch " in result.stdout and "CUDA not available)" in result.stdout, result.stdout
    report = json.loads((out / "gpu-check.json").read_text())
    assert report["status"] == "not run" and report["environment"]["cuda_available"] is False
    assert any(problem.startswith("no GPU found (torch ") for problem in report["problems"])
    assert report["environment"]["fabric_path"].startswith(str(REPO))
    # as far as it can: the CPU version of a GPU job ran, with its junit file
    assert report["parts"]["cpu_logic_tests"]["tests"]["passed"] == 1 and (out / "junit.xml").exists()
    assert "NOT RUN" in result.stdout.splitlines()[-1]


def test_checkout_goes_first_on_pythonpath_and_the_callers_path_is_kept():
    env = tool.child_env({"PYTHONPATH": "/opt/isal-site"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/opt/isal-site"]
    assert tool.child_env({})["PYTHONPATH"] == str(REPO)


def test_environment_problems_name_what_to_do():
    ok = {"torch": "2.11.0", "cuda_available": True, "missing": {}, "fabric_path": str(REPO / "fabric" / "__init__.py")}
    assert tool.environment_problems(ok) == []
    assert tool.environment_problems({**ok, "cuda_available": False}) == ["no GPU found (torch 2.11.0, CUDA not available)"]
    (isal,) = tool.environment_problems({**ok, "missing": {"isal": "ModuleNotFoundError"}})
    assert "PYTHONPATH" in isal and "isal" in isal
    (other,) = tool.environment_problems({**ok, "fabric_path": "/usr/lib/python3/dist-packages/fabric/__init__.py"})
    assert "not this checkout" in other
    (no_torch,) = tool.environment_problems({"missing": {"torch": "ModuleNotFoundError: No module named 'torch'"}, "executable": "/usr/bin/python3"})
    assert no_torch.startswith("torch is not importable by /usr/bin/python3")


def test_pytest_command_uses_plugins_only_when_present(tmp_path):
    bare = tool.pytest_command("py", ("a.py",), tmp_path / "j.xml", {"pytest": "9"}, workers=4)
    assert bare[:4] == ["py", "-m", "pytest", "a.py"] and f"--junitxml={tmp_path / 'j.xml'}" in bare
    assert not any(arg.startswith("--timeout") for arg in bare) and "-n" not in bare
    full = tool.pytest_command("py", ("a.py",), tmp_path / "j.xml", {"pytest_timeout": "present", "xdist": "3"}, workers=4, select="x")
    assert f"--timeout={tool.PER_TEST_TIMEOUT}" in full and full[-4:] == ["-n", "4", "-k", "x"]


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="gpu-check">
<testcase classname="tests.gpu.test_device_jobs" name="test_on_the_gpu[ddp_world1]" time="9"/>
<testcase classname="tests.gpu.test_device_jobs" name="test_on_the_gpu[fsdp2_world1]" time="9"><failure message="x">boom</failure></testcase>
<testcase classname="tests.accelerators.test_cuda" name="test_nccl" time="1"><error message="y">setup</error></testcase>
<testcase classname="tests.test_dropin" name="test_cpu_only" time="0"><skipped message="z"/></testcase>
</testsuite></testsuites>"""


def test_junit_summary(tmp_path):
    (tmp_path / "junit.xml").write_text(JUNIT)
    summary = tool.summarize_junit(tmp_path / "junit.xml")
    assert summary == {
        "passed": 1,
        "failed": 1,
        "errors": 1,
        "skipped": 1,
        "total": 4,
        "failing": ["tests.gpu.test_device_jobs::test_on_the_gpu[fsdp2_world1]", "tests.accelerators.test_cuda::test_nccl"],
        "source": "junit",
    }
    assert tool.summarize_junit(tmp_path / "missing.xml") is None
    (tmp_path / "cut.xml").write_text(JUNIT[:100])
    assert tool.summarize_junit(tmp_path / "cut.xml") is None


def test_log_summary_of_a_run_cut_before_its_junit_file():
    serial = "tests/a.py::test_one PASSED  [ 10%]\ntests/a.py::test_two FAILED  [ 20%]\ntests/a.py::test_two ERROR  [ 20%]\n"
    xdist = "[gw0] [ 30%] PASSED tests/b.py::test_x[cuda] \n[gw1] [ 40%] SKIPPED tests/b.py::test_y \nsome other line PASSED\n"
    summary = tool.summarize_log(serial + xdist)
    assert (summary["passed"], summary["failed"], summary["errors"], summary["skipped"]) == (2, 0, 1, 1)
    assert summary["failing"] == ["tests/a.py::test_two"] and summary["source"] == "log"


def test_part_timeouts_keep_the_later_parts_time_within_the_budget():
    now = 1000.0
    assert tool.part_timeout("tests", now + 470, now, ["bench_step", "bench_save", "bench_load"]) == tool.PARTS["tests"][0]
    # the tests ran long: each bench part still gets at least its least time, never more than is left
    assert tool.part_timeout("bench_step", now + 120, now, ["bench_save", "bench_load"]) == 60
    assert tool.part_timeout("bench_load", now + 5, now, []) == tool.PARTS["bench_load"][1]


@pytest.mark.procs
def test_a_part_past_its_timeout_is_stopped_with_its_children(tmp_path):
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); print('started', flush=True); time.sleep(60)"
    start = time.monotonic()
    part = tool.run_part([sys.executable, "-c", code], 2, tmp_path / "slow.log", tool.child_env())
    assert part["status"] == "timeout" and time.monotonic() - start < 20
    assert "started" in part["tail"]
    failed = tool.run_part([sys.executable, "-c", "raise SystemExit(3)"], 30, tmp_path / "fail.log", tool.child_env())
    assert failed["status"] == "failed" and failed["returncode"] == 3


@pytest.mark.procs
def test_the_gpu_parts_plumbing_with_cpu_commands(tmp_path):
    """The benchmark parts as a GPU run does them, with the CPU's versions of their commands: the
    JSON holds each part's result as soon as it ends, a benchmark that fails is recorded, and the exit status says so."""
    out = tmp_path / "out"
    out.mkdir()
    check = tool.Check(out, sys.executable, budget=300)
    check.report["environment"] = {"gpu": "none (test)", "torch": "x", "modules": {"pytest_timeout": "present"}}
    # (the tests part's Check.tests runs in the make test above, as the CPU logic part)
    step, _, load = tool.bench_parts(sys.executable, out, device="cpu", quick=True)
    step_command = [*step[2], "--models", "mlp", "--precisions", "32-true"]
    check.benchmark(step[0], step[1], step_command, step[3], [])
    on_disk = json.loads((out / "gpu-check.json").read_text())
    assert on_disk["parts"]["bench_step"]["status"] == "passed"
    # Lightning Fabric is compared where it is importable (it was on the H200 this ran on)
    assert set(on_disk["benchmarks"]["step"]["cases"]["mlp/32-true"]["step_ratio"]) - {"lightning"} == {"fabric"}
    check.benchmark(load[0], load[1], [sys.executable, "-c", "raise SystemExit('no --device option')"], load[3], [])
    assert check.report["parts"]["bench_load"]["status"] == "failed"
    assert "no --device option" in check.report["benchmarks"]["load"]["tail"]
    assert check.finish() == 1
    lines = tool.human_summary(check.report)
    assert any(line.startswith("  step mlp/32-true: time fabric ") for line in lines)
    assert any("bench_load: failed" in line for line in lines) and lines[-1].startswith("result: FAILED")


def test_exit_status():
    passed = {"status": "passed"}
    assert tool.exit_status({"problems": [], "parts": {"probe": passed, "tests": passed}}) == 0
    assert tool.exit_status({"problems": [], "parts": {"probe": passed, "tests": {"status": "timeout"}}}) == 1
    assert tool.exit_status({"problems": ["no GPU found"], "parts": {"probe": passed}}) == 2
    assert tool.exit_status({"problems": [], "parts": {}}) == 1


# ---- benchmarks/gpu.py on the CPU -------------------------------------------------------------------------


def test_interleaved_blocks_rotate_the_order_and_ratios_are_against_raw():
    calls: list[str] = []
    variants = {name: (lambda name=name: calls.append(name)) for name in ("raw", "fabric", "lightning")}
    times = bench.interleaved(variants, rounds=3, steps=2, device=bench.Device("cpu"))
    assert {name: len(values) for name, values in times.items()} == {"raw": 3, "fabric": 3, "lightning": 3}
    firsts = calls[0::6]  # the first variant of each round (2 steps per block, 3 blocks per round)
    assert firsts == ["raw", "fabric", "lightning"]
    assert bench.ratios({"raw": 2.0, "fabric": 2.2, "lightning": None}) == {"fabric": pytest.approx(1.1), "lightning": None}


def test_step_and_save_benchmarks_run_their_logic_on_the_cpu(tmp_path):
    arguments = ["--device", "cpu", "--quick", "--models", "transformer", "--precisions", "bf16-mixed", "--no-lightning"]
    assert bench.main(["step", *arguments, "--json", str(tmp_path / "s.json")]) == 0
    step = json.loads((tmp_path / "s.json").read_text())
    case = step["cases"]["transformer/bf16-mixed"]
    assert step["device"] == "cpu" and step["torch"] and step["lightning"].startswith("not compared")
    assert set(case["step_ms"]) == {"raw", "fabric"} and case["step_ratio"]["fabric"] > 0
    assert bench.main(["save", "--device", "cpu", "--quick", "--reps", "1", "--json", str(tmp_path / "v.json"), "--dir", str(tmp_path / "w")]) == 0
    save = json.loads((tmp_path / "v.json").read_text())["cases"]["save"]
    assert set(save["seconds"]) >= {"torch.save", "torch.save+fsync", "fabric.save"} and save["ratio_to_torch_save"]["fabric.save"] > 0
    assert list((tmp_path / "w").iterdir()) == []  # every save's file is removed after it is timed


def test_the_transformer_is_about_100m_parameters():
    import torch

    with torch.device("meta"):
        model = bench.make_transformer(bench.transformer_config(quick=False))
    assert 90e6 < sum(p.numel() for p in model.parameters()) < 130e6


def test_gpu_benchmark_without_a_gpu_says_so(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert bench.main(["step", "--json", str(tmp_path / "s.json")]) == 2
    assert "no GPU found" in capsys.readouterr().err
