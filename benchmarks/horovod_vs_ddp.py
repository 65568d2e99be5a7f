"""Step time of one model under HorovodStrategy and under the DDP strategy, 2 processes on the CPU.

    python benchmarks/horovod_vs_ddp.py [--steps 60] [--width 1024] [--rounds 3]

Two jobs of 2 processes (one intra-op thread each): under `horovodrun`, Fabric with strategy="horovod"
and the raw Horovod loop (hvd.DistributedOptimizer); with Fabric's own launcher, Fabric with
strategy="ddp" and a raw DistributedDataParallel loop in the same process group. Within a job the
Fabric and raw steps alternate, so both see the same machine load and their ratio is the wrapper's
cost. Horovod against DDP compares two jobs: they run alternately for a few rounds and the best
median of each counts, to damp noise from other work on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 10


def build(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def alternate(steps: dict[str, Callable[[], None]], count: int, barrier: Callable[[], None]) -> dict[str, list[float]]:
    """Run the steps in turn ``WARMUP + count`` times; the seconds each took after the warm-up."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(WARMUP + count):
        for name, step in steps.items():
            barrier()  # every rank starts the step together, as in a training loop
            start = time.perf_counter()
            step()
            if i >= WARMUP:
                times[name].append(time.perf_counter() - start)
    return times


def worker(strategy: str, args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT))
    from fabric import Fabric

    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", strategy=strategy, **({"devices": 2} if strategy == "ddp" else {}))
    fabric.launch()
    x, y = torch.randn(64, 256), torch.randint(10, (64,))
    loss_fn = torch.nn.functional.cross_entropy

    model = fabric.setup_module(build(args.width))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))

    def fabric_step() -> None:
        fabric.backward(loss_fn(model(x), y))
        optimizer.step()
        optimizer.zero_grad()

    raw_model = build(args.width)
    if strategy == "horovod":
        import horovod.torch as hvd

        hvd.broadcast_parameters(raw_model.state_dict(), root_rank=0)
        named = [(f"raw.{name}", p) for name, p in raw_model.named_parameters()]
        sgd = torch.optim.SGD(raw_model.parameters(), lr=0.01, momentum=0.9)
        raw_optimizer = hvd.DistributedOptimizer(sgd, named_parameters=named)
    else:
        raw_model = torch.nn.parallel.DistributedDataParallel(raw_model)
        raw_optimizer = torch.optim.SGD(raw_model.parameters(), lr=0.01, momentum=0.9)

    def raw_step() -> None:
        loss_fn(raw_model(x), y).backward()
        raw_optimizer.step()
        raw_optimizer.zero_grad()

    times = alternate({"fabric": fabric_step, "raw": raw_step}, args.steps, fabric.barrier)
    if fabric.global_rank == 0:
        Path(args.out).write_text(json.dumps(times))


def run_job(strategy: str, args: argparse.Namespace, folder: Path) -> dict[str, float]:
    out = folder / f"{strategy}.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", strategy, "--out", str(out)]
    command += ["--steps", str(args.steps), "--width", str(args.width)]
    if strategy == "horovod":
        horovodrun = shutil.which("horovodrun", path=str(Path(sys.executable).parent)) or shutil.which("horovodrun")
        if horovodrun is None:
            raise SystemExit("horovodrun not found: build Horovod with `make horovod` first")
        command = [horovodrun, "--gloo", "-np", "2", "-H", "localhost:2", *command]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run(command, env=env, check=True, timeout=600, stdout=subprocess.DEVNULL)
    return {name: statistics.median(values) for name, values in json.loads(out.read_text()).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3, help="each job runs this many times, alternately")
    parser.add_argument("--worker", choices=["horovod", "ddp"])
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args)
        return

    parameters = sum(p.numel() for p in build(args.width).parameters())
    size = f"{parameters / 1e6:.2f} M parameters"
    print(f"model: MLP 256-{args.width}-{args.width}-10 ({size}), SGD, batch 64 per process")
    print(
        f"2 processes x 1 thread on {os.cpu_count()} CPU cores; median of {args.steps} steps after {WARMUP} warm-up;"
        f" best of {args.rounds} rounds"
    )
    rounds: dict[str, list[dict[str, float]]] = {"horovod": [], "ddp": []}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.rounds):
            for strategy in rounds:
                rounds[strategy].append(run_job(strategy, args, Path(folder)))
    best = {
        f"{kind} {strategy}": min(result[kind] for result in results)
        for strategy, results in rounds.items()
        for kind in ("fabric", "raw")
    }
    for name, seconds in best.items():
        kind, strategy = name.split()
        each = ", ".join(f"{result[kind] * 1000:.1f}" for result in rounds[strategy])
        print(f"  {strategy:8s} {kind:7s} {seconds * 1000:8.2f} ms/step   (rounds: {each})")
    overhead = {s: statistics.median(r["fabric"] / r["raw"] for r in rounds[s]) for s in rounds}
    print(f"fabric / raw, horovod:   {overhead['horovod']:.3f}  (median over rounds, same-job ratio)")
    print(f"fabric / raw, ddp:       {overhead['ddp']:.3f}")
    print(f"horovod / ddp, fabric:   {best['fabric horovod'] / best['fabric ddp']:.3f}")
    print(f"horovod / ddp, raw:      {best['raw horovod'] / best['raw ddp']:.3f}")


if __name__ == "__main__":
    main()
