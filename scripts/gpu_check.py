"""The GPU check: every CUDA test and the GPU benchmarks in one command, results in one folder.

    make gpu-check OUT=<folder>            # or: python3 scripts/gpu_check.py <folder>

Runs with the ``python3`` it is started with: no virtual environment, no package index. It needs torch (with
CUDA), pytest and numpy/lightning-utilities where that python finds them, this checkout (put first on
``PYTHONPATH`` here for every part) and ``isal`` (supply it on ``PYTHONPATH`` if the machine lacks it).
pytest-timeout, pytest-xdist and Lightning Fabric are used when present.

Parts, each in its own process with a timeout, all within one budget (``--budget``, default 470 s):

1. ``probe``: python, torch, CUDA, the GPU, and which of the modules above import.
2. ``tests``: one pytest run over the CUDA tests (``CUDA_TESTS``), junit to ``<folder>/junit.xml``.
3. ``bench_step``: ``benchmarks/gpu.py step`` (step time and peak memory, raw / Fabric / Lightning).
4. ``bench_save``: ``benchmarks/gpu.py save`` (``fabric.save`` vs ``torch.save`` from the GPU).
5. ``bench_load``: ``benchmarks/checkpoint_load.py --device cuda --json <folder>/load.json``.

``<folder>/gpu-check.json`` is rewritten after every part (a run cut short keeps what it had); each part's
output is in ``<folder>/<part>.log``. Without a GPU it says so, runs the CPU versions of the GPU jobs
(``tests/gpu/test_device_jobs.py::test_on_the_cpu``: the logic of every CUDA part) unless ``--no-cpu-logic``, and exits 2.
Exit status: 0 all passed, 1 a test or part failed, 2 no GPU or a module missing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

# the CUDA tests: files whose tests run on the GPU when there is one (the rest of each file is quick CPU tests)
CUDA_TESTS = (
    "tests/accelerators/test_cuda.py",
    "tests/gpu/test_device_jobs.py::test_on_the_gpu",
    "tests/utilities/test_throughput.py",
    "tests/test_dropin.py",
    "tests/plugins/test_precision.py",
    "tests/plugins/test_bitsandbytes.py",
    "tests/checkpoint/formats/test_device_load.py",
)
CPU_LOGIC_TESTS = ("tests/gpu/test_device_jobs.py::test_on_the_cpu",)
REQUIRED = ("torch", "numpy", "lightning_utilities", "pytest", "isal", "fabric")
OPTIONAL = ("pytest_timeout", "xdist", "hypothesis")
PER_TEST_TIMEOUT = 240
BUDGET = 470  # seconds for the whole check: under 8 minutes with the start-up around it

# part -> (its own timeout, the least time it is left when earlier parts ran long)
PARTS = {
    "probe": (90, 20),
    "tests": (300, 60),
    "bench_step": (150, 45),
    "bench_save": (90, 30),
    "bench_load": (120, 30),
    "cpu_logic_tests": (300, 60),  # without a GPU
}

PROBE = r"""
import importlib, json, sys
info = {"python": sys.version.split()[0], "executable": sys.executable, "modules": {}, "missing": {}}
try:
    import torch
    info["torch"] = torch.__version__
    info["cuda_build"] = torch.version.cuda
    info["cuda_available"] = torch.cuda.is_available()
    if info["cuda_available"]:
        info["gpu_count"] = torch.cuda.device_count()
        info["gpu"] = torch.cuda.get_device_name(0)
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        info["memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        info["bf16"] = torch.cuda.is_bf16_supported()
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as err:
            info["nccl"] = f"unknown ({type(err).__name__})"
except Exception as err:
    info["missing"]["torch"] = f"{type(err).__name__}: {err}"
for name in NAMES:
    try:
        module = importlib.import_module(name)
        info["modules"][name] = str(getattr(module, "__version__", "present"))
        if name == "fabric":
            info["fabric_path"] = str(getattr(module, "__file__", ""))
    except Exception as err:
        info["missing"][name] = f"{type(err).__name__}: {err}"
for name in ("lightning.fabric", "lightning_fabric"):
    try:
        importlib.import_module(name)
        from importlib.metadata import version
        info["lightning"] = f"{name} {version(name.split('.')[0].replace('_', '-'))}"
        break
    except Exception:
        pass
print("PROBE " + json.dumps(info))
"""


# ---- pure logic (tested on the CPU) -------------------------------------------------------------------------


def child_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The caller's environment with this checkout first on PYTHONPATH (the caller's PYTHONPATH, e.g. isal's folder, after)."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def environment_problems(probe: dict[str, Any]) -> list[str]:
    """What keeps the check from running, one plain sentence each (empty: all there)."""
    problems = []
    missing = probe.get("missing", {})
    if "torch" in missing:
        return [f"torch is not importable by {probe.get('executable', 'python3')}: {missing['torch']}"]
    if not probe.get("cuda_available"):
        problems.append(f"no GPU found (torch {probe.get('torch')}, CUDA not available)")
    if "isal" in missing:
        problems.append(
            "isal is not importable: put the folder that holds the isal package on PYTHONPATH, e.g."
            " `PYTHONPATH=/path/to/site-packages make gpu-check OUT=...` (this checkout is added before it)"
        )
    for name in REQUIRED:
        if name in missing and name not in ("torch", "isal"):
            problems.append(f"{name} is not importable: {missing[name]}")
    fabric_path = probe.get("fabric_path")
    if fabric_path and not Path(fabric_path).resolve().is_relative_to(REPO):
        problems.append(f"`import fabric` found {fabric_path}, not this checkout ({REPO}): remove it from the path")
    return problems


def pytest_command(python: str, paths: tuple[str, ...], junit: Path, modules: dict[str, str], workers: int = 0, select: str | None = None) -> list[str]:
    """One pytest run over ``paths``: verbose (the log says which test did what even if the run is cut), junit, timeouts
    and workers only where their plugins are installed."""
    command = [python, "-m", "pytest", *paths, "-v", "-rfEs", f"--junitxml={junit}", "-o", "junit_suite_name=gpu-check", "-p", "no:cacheprovider"]
    if "pytest_timeout" in modules:
        command.append(f"--timeout={PER_TEST_TIMEOUT}")
    if workers > 0 and "xdist" in modules:
        command += ["-n", str(workers)]
    if select:
        command += ["-k", select]
    return command


def summarize_junit(path: Path) -> dict[str, Any] | None:
    """Counts and failing test ids of a junit file (None when there is none, or it is unreadable)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failing: list[str] = []
    for case in root.iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag for child in case}
        if "error" in kinds:
            counts["errors"] += 1
            failing.append(test_id)
        elif "failure" in kinds:
            counts["failed"] += 1
            failing.append(test_id)
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {**counts, "total": sum(counts.values()), "failing": failing, "source": "junit"}


