"""How much importing fabric costs on top of ``import torch``.

What is measured is what a user's script does: ``from fabric import Fabric`` (``import fabric`` alone
resolves ``Fabric`` lazily and costs nothing). Fresh interpreters run ``import torch`` and
``import torch; from fabric import Fabric`` alternately (so disk cache, CPU frequency and background
load affect both alike); we report the medians and their difference, and list the modules that the
import brings in beyond torch, so a heavy new import shows up.

    python benchmarks/import_cost.py [--runs 15] [--top 15] [--clock cpu|wall]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
GOAL_S = 0.10
USER_IMPORT = "import torch; from fabric import Fabric"

_MODULES_DIFF = """
import json, sys, time
import torch
before = set(sys.modules)
start = time.process_time()
from fabric import Fabric
elapsed = time.process_time() - start
print(json.dumps({"elapsed": elapsed, "extra": sorted(set(sys.modules) - before)}))
"""


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.pop("PYTHONPROFILEIMPORTTIME", None)
    return env


def time_interpreter(code: str, env: dict[str, str]) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of a fresh ``python -c code``; start-up included, alike for both variants.

    CPU time (user + system, of the child alone) does not count the time the child waits for a core,
    so it stays meaningful on a machine busy with other work; wall time is what a user waits.
    """
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-c", code], env=env)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise RuntimeError(f"python -c {code!r} failed with exit code {process.returncode}")
    return usage.ru_utime + usage.ru_stime, wall


def extra_modules(env: dict[str, str]) -> tuple[float, list[str]]:
    out = subprocess.run([sys.executable, "-c", _MODULES_DIFF], env=env, check=True, capture_output=True, text=True)
    data = json.loads(out.stdout.strip().splitlines()[-1])
    return data["elapsed"], data["extra"]


def slowest_imports(env: dict[str, str], top: int) -> list[tuple[int, str]]:
    """(cumulative microseconds, module) of the slowest imports under ``fabric``, from ``-X importtime``."""
    code = "import torch; from fabric import Fabric"
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", code], env=env, capture_output=True, text=True, check=True)
    rows: list[tuple[int, str]] = []
    seen_torch = False
    for line in out.stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        parts = [part.strip() for part in line[len("import time:") :].split("|")]
        if len(parts) != 3 or not parts[1].isdigit():
            continue
        name = parts[2]
        if name == "torch" and not seen_torch:
            seen_torch = True
            continue
        if seen_torch:
            rows.append((int(parts[1]), name))
    slowest: dict[str, int] = {}
    for micros, name in rows:
        slowest[name] = max(micros, slowest.get(name, 0))
    return sorted(((micros, name) for name, micros in slowest.items()), reverse=True)[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=15, help="interpreters per variant (default 15)")
    parser.add_argument("--top", type=int, default=15, help="how many extra modules / slow imports to list")
    parser.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="cpu (default): user+system time of each interpreter, robust on a busy machine; wall: elapsed time",
    )
    args = parser.parse_args()

    env = _environment()
    base: list[tuple[float, float]] = []
    with_fabric: list[tuple[float, float]] = []
    time_interpreter("import torch", env)  # warm the file cache once, unmeasured
    for _ in range(args.runs):
        base.append(time_interpreter("import torch", env))
        with_fabric.append(time_interpreter(USER_IMPORT, env))
    index = 1 if args.clock == "wall" else 0
    torch_s = statistics.median(run[index] for run in base)
    fabric_s = statistics.median(run[index] for run in with_fabric)
    extra = fabric_s - torch_s
    other = 1 - index
    other_extra = statistics.median(run[other] for run in with_fabric) - statistics.median(run[other] for run in base)

    in_process, modules = extra_modules(env)
    own = [m for m in modules if m == "fabric" or m.startswith("fabric.")]
    foreign = [m for m in modules if m not in own]
    packages: dict[str, int] = {}
    for name in foreign:
        packages[name.split(".")[0]] = packages.get(name.split(".")[0], 0) + 1
    by_size = sorted(packages.items(), key=lambda item: (-item[1], item[0]))
    print(f"extra modules beyond torch: {len(modules)} ({len(own)} of fabric, {len(foreign)} others)")
    print(f"  fabric's: {', '.join(own)}")
    print(f"  others, by package (modules): {', '.join(f'{p} ({n})' for p, n in by_size) if by_size else '-'}")
    print("slowest imports after torch (-X importtime, cumulative, inflated by the measuring itself):")
    for micros, name in slowest_imports(env, args.top):
        print(f"  {micros / 1000:8.1f} ms  {name}")
    print(f"in-process `from fabric import Fabric` after torch: {in_process * 1000:.1f} ms CPU")
    status = "OK" if extra <= GOAL_S else "OVER GOAL"
    other_name = "wall" if args.clock == "cpu" else "cpu"
    print(
        f"import_cost: torch {torch_s:.2f} s, torch+fabric {fabric_s:.2f} s, extra {extra:+.2f} s"
        f" (goal <= +{GOAL_S:.2f} s) [{status}; {args.clock} time, median of {args.runs} runs each;"
        f" {other_name} time extra {other_extra:+.2f} s]"
    )


if __name__ == "__main__":
    main()
