"""Pipeline parallelism through Fabric: how close a schedule's step comes to its theory, and what Fabric adds to
torch's own pipelining code, in one run.

Every job runs on the CPU (gloo, ``OMP_NUM_THREADS=1`` per process), started by this script; its rank 0 writes
its numbers to a file, which this script reads.

1. Fixed-cost stages. A model of stages that do nothing but wait: each stage's forward sleeps ``tf/v`` and its
   backward ``tb/v`` (a custom autograd Function; ``v`` is the stages per rank), so a rank's work per microbatch is
   ``tf + tb`` under every schedule. Sleeping, not spinning, so that the cores are not what limits the step: this
   machine may have fewer cores than the job has processes (p=4 on 2 cores). Through
   ``Fabric(strategy=ModelParallelStrategy(pipeline_parallel_size=p, pipeline_split=<function>,
   pipeline_schedule=S, microbatches=m))``, a step is ``zero_grad``, ``fabric.pipeline_step``, ``optimizer.step()``,
   timed on rank 0 between barriers, the median of ``--steps`` steps after ``--warmup``. The theory:
   1F1B ``(m + p - 1)(tf + tb)`` (m microbatches' work plus p - 1 of warm-up and cool-down); Interleaved1F1B with
   v = 2 stages per rank ``(m + (p - 1)/v)(tf + tb)`` (the bubble is made of stages v times shorter). Goal: 1F1B
   within 10 % of its theory; Interleaved1F1B faster than 1F1B at the same p and m.
2. The small GPT of ``examples/pipeline/train_gpt.py`` (pp=2, one stage per rank, 1F1B, ``--gpt-microbatches``
   microbatches of ``--gpt-microbatch-size`` rows), in one 2-process job: through Fabric (``fabric.pipeline_step``,
   which also returns the step's loss on both ranks and averages the gradients over the microbatches) against
   raw ``torch.distributed.pipelining`` code as torchtitan writes it: the same model traced and split at the same
   module (``pipeline(..., split_spec=...)``), this rank's ``PipelineStage``, ``Schedule1F1B(..., scale_grads=False)``
   with the loss divided by the microbatches, ``schedule.step(..., return_outputs=False)``, the sum of the divided
   losses on the last stage. Both start from the same weights (their first losses are printed: equal); blocks of
   ``--gpt-steps`` steps alternate between them (the order flips every round) over ``--rounds`` rounds. Each block
   is timed on rank 0 between barriers (wall time), and by the CPU time both ranks spent in it (``process_time``,
   summed over the ranks, gloo's threads included: less moved by other work on the machine). The ratio is the
   median of the per-round ratios Fabric/raw, with their quartiles and range. Goal: <= 1.05x (wall time).

    .venv/bin/python benchmarks/pipeline.py [--tf-ms 20] [--tb-ms 40] [--steps 6] [--rounds 30] [--quick]

Prints a table and, last, one JSON line with every number. About 1.5 minutes on 2 cores (``--quick``: under one).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples" / "pipeline"))

#: (schedule, p, m) of part 1.
FIXED_COST_CASES = [("1F1B", 2, 4), ("Interleaved1F1B", 2, 4), ("1F1B", 4, 8), ("Interleaved1F1B", 4, 8)]
STAGES_PER_RANK = {"1F1B": 1, "Interleaved1F1B": 2}
WIDTH = 16
JOB_TIMEOUT_S = 300


# ---- part 1: stages of fixed cost ---------------------------------------------------------------------------


def fixed_cost_job(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from fabric import Fabric
    from fabric.strategies import ModelParallelStrategy

    class Wait(torch.autograd.Function):
        """Identity that sleeps ``forward_s`` in forward and ``backward_s`` in backward."""

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
            ctx.backward_s = backward_s
            time.sleep(forward_s)
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
            time.sleep(ctx.backward_s)
            return grad, None, None

    class FixedCostStage(nn.Module):
        def __init__(self, forward_s: float, backward_s: float) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(WIDTH))
            self.forward_s, self.backward_s = forward_s, backward_s

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Wait.apply(x * self.scale, self.forward_s, self.backward_s)

    class FixedCostModel(nn.Module):
        def __init__(self, stages: int, forward_s: float, backward_s: float) -> None:
            super().__init__()
            self.stages = nn.ModuleDict({str(index): FixedCostStage(forward_s, backward_s) for index in range(stages)})

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for stage in self.stages.values():
                x = stage(x)
            return x

    per_rank = STAGES_PER_RANK[args.schedule]
    model = FixedCostModel(args.p * per_rank, args.tf_ms / 1e3 / per_rank, args.tb_ms / 1e3 / per_rank)

    def split(module: nn.Module, index: int, count: int) -> nn.Module:
        """Stage ``index``: the model without the other stages, so that its parameters keep the whole model's names."""
        stage = copy.deepcopy(module)
        for name in [name for name in stage.stages if name != str(index)]:
            del stage.stages[name]
        return stage

    strategy = ModelParallelStrategy(lambda module, mesh: module, data_parallel_size=1, tensor_parallel_size=1,
                                     pipeline_parallel_size=args.p, pipeline_split=split, pipeline_schedule=args.schedule,
                                     microbatches=args.m)  # fmt: skip
    fabric = Fabric(accelerator="cpu", devices=args.p, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.01))
    x, y = torch.randn(2 * args.m, WIDTH), torch.randn(2 * args.m, WIDTH)

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (output - target).pow(2).mean()

    times = []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        started = time.perf_counter()
        optimizer.zero_grad()
        fabric.pipeline_step(model, x, target=y, loss_fn=loss_fn)
        optimizer.step()
        dist.barrier()
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
    if fabric.global_rank == 0:
        args.out.write_text(json.dumps({"times_s": times}))