_WORDS = "PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS"
_OUTCOME = re.compile(rf"(?:^(?P<id1>\S+::\S+) (?P<o1>{_WORDS}))|(?:(?P<o2>{_WORDS}) (?P<id2>\S+::\S+))")


def summarize_log(text: str) -> dict[str, Any]:
    """The same counts from pytest's ``-v`` lines (serial ``ID PASSED`` and xdist ``[gw0] ... PASSED ID``): what a run
    killed before writing its junit file still tells."""
    outcome_of: dict[str, str] = {}
    for line in text.splitlines():
        match = _OUTCOME.search(line)
        if match:
            test_id = match.group("id1") or match.group("id2")
            outcome = match.group("o1") or match.group("o2")
            if outcome == "ERROR" or outcome_of.get(test_id) != "ERROR":  # an error at teardown follows a pass
                outcome_of[test_id] = outcome
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    key = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "errors", "SKIPPED": "skipped", "XFAIL": "skipped"}
    for outcome in outcome_of.values():
        counts[key[outcome]] += 1
    failing = [test_id for test_id, outcome in outcome_of.items() if outcome in ("FAILED", "ERROR")]
    return {**counts, "total": len(outcome_of), "failing": failing, "source": "log"}


def part_timeout(name: str, deadline: float, now: float, later: list[str]) -> float:
    """A part's timeout: its own, but never eating the least time the parts after it need before the deadline."""
    own, _ = PARTS[name]
    reserve = sum(PARTS[part][1] for part in later)
    return max(PARTS[name][1], min(own, deadline - now - reserve))


def part_ok(part: dict[str, Any]) -> bool:
    return part.get("status") == "passed"


def exit_status(report: dict[str, Any]) -> int:
    if report.get("problems"):
        return 2
    return 0 if report["parts"] and all(part_ok(part) for part in report["parts"].values()) else 1


def _ratio_text(ratios: dict[str, Any], baseline: str) -> str:
    shown = [f"{name} {value:.3f}x" for name, value in ratios.items() if isinstance(value, (int, float))]
    return f"{', '.join(shown)} of {baseline}" if shown else "no ratio"


