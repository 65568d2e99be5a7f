"""A rank that only reports its environment (no torch): pid file, env JSON, then exit or wait.

Usage: ranks_env.py OUT_DIR [--exit-code-on-rank R CODE] [--sleep S] [script args ...]
Writes OUT_DIR/rank{RANK}.json at once. The rank named by --exit-code-on-rank exits with CODE after
a short pause; the others sleep S seconds (so a test can see them being stopped) and exit 0.
"""

import json
import os
import sys
import time
from pathlib import Path

_NAMES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
          "GROUP_RANK", "OMP_NUM_THREADS")


def main() -> None:
    out = Path(sys.argv[1])
    args = sys.argv[2:]
    fail_rank, fail_code, sleep = -1, 0, 0.0
    if "--exit-code-on-rank" in args:
        i = args.index("--exit-code-on-rank")
        fail_rank, fail_code = int(args[i + 1]), int(args[i + 2])
        del args[i : i + 3]
    if "--sleep" in args:
        i = args.index("--sleep")
        sleep = float(args[i + 1])
        del args[i : i + 2]
    rank = int(os.environ.get("RANK", "0"))
    record = {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "argv": args,
        "env": {name: os.environ.get(name) for name in _NAMES},
        "fabric": {k: v for k, v in os.environ.items() if k.startswith("FABRIC_")},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json.tmp").write_text(json.dumps(record))
    os.replace(out / f"rank{rank}.json.tmp", out / f"rank{rank}.json")
    if rank == fail_rank:
        time.sleep(0.3)
        sys.exit(fail_code)
    time.sleep(sleep)


if __name__ == "__main__":
    main()
