"""What a training step through Fabric costs compared with the same step in raw PyTorch.

One step = forward, loss, backward, optimizer step, zero_grad, for a tiny MLP (32 -> 64 -> 64 -> 1,
batch 32) on the CPU, so that any per-call overhead of the wrappers is as visible as it can be.
The "to_device" case also calls ``fabric.to_device((x, y))`` in every step (a no-op move, as in a
loop whose batches are already on the device) and is compared with the same raw loop, without it.
The raw loop and the Fabric loop run in the same process, in interleaved blocks (alternating which
goes first), and we compare the medians of the per-step times of the blocks.

    python benchmarks/step_overhead.py [--blocks 100] [--steps 50] [--threads 1] [--clock auto|cpu|wall]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn

from fabric import Fabric

GOAL = 1.05
GOAL_TO_DEVICE = 1.02  # one extra call per step, whose fast path should cost (almost) nothing


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))


def raw_step(precision: str) -> Callable[[torch.Tensor, torch.Tensor], None]:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = nn.MSELoss()
    if precision == "bf16-mixed":

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            loss = loss_fn(out.float(), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        return step

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def fabric_step(precision: str, to_device: bool = False) -> Callable[[torch.Tensor, torch.Tensor], None]:
    fabric = Fabric(accelerator="cpu", devices=1, precision=precision)
    fabric.launch()
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    loss_fn = nn.MSELoss()

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = loss_fn(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    def step_with_to_device(x: torch.Tensor, y: torch.Tensor) -> None:  # the body again: no extra call of our own
        x, y = fabric.to_device((x, y))
        loss = loss_fn(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    return step_with_to_device if to_device else step


def per_step_seconds(
    step: Callable[[torch.Tensor, torch.Tensor], None], x: torch.Tensor, y: torch.Tensor, steps: int, clock: Callable[[], float]
) -> float:
    start = clock()
    for _ in range(steps):
        step(x, y)
    return (clock() - start) / steps


def compare(precision: str, blocks: int, steps: int, clock: Callable[[], float], to_device: bool = False) -> tuple[float, float]:
    torch.manual_seed(0)
    x, y = torch.randn(32, 32), torch.randn(32, 1)
    raw, through_fabric = raw_step(precision), fabric_step(precision, to_device)
    for step in (raw, through_fabric):  # warm-up: allocator, autograd graph caches, lazy inits
        per_step_seconds(step, x, y, steps, clock)
    raw_times, fabric_times = [], []
    for block in range(blocks):
        order = [(raw, raw_times), (through_fabric, fabric_times)]
        for step, times in order if block % 2 == 0 else reversed(order):
            times.append(per_step_seconds(step, x, y, steps, clock))
    return statistics.median(raw_times), statistics.median(fabric_times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=100, help="interleaved blocks per variant (default 100)")
    parser.add_argument("--steps", type=int, default=50, help="steps per block (default 50)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: least noise)")
    parser.add_argument("--precision", nargs="+", default=["32-true", "bf16-mixed"], help="precisions to compare")
    parser.add_argument("--no-to-device", action="store_true", help="skip the 32-true case that calls fabric.to_device")
    parser.add_argument(
        "--clock",
        choices=("auto", "cpu", "wall"),
        default="auto",
        help="cpu: this thread's CPU time (ignores time the OS gives to other processes; only meaningful with"
        " --threads 1); wall: elapsed time. auto: cpu with one thread, else wall",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    use_cpu = args.clock == "cpu" or (args.clock == "auto" and args.threads == 1)
    clock = time.thread_time if use_cpu else time.perf_counter
    cases = [(precision, False) for precision in args.precision]
    if not args.no_to_device:
        cases.insert(1, ("32-true", True))
    for precision, to_device in cases:
        raw, fab = compare(precision, args.blocks, args.steps, clock, to_device)
        ratio = fab / raw
        goal = GOAL_TO_DEVICE if to_device else GOAL
        status = "OK" if ratio <= goal else "OVER GOAL"
        label = "step_overhead" if precision == "32-true" else f"step_overhead[{precision}]"
        label = f"{label}[to_device]" if to_device else label
        print(
            f"{label}: raw {raw * 1e6:.1f} us, fabric {fab * 1e6:.1f} us, ratio {ratio:.3f}x"
            f" (goal <= {goal:.2f}x) [{status}; median of {args.blocks} blocks x {args.steps} steps,"
            f" {args.threads} thread(s), {'cpu' if use_cpu else 'wall'} clock]"
        )


if __name__ == "__main__":
    main()