def human_summary(report: dict[str, Any]) -> list[str]:
    """A few lines for the terminal: where it ran, the test counts, each benchmark's ratios, the verdict."""
    env = report.get("environment", {})
    lines = [
        f"gpu-check: {env.get('gpu') or 'no GPU'}; torch {env.get('torch')} (CUDA {env.get('cuda_build') or 'not built'}); python {env.get('python')};"
        f" fabric {report.get('revision') or '?'}; Lightning: {env.get('lightning') or 'not installed'}"
    ]
    lines += [f"  problem: {problem}" for problem in report.get("problems", [])]
    for name, part in report["parts"].items():
        if name == "probe":
            continue
        tests = part.get("tests")
        detail = ""
        if tests:
            detail = f": {tests['passed']} passed, {tests['failed']} failed, {tests['errors']} errors, {tests['skipped']} skipped"
            detail += "".join(f"\n    failing: {test_id}" for test_id in tests["failing"][:20])
        elif part.get("status") != "passed":
            detail = f": {part.get('reason', '')}"
        lines.append(f"  {name}: {part.get('status')} in {part.get('seconds', 0):.0f} s{detail}")
    bench = report.get("benchmarks", {})
    for case, values in bench.get("step", {}).get("cases", {}).items():
        lines.append(f"  step {case}: time {_ratio_text(values.get('step_ratio', {}), 'raw')}; peak memory {_ratio_text(values.get('peak_ratio', {}), 'raw')}")
    save = bench.get("save", {}).get("cases", {}).get("save")
    if save:
        lines.append(f"  save ({save.get('state')}): {_ratio_text(save.get('ratio_to_torch_save', {}), 'torch.save')}")
    if "load" in bench:
        lines.append(f"  load: {json.dumps(bench['load'])[:300]}")
    lines.append(f"result: {['OK', 'FAILED', 'NOT RUN (see the problems above)'][exit_status(report)]} -> {report.get('json')}")
    return lines


def write_json(path: Path, data: dict[str, Any]) -> None:
    temp = path.with_name(path.name + ".tmp")
    temp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(temp, path)


# ---- running the parts --------------------------------------------------------------------------------------


def run_part(command: list[str], timeout: float, log: Path, env: dict[str, str]) -> dict[str, Any]:
    """Run ``command`` in its own process group with its output in ``log``; stop the whole group at ``timeout``."""
    start = time.monotonic()
    with open(log, "wb") as out:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            returncode: int | None = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            returncode = None
            _stop_group(process)
    result: dict[str, Any] = {"command": command, "seconds": round(time.monotonic() - start, 1), "log": str(log)}
    if returncode is None:
        result.update(status="timeout", reason=f"stopped after {timeout:.0f} s")
    elif returncode != 0:
        result.update(status="failed", returncode=returncode, reason=f"exited with {returncode}")
    else:
        result.update(status="passed", returncode=0)
    if result["status"] != "passed":
        result["tail"] = _tail(log)
    return result


def _stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the part's process group (pytest, its workers, the jobs they started), SIGKILL after 10 s."""
    for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(log: Path, limit: int = 3000) -> str:
    try:
        return log.read_bytes()[-limit:].decode(errors="replace")
    except OSError:
        return ""


def probe(python: str, out: Path, timeout: float) -> tuple[dict[str, Any], dict[str, Any]]:
    code = PROBE.replace("NAMES", repr(REQUIRED[1:] + OPTIONAL))
    part = run_part([python, "-c", code], timeout, out / "probe.log", child_env())
    part["command"] = [python, "-c", "<the probe in scripts/gpu_check.py>"]
    lines = [line for line in _tail(out / "probe.log", 100_000).splitlines() if line.startswith("PROBE ")]
    info = json.loads(lines[-1][len("PROBE ") :]) if lines else {"missing": {"torch": f"the probe printed nothing ({part.get('reason')})"}}
    return part, info


def revision() -> str | None:
    try:
        result = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10)
        return result.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