# ---- part 2: the small GPT, Fabric against raw torch.distributed.pipelining ----------------------------------------


def gpt_job(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, SplitPoint, pipeline
    from train_gpt import GPT, VOCABULARY, next_token_loss, synthetic_text

    from fabric import Fabric
    from fabric.strategies import ModelParallelStrategy

    layers, microbatches = 4, args.gpt_microbatches
    split_at = "blocks.2"

    def make_model() -> GPT:
        torch.manual_seed(0)
        return GPT(len(VOCABULARY), 32, 64, layers, 4)

    strategy = ModelParallelStrategy(lambda module, mesh: module, data_parallel_size=1, tensor_parallel_size=1,
                                     pipeline_parallel_size=2, pipeline_split=[split_at], pipeline_schedule="1F1B",
                                     microbatches=microbatches)  # fmt: skip
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    rank = fabric.global_rank
    device = torch.device("cpu")

    tokens = torch.tensor([VOCABULARY.index(c) for c in synthetic_text(2000, 0)], dtype=torch.long)
    rows = microbatches * args.gpt_microbatch_size
    generator = torch.Generator().manual_seed(1)
    starts = torch.randint(0, len(tokens) - 33, (4, rows), generator=generator)
    batches = [(torch.stack([tokens[s : s + 32] for s in row]), torch.stack([tokens[s + 1 : s + 33] for s in row])) for row in starts.tolist()]

    # Fabric
    model = fabric.setup_module(make_model())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))

    def fabric_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = fabric.pipeline_step(model, x, target=y, loss_fn=next_token_loss)
        optimizer.step()
        return loss

    # raw torch.distributed.pipelining, as torchtitan writes it
    whole = make_model()
    traced = pipeline(whole, mb_args=(batches[0][0].tensor_split(microbatches)[0],), split_spec={split_at: SplitPoint.BEGINNING})
    stage = PipelineStage(traced.get_stage_module(rank), rank, 2, device, group=dist.group.WORLD)
    del traced, whole

    def scaled_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return next_token_loss(output, target) / microbatches

    schedule = Schedule1F1B(stage, n_microbatches=microbatches, loss_fn=scaled_loss, scale_grads=False)
    raw_optimizer = torch.optim.AdamW(stage.submod.parameters(), lr=1e-3)

    def raw_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raw_optimizer.zero_grad()
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x, return_outputs=False)
        else:
            schedule.step(target=y, losses=losses, return_outputs=False)
        raw_optimizer.step()
        return torch.stack(losses).sum() if losses else torch.tensor(-1.0)  # the losses were divided by the microbatches

    # the two start from the same weights, so their first losses agree (a check that both run the same model)
    fabric_first, raw_first = fabric_step(*batches[0]).item(), raw_step(*batches[0]).item()

    def block(step_fn: Any, steps: int) -> tuple[float, float]:
        """(wall seconds per step, CPU seconds per step of both ranks together)."""
        dist.barrier()
        started, cpu_started = time.perf_counter(), time.process_time()
        for index in range(steps):
            step_fn(*batches[index % len(batches)])
        cpu = torch.tensor([time.process_time() - cpu_started], dtype=torch.float64)
        dist.barrier()
        wall = time.perf_counter() - started
        dist.all_reduce(cpu)
        return wall / steps, cpu.item() / steps

    variants = {"raw": raw_step, "fabric": fabric_step}
    for step_fn in variants.values():
        block(step_fn, args.gpt_steps)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in variants}
    cpu_times: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(args.rounds):
        for name in variants if round_index % 2 == 0 else reversed(list(variants)):
            wall, cpu = block(variants[name], args.gpt_steps)
            times[name].append(wall)
            cpu_times[name].append(cpu)
    if rank == 1:  # the last stage holds the raw loss
        dist.send(torch.tensor([raw_first], dtype=torch.float64), dst=0)
    else:
        received = torch.zeros(1, dtype=torch.float64)
        dist.recv(received, src=1)
        raw_first = received.item()
        args.out.write_text(json.dumps({"times_s": times, "cpu_s": cpu_times, "first_loss": {"fabric": fabric_first, "raw": raw_first}}))


