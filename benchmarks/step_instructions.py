"""Instructions per training step, raw PyTorch against Fabric, counted by valgrind's callgrind.

The same steps as ``step_overhead.py`` (32-true, 32-true calling ``fabric.to_device((x, y))``,
bf16-mixed), but counted instead of timed: the count does not move with the machine's load, so a
change of a tenth of a percent shows. It does not weigh instructions by their cost (the interpreter's
run slower than the arithmetic's), so a ratio here is below the timed one. Needs ``valgrind``; takes a
few minutes (most of it ``import torch`` under valgrind).

    python benchmarks/step_instructions.py [--steps 200]
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# (label, raw variant, Fabric variant); each region runs twice, raw and Fabric interleaved
CASES = [("step", ("32-true", False)), ("step[to_device]", ("32-true", True)), ("step[bf16-mixed]", ("bf16-mixed", False))]


def run_regions(steps: int) -> None:
    """Inside valgrind: each region starts at ``os.getppid()`` (counters zeroed) and ends at ``os.getpgrp()`` (dumped)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch
    from step_overhead import fabric_step, raw_step

    torch.set_num_threads(1)
    x, y = torch.randn(32, 32), torch.randn(32, 1)
    regions: list = [lambda x, y: None]  # the first region counts extra work of its own: it is left out
    for _, (precision, to_device) in CASES:
        raw, through_fabric = raw_step(precision), fabric_step(precision, to_device)
        regions += [raw, through_fabric, raw, through_fabric]
    for step in regions:
        for _ in range(30):  # warm-up: lazy initializations, the interpreter's specializations
            step(x, y)
    gc.collect()
    gc.disable()  # a collection inside one region would be counted against it
    for step in regions:
        os.getppid()
        for _ in range(steps):
            step(x, y)
        os.getpgrp()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="steps per region (default 200)")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        run_regions(args.steps)
        return
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "callgrind.out"
        command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--zero-before=getppid", "--dump-before=getpgrp"]
        subprocess.run([*command, sys.executable, __file__, "--inner", "--steps", str(args.steps)], check=True, capture_output=True)
        dumps = sorted(Path(folder).glob("callgrind.out.*"), key=lambda path: int(path.suffix[1:]))
        counts = [int(re.search(r"^summary: (\d+)", dump.read_text(), re.M).group(1)) / args.steps for dump in dumps[1:]]  # type: ignore[union-attr]
    for index, (label, _) in enumerate(CASES):
        raw_a, fabric_a, raw_b, fabric_b = counts[4 * index : 4 * index + 4]
        raw, fabric = (raw_a + raw_b) / 2, (fabric_a + fabric_b) / 2
        print(f"{label}: raw {raw:,.0f}, fabric {fabric:,.0f} instructions per step, +{fabric - raw:,.0f}, ratio {fabric / raw:.4f}x")


if __name__ == "__main__":
    main()
