"""``strategy="dp"`` on the CPU, as a Lightning Fabric user writes it: ``python dp_on_cpu.py OUTDIR``.

Fabric runs DDP instead (re-running this script for rank 1); each rank writes the samples its loader gave it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from torch.utils.data import DataLoader

from fabric import Fabric


def main() -> None:
    fabric = Fabric(accelerator="cpu", strategy="dp", devices=2)
    fabric.launch()
    loader = fabric.setup_dataloaders(DataLoader(list(range(8)), batch_size=2))
    seen = [int(value) for batch in loader for value in batch]
    report = {"strategy": type(fabric.strategy).__name__, "world_size": fabric.world_size, "seen": seen}
    (Path(sys.argv[1]) / f"rank{fabric.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