# ---- the driver ---------------------------------------------------------------------------------------------


def run_job(job: str, options: list[str], workdir: Path, name: str) -> dict[str, Any]:
    out = workdir / f"{name}.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--job", job, "--out", str(out), *options]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    result = subprocess.run(command, env=env, cwd=workdir, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    if result.returncode != 0 or not out.exists():
        raise SystemExit(f"{' '.join(command)} exited with {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return json.loads(out.read_text())


def paired(fabric: list[float], raw: list[float]) -> dict[str, float]:
    """Medians of both (ms per step) and of the per-round ratios Fabric/raw, with the ratios' quartiles and range."""
    ratios = sorted(f / r for f, r in zip(fabric, raw))
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return {"raw_ms": statistics.median(raw) * 1e3, "fabric_ms": statistics.median(fabric) * 1e3, "ratio": statistics.median(ratios),
            "q1": q1, "q3": q3, "min": ratios[0], "max": ratios[-1]}  # fmt: skip


def theory_ms(schedule: str, p: int, m: int, tf_ms: float, tb_ms: float) -> float:
    return (m + (p - 1) / STAGES_PER_RANK[schedule]) * (tf_ms + tb_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tf-ms", type=float, default=20.0, help="forward of one rank per microbatch")
    parser.add_argument("--tb-ms", type=float, default=40.0, help="backward of one rank per microbatch")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per fixed-cost case")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30, help="GPT: rounds of one Fabric and one raw block")
    parser.add_argument("--gpt-steps", type=int, default=5, help="GPT: steps per block")
    parser.add_argument("--gpt-microbatches", type=int, default=4)
    parser.add_argument("--gpt-microbatch-size", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    parser.add_argument("--job", choices=["fixed", "gpt"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--schedule", default="1F1B", help=argparse.SUPPRESS)
    parser.add_argument("--p", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--m", type=int, default=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job == "fixed":
        fixed_cost_job(args)
    elif args.job == "gpt":
        gpt_job(args)
    else:
        if args.quick:
            args.steps, args.warmup, args.rounds = 3, 1, 7
        report(measure(args), args)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run every job; the numbers, with the goals met or not."""
    import torch

    began = time.perf_counter()
    common = ["--tf-ms", str(args.tf_ms), "--tb-ms", str(args.tb_ms), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    results: dict[str, Any] = {"torch": torch.__version__, "cores": os.cpu_count(), "tf_ms": args.tf_ms, "tb_ms": args.tb_ms,
                               "fixed_cost": [], "gpt": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="pipeline-bench-") as folder:
        workdir = Path(folder)
        for schedule, p, m in FIXED_COST_CASES:
            job = run_job("fixed", [*common, "--schedule", schedule, "--p", str(p), "--m", str(m)], workdir, f"{schedule}-{p}")
            measured = statistics.median(job["times_s"]) * 1e3
            results["fixed_cost"].append({
                "schedule": schedule, "p": p, "m": m, "step_ms": measured, "min_ms": min(job["times_s"]) * 1e3,
                "theory_ms": theory_ms(schedule, p, m, args.tf_ms, args.tb_ms),
                "one_f_one_b_theory_ms": (m + p - 1) * (args.tf_ms + args.tb_ms),
            })  # fmt: skip
        gpt_options = ["--rounds", str(args.rounds), "--gpt-steps", str(args.gpt_steps), "--gpt-microbatches",
                       str(args.gpt_microbatches), "--gpt-microbatch-size", str(args.gpt_microbatch_size)]  # fmt: skip
        gpt = run_job("gpt", gpt_options, workdir, "gpt")
    results["gpt"] = {
        "wall": paired(gpt["times_s"]["fabric"], gpt["times_s"]["raw"]), "cpu": paired(gpt["cpu_s"]["fabric"], gpt["cpu_s"]["raw"]),
        "rounds": args.rounds, "steps_per_block": args.gpt_steps, "microbatches": args.gpt_microbatches,
        "microbatch_size": args.gpt_microbatch_size, "first_loss": gpt["first_loss"],
    }  # fmt: skip
    by_case = {(case["schedule"], case["p"]): case for case in results["fixed_cost"]}
    one_f_one_b_ok = all(abs(case["step_ms"] / case["theory_ms"] - 1) <= 0.10 for case in results["fixed_cost"] if case["schedule"] == "1F1B")
    interleaved_faster = all(by_case[("Interleaved1F1B", p)]["step_ms"] < by_case[("1F1B", p)]["step_ms"] for p in (2, 4))
    results["goals"] = {"one_f_one_b_within_10_percent": one_f_one_b_ok, "interleaved_faster": interleaved_faster,
                        "gpt_ratio_at_most_1_05": results["gpt"]["wall"]["ratio"] <= 1.05}  # fmt: skip
    results["wall_s"] = time.perf_counter() - began
    return results


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    """The table, then the JSON line."""
    by_case = {(case["schedule"], case["p"]): case for case in results["fixed_cost"]}
    goals = results["goals"]
    print(f"pipeline: CPU, gloo, {results['cores']} cores, OMP_NUM_THREADS=1 per process, torch {results['torch']}")
    print(f"1. fixed-cost stages (sleeping: forward {args.tf_ms:g} ms + backward {args.tb_ms:g} ms per rank and microbatch),"
          f" median of {args.steps} steps after {args.warmup}")  # fmt: skip
    print(f"  {'schedule':16s} {'p':>2s} {'m':>2s} {'measured':>10s} {'theory':>10s} {'/theory':>8s} {'(m+p-1)(tf+tb)':>15s} {'/that':>7s}")
    for case in results["fixed_cost"]:
        print(f"  {case['schedule']:16s} {case['p']:2d} {case['m']:2d} {case['step_ms']:8.1f}ms {case['theory_ms']:8.1f}ms"
              f" {case['step_ms'] / case['theory_ms']:7.3f}x {case['one_f_one_b_theory_ms']:13.1f}ms"
              f" {case['step_ms'] / case['one_f_one_b_theory_ms']:6.3f}x")  # fmt: skip
    for p in (2, 4):
        ratio = by_case[("Interleaved1F1B", p)]["step_ms"] / by_case[("1F1B", p)]["step_ms"]
        print(f"  p={p}: Interleaved1F1B / 1F1B = {ratio:.3f}x")
    print(f"  goals: 1F1B within 10 % of (m+p-1)(tf+tb): {'OK' if goals['one_f_one_b_within_10_percent'] else 'MISSED'};"
          f" Interleaved1F1B faster than 1F1B: {'OK' if goals['interleaved_faster'] else 'MISSED'}")  # fmt: skip
    g = results["gpt"]
    print(f"2. small GPT (examples/pipeline), pp=2, 1F1B, {g['microbatches']} microbatches of {g['microbatch_size']} rows;"
          f" {args.rounds} rounds x {args.gpt_steps} steps, interleaved")  # fmt: skip
    print(f"  {'per step':34s} {'raw':>9s} {'Fabric':>9s} {'Fabric/raw':>11s}   {'quartiles':13s} {'min-max':13s}")
    for clock, label in (("wall", "wall time"), ("cpu", "CPU time, both ranks together")):
        c = g[clock]
        print(f"  {label:34s} {c['raw_ms']:7.2f}ms {c['fabric_ms']:7.2f}ms {c['ratio']:10.3f}x   {c['q1']:.3f}-{c['q3']:.3f}"
              f"   {c['min']:.3f}-{c['max']:.3f}")  # fmt: skip
    print(f"  (ratios: median of the per-round ratios) goal <= 1.05x (wall): {'OK' if goals['gpt_ratio_at_most_1_05'] else 'MISSED'}")
    print(f"  first step's loss: Fabric {g['first_loss']['fabric']:.6f}, raw {g['first_loss']['raw']:.6f}")
    print(f"  wall time {results['wall_s']:.0f} s")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
