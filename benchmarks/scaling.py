"""How the cost of a job's life grows with the number of ranks, on one machine with trivial compute.

For N = 2, 4, 8, 16, 32 processes (``--ranks``), each a real ``python -m fabric run --devices N`` job on
the CPU (gloo on loopback):

* **start**: from the command to every rank past its first collective (an ``all_reduce``);
* **restart**: with ``--max-restarts 1``, from the moment the last rank kills itself (SIGKILL) after its
  first collective to every rank of the second attempt past its first collective after loading the
  checkpoint of the first attempt (noticing, stopping everyone, starting again, rendezvous, load);
* **sharded save** and **sharded load** of a fixed-size model (``--size-mb``, sharded with FSDP over the N
  ranks, with its Adam state), as rank 0 times them between barriers.

With ``--nodes K ...`` the same N ranks are K "nodes" of ``--per-node`` ranks each: K separate
``python -m fabric run --num-nodes K --node-rank i`` launches on loopback (started together), the
restart going through the nodes' rendezvous (``--max-restarts 1``: the killed rank's node stops its
ranks and waits for the next round, the others see it waiting, stop theirs and join).

Rows go to stdout and to ``--out`` (JSON); ``--plot FILE.png`` draws the curves. On a 2-core machine the
N processes share two cores, so what grows with N is mostly CPU time that a machine with N cores runs in
parallel (each process imports torch, ~2 CPU-seconds); the time per rank (total / N) tells whether
anything of ours grows faster than linearly.

    python benchmarks/scaling.py [--ranks 2 4 8 16 32] [--size-mb 32] [--out scaling.json] [--plot scaling.png]
    python benchmarks/scaling.py --nodes 2 4 8 16 --per-node 2 [--out scaling_nodes.json] [--plot scaling_nodes.png]
    python benchmarks/scaling.py --replot scaling.json scaling_nodes.json --plot scaling.png
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


def fabric_run(ranks: int, script: Path, *args: str, restarts: int = 0, nodes: int = 1, timeout: float = 900) -> float:
    """Run ``script`` as an N-rank job (``nodes`` launches of N / nodes ranks); return when the first was started."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    per_node = ranks // nodes
    command = [sys.executable, "-m", "fabric", "run", "--accelerator", "cpu", "--devices", str(per_node)]
    if restarts:
        command += ["--max-restarts", str(restarts)]
    if nodes > 1:
        command += ["--num-nodes", str(nodes), "--main-port", str(_free_port())]
    started = time.time()
    launches = [subprocess.Popen([*command, *(["--node-rank", str(node)] if nodes > 1 else []), str(script), *args],
                                 env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                for node in range(nodes)]
    failures = []
    for node, launch in enumerate(launches):
        _, err = launch.communicate(timeout=timeout)
        if launch.returncode != 0:
            failures.append(f"node {node} ({launch.returncode}):\n{err[-3000:]}")
    if failures:
        raise RuntimeError(f"{ranks}-rank job failed: " + "\n".join(failures))
    return started


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def last_past_first_collective(folder: Path, mode: str, attempt: int, ranks: int) -> float:
    return max(json.loads((folder / f"{mode}-{attempt}-rank{rank}.json").read_text())["past_first_collective"] for rank in range(ranks))


def measure(ranks: int, size_mb: int, nodes: int = 1) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix=f"scaling-{ranks}-") as name:
        folder = Path(name)
        script = folder / "job.py"
        script.write_text(JOB)
        started = fabric_run(ranks, script, str(folder), "start", "1", nodes=nodes)
        start = last_past_first_collective(folder, "start", 0, ranks) - started
        fabric_run(ranks, script, str(folder), "restart", "1", restarts=1, nodes=nodes)
        killed = json.loads((folder / "killed.json").read_text())["at"]
        restart = last_past_first_collective(folder, "restart", 1, ranks) - killed
        fabric_run(ranks, script, str(folder), "checkpoint", str(size_mb), nodes=nodes)
        checkpoint = json.loads((folder / "checkpoint.json").read_text())
    return {"ranks": ranks, "nodes": nodes, "start_s": start, "restart_s": restart, "save_s": checkpoint["save"],
            "load_s": checkpoint["load"]}


def plot(rows: list[dict[str, float]], path: str) -> None:
    """Each measure against ranks: one launch solid, K node launches (rows with ``nodes`` > 1) dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (total, per_rank) = plt.subplots(1, 2, figsize=(11, 4.5))
    measures = (("start_s", "start to first collective"), ("restart_s", "kill to first collective after restart"),
                ("save_s", "sharded save"), ("load_s", "sharded load"))
    launches = (("one launch", [row for row in rows if row.get("nodes", 1) == 1], "-", "o"),
                ("a launch per node of 2", [row for row in rows if row.get("nodes", 1) > 1], "--", "s"))
    for index, (key, label) in enumerate(measures):
        color = f"C{index}"
        for how, chosen, style, marker in launches:
            if chosen:
                ranks = [row["ranks"] for row in chosen]
                name = f"{label} ({how})"
                total.plot(ranks, [row[key] for row in chosen], style, color=color, marker=marker, label=name)
                per_rank.plot(ranks, [row[key] / row["ranks"] for row in chosen], style, color=color, marker=marker)
    total.set_yscale("log")  # with log ranks too: linear growth is a line of slope 1
    ticks = sorted({row["ranks"] for row in rows})
    for axes, title in ((total, "seconds (log scale)"), (per_rank, "seconds per rank")):
        axes.set_xscale("log", base=2)
        axes.set_xticks(ticks, [str(n) for n in ticks])
        axes.set_xlabel("ranks (processes on one 2-core machine)")
        axes.set_title(title)
        axes.grid(alpha=0.3)
    figure.legend(*total.get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=7)
    figure.tight_layout(rect=(0, 0.16, 1, 1))
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    parser.add_argument("--nodes", type=int, nargs="+", default=None,
                        help="measure K launches of --per-node ranks each (nodes on loopback) instead of one launch")
    parser.add_argument("--per-node", type=int, default=2)
    parser.add_argument("--size-mb", type=int, default=32)
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--replot", nargs="+", default=None,
                        help="draw --plot from the rows of earlier --out files (one launch, nodes), running nothing")
    args = parser.parse_args()
    if args.replot:
        plot([row for name in args.replot for row in json.loads(Path(name).read_text())], args.plot)
        return
    rows = []
    shapes = [(nodes * args.per_node, nodes) for nodes in args.nodes] if args.nodes else [(ranks, 1) for ranks in args.ranks]
    print(f"{'ranks':>5s} {'nodes':>5s} {'start s':>8s} {'restart s':>9s} {'save s':>7s} {'load s':>7s}")
    for ranks, nodes in shapes:
        row = measure(ranks, args.size_mb, nodes)
        rows.append(row)
        print(f"{ranks:5d} {nodes:5d} {row['start_s']:8.2f} {row['restart_s']:9.2f} {row['save_s']:7.2f} {row['load_s']:7.2f}",
              flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