class Check:
    """The report and the clock of one run: each part's result lands in the JSON as soon as it is known."""

    def __init__(self, out: Path, python: str, budget: float) -> None:
        self.out = out
        self.python = python
        self.deadline = time.monotonic() + budget
        self.json_path = out / "gpu-check.json"
        self.report: dict[str, Any] = {
            "tool": "make gpu-check (scripts/gpu_check.py)",
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "json": str(self.json_path),
            "junit": str(out / "junit.xml"),
            "revision": revision(),
            "budget_s": budget,
            "environment": {},
            "problems": [],
            "parts": {},
            "benchmarks": {},
            "status": "running",
        }
        self.write()

    def write(self) -> None:
        write_json(self.json_path, self.report)

    def timeout_for(self, name: str, later: list[str]) -> float:
        return part_timeout(name, self.deadline, time.monotonic(), later)

    def record(self, name: str, part: dict[str, Any]) -> None:
        self.report["parts"][name] = part
        print(f"[gpu-check] {name}: {part['status']} in {part['seconds']:.0f} s", flush=True)
        self.write()

    def tests(self, name: str, paths: tuple[str, ...], later: list[str], workers: int = 0, select: str | None = None) -> None:
        junit = self.out / "junit.xml"
        junit.unlink(missing_ok=True)
        command = pytest_command(self.python, paths, junit, self.report["environment"].get("modules", {}), workers, select)
        part = run_part(command, self.timeout_for(name, later), self.out / f"{name}.log", child_env())
        part["tests"] = summarize_junit(junit) or summarize_log(_tail(self.out / f"{name}.log", 10_000_000))
        if part["status"] == "passed" and (part["tests"]["failed"] or part["tests"]["errors"]):
            part["status"] = "failed"  # a pytest that exited 0 with failures cannot happen; a junit that says so wins
        self.record(name, part)

    def benchmark(self, name: str, key: str, command: list[str], result_json: Path, later: list[str]) -> None:
        result_json.unlink(missing_ok=True)
        part = run_part(command, self.timeout_for(name, later), self.out / f"{name}.log", child_env())
        try:
            self.report["benchmarks"][key] = json.loads(result_json.read_text())
        except (OSError, ValueError) as err:
            self.report["benchmarks"][key] = {"error": f"no results ({type(err).__name__}): {part.get('reason', '')}", "tail": _tail(self.out / f"{name}.log")}
            if part["status"] == "passed":
                part.update(status="failed", reason=f"wrote no {result_json.name}")
        self.record(name, part)

    def finish(self) -> int:
        status = exit_status(self.report)
        self.report["status"] = ["passed", "failed", "not run"][status]
        self.report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self.write()
        print("\n".join(human_summary(self.report)), flush=True)
        return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="exit status: 0 passed, 1 failed, 2 no GPU or a module missing")
    parser.add_argument("out", type=Path, help="folder for gpu-check.json, junit.xml and the parts' logs (created)")
    parser.add_argument("--budget", type=float, default=BUDGET, help=f"seconds for the whole check (default {BUDGET})")
    parser.add_argument("--workers", type=int, default=0, help="pytest-xdist workers for the tests (default 0: one process)")
    parser.add_argument("--no-cpu-logic", action="store_true", help="without a GPU, stop after the probe")
    parser.add_argument("-k", dest="select", default=None, help="pytest -k expression for the tests part (a partial check)")
    parser.add_argument("--no-bench", action="store_true", help="the tests only")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out.resolve()
    check = Check(out, sys.executable, args.budget)
    print(f"[gpu-check] {sys.executable}, results in {out}", flush=True)
    try:
        return run(check, args)
    except BaseException as err:  # a bug here, or Ctrl-C: the JSON still says what ran and why it stopped
        check.record("gpu_check", {"status": "failed", "seconds": 0, "reason": f"{type(err).__name__}: {err}", "tail": traceback.format_exc()[-3000:]})
        check.finish()
        return 130 if isinstance(err, KeyboardInterrupt) else 1


def run(check: Check, args: argparse.Namespace) -> int:
    out = check.out
    part, info = probe(sys.executable, out, check.timeout_for("probe", ["tests"]))
    check.report["environment"] = info
    check.report["problems"] = environment_problems(info)
    check.record("probe", part)
    for problem in check.report["problems"]:
        print(f"[gpu-check] {problem}", flush=True)
    if check.report["problems"]:
        if info.get("missing", {}).keys() & {"torch", "pytest", "fabric"} or args.no_cpu_logic or info.get("cuda_available"):
            return check.finish()
        # no GPU: the CPU versions of the GPU jobs still show their logic works on this machine
        check.tests("cpu_logic_tests", CPU_LOGIC_TESTS, [], select=args.select)
        return check.finish()

    benches = [] if args.no_bench else bench_parts(check.python, out)
    check.tests("tests", CUDA_TESTS, [bench[0] for bench in benches], workers=args.workers, select=args.select)
    for index, (name, key, command, result_json) in enumerate(benches):
        check.benchmark(name, key, command, result_json, [bench[0] for bench in benches[index + 1 :]])
    return check.finish()


def bench_parts(python: str, out: Path, device: str = "cuda", quick: bool = False) -> list[tuple[str, str, list[str], Path]]:
    """(part, key in the report, command, the JSON it writes) of each benchmark; ``device="cpu", quick=True`` is the
    CPU test's small version of the same commands."""
    small = ["--quick"] if quick else []
    load_size = ["--size-mb", "8", "--reps", "2"] if quick else ["--reps", "5"]
    return [
        ("bench_step", "step", [python, "benchmarks/gpu.py", "step", "--device", device, *small, "--json", str(out / "step.json")], out / "step.json"),
        ("bench_save", "save", [python, "benchmarks/gpu.py", "save", "--device", device, *small, "--json", str(out / "save.json")], out / "save.json"),
        (
            "bench_load",
            "load",
            [python, "benchmarks/checkpoint_load.py", "--device", device, "--json", str(out / "load.json"), *load_size],
            out / "load.json",
        ),
    ]


if __name__ == "__main__":
    sys.exit(main())
