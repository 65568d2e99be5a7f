"""How the cost of a job's life grows with the number of ranks, on one machine with trivial compute.

For N = 2, 4, 8, 16, 32 processes (``--ranks``), each a real ``python -m fabric run --devices N`` job on
the CPU (gloo on loopback):

* **start**: from the command to every rank past its first collective (an ``all_reduce``);
* **restart**: with ``--max-restarts 1``, from the moment the last rank kills itself (SIGKILL) after its
  first collective to every rank of the second attempt past its first collective after loading the
  checkpoint of the first attempt (noticing, stopping everyone, starting again, rendezvous, load);
* **sharded save** and **sharded load** of a fixed-size model (``--size-mb``, sharded with FSDP over the N
  ranks, with its Adam state), as rank 0 times them between barriers.

Rows go to stdout and to ``--out`` (JSON); ``--plot FILE.png`` draws the curves. On a 2-core machine the
N processes share two cores, so what grows with N is mostly CPU time that a machine with N cores runs in
parallel (each process imports torch, ~2 CPU-seconds); the time per rank (total / N) tells whether
anything of ours grows faster than linearly.

    python benchmarks/scaling.py [--ranks 2 4 8 16 32] [--size-mb 32] [--out scaling.json] [--plot scaling.png]
    python benchmarks/scaling.py --replot scaling.json --plot scaling.png
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

JOB = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from pathlib import Path
    import torch
    from torch import nn
    from fabric import Fabric

    out, mode, size_mb = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    fabric = Fabric(accelerator="cpu", strategy="fsdp" if mode == "checkpoint" else "ddp")
    fabric.launch()
    rank = fabric.global_rank
    width = 512
    layers = max(1, size_mb * 2**20 // (4 * width * width))
    model = fabric.setup_module(nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers))))
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-3))
    state = {"model": model, "optimizer": optimizer, "attempt": attempt}
    if mode == "restart" and attempt == 1:
        fabric.load(out / "ckpt.pt", state)
    fabric.all_reduce(torch.ones(1))
    (out / f"{mode}-{attempt}-rank{rank}.json").write_text(json.dumps({"past_first_collective": time.time()}))
    if mode == "restart" and attempt == 0:
        fabric.save(out / "ckpt.pt", state)
        fabric.barrier()
        if rank == fabric.world_size - 1:
            (out / "killed.json").write_text(json.dumps({"at": time.time()}))
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)  # the others wait to be stopped
    if mode == "checkpoint":
        model(torch.randn(2, width)).sum().backward()
        optimizer.step()
        times = {}
        for name, step in (("save", lambda: fabric.save(out / "sharded", state)), ("load", lambda: fabric.load(out / "sharded", state))):
            fabric.barrier()
            start = time.perf_counter()
            step()
            fabric.barrier()
            times[name] = time.perf_counter() - start
        if rank == 0:
            (out / "checkpoint.json").write_text(json.dumps(times))
    """
)


def fabric_run(ranks: int, script: Path, *args: str, restarts: int = 0, timeout: float = 900) -> float:
    """Run ``script`` as an N-rank job; return the wall time at which the command was started."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "fabric", "run", "--accelerator", "cpu", "--devices", str(ranks)]
    if restarts:
        command += ["--max-restarts", str(restarts)]
    started = time.time()
    result = subprocess.run([*command, str(script), *args], env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"{ranks}-rank job failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return started


def last_past_first_collective(folder: Path, mode: str, attempt: int, ranks: int) -> float:
    return max(json.loads((folder / f"{mode}-{attempt}-rank{rank}.json").read_text())["past_first_collective"] for rank in range(ranks))


def measure(ranks: int, size_mb: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix=f"scaling-{ranks}-") as name:
        folder = Path(name)
        script = folder / "job.py"
        script.write_text(JOB)
        started = fabric_run(ranks, script, str(folder), "start", "1")
        start = last_past_first_collective(folder, "start", 0, ranks) - started
        fabric_run(ranks, script, str(folder), "restart", "1", restarts=1)
        killed = json.loads((folder / "killed.json").read_text())["at"]
        restart = last_past_first_collective(folder, "restart", 1, ranks) - killed
        fabric_run(ranks, script, str(folder), "checkpoint", str(size_mb))
        checkpoint = json.loads((folder / "checkpoint.json").read_text())
    return {"ranks": ranks, "start_s": start, "restart_s": restart, "save_s": checkpoint["save"], "load_s": checkpoint["load"]}


def plot(rows: list[dict[str, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = [row["ranks"] for row in rows]
    figure, (total, per_rank) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("start_s", "start to first collective"), ("restart_s", "kill to first collective after restart"),
                       ("save_s", "sharded save"), ("load_s", "sharded load")):
        total.plot(ranks, [row[key] for row in rows], marker="o", label=label)
        per_rank.plot(ranks, [row[key] / row["ranks"] for row in rows], marker="o", label=label)
    total.set_yscale("log")  # with log ranks too: linear growth is a line of slope 1
    for axes, title in ((total, "seconds (log scale)"), (per_rank, "seconds per rank")):
        axes.set_xscale("log", base=2)
        axes.set_xticks(ranks, [str(n) for n in ranks])
        axes.set_xlabel("ranks (processes on one 2-core machine)")
        axes.set_title(title)
        axes.grid(alpha=0.3)
    total.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    parser.add_argument("--size-mb", type=int, default=32)
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--replot", default=None, help="draw --plot from the rows of an earlier --out file, running nothing")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), args.plot)
        return
    rows = []
    print(f"{'ranks':>5s} {'start s':>8s} {'restart s':>9s} {'save s':>7s} {'load s':>7s}")
    for ranks in args.ranks:
        row = measure(ranks, args.size_mb)
        rows.append(row)
        print(f"{ranks:5d} {row['start_s']:8.2f} {row['restart_s']:9.2f} {row['save_s']:7.2f} {row['load_s']:7.2f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
