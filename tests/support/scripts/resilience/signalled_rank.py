"""A torch-free rank that records the signals it gets and reacts to SIGTERM as told (run by `fabric run`).

    python signalled_rank.py OUT_DIR [--on-term exit|ignore] [--save-s S] [--exit-code C] [--after-usr1-s S]

At start it writes ``OUT_DIR/rank{RANK}.json`` (its pid and the pid of a child it started, which sleeps
in the rank's process group like a DataLoader worker). Every SIGUSR1 / SIGTERM the rank or its child
receives is appended to ``OUT_DIR/signals-rank{RANK}`` / ``signals-child{RANK}``.

- SIGTERM with ``--on-term exit``: the rank "saves" for ``--save-s`` seconds, writes
  ``saved-rank{RANK}`` and exits with ``--exit-code``; with ``--on-term ignore`` it goes on.
- SIGUSR1: the rank goes on for ``--after-usr1-s`` seconds, writes ``done-rank{RANK}`` and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

_CHILD = (
    "import os, signal, sys, time\n"
    "path = sys.argv[1]\n"
    "def note(signum, frame):\n"
    "    with open(path, 'a') as f: f.write(signal.Signals(signum).name + '\\n')\n"
    "signal.signal(signal.SIGUSR1, note)\n"
    "signal.signal(signal.SIGTERM, note)\n"
    "while True: time.sleep(0.05)\n"
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--on-term", choices=("exit", "ignore"), default="exit")
    parser.add_argument("--save-s", type=float, default=0.0)
    parser.add_argument("--exit-code", type=int, default=0)
    parser.add_argument("--after-usr1-s", type=float, default=0.0)
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    received: list[int] = []

    def note(signum: int, frame: object) -> None:
        received.append(signum)
        with open(args.out / f"signals-rank{rank}", "a") as f:
            f.write(signal.Signals(signum).name + "\n")

    signal.signal(signal.SIGUSR1, note)
    signal.signal(signal.SIGTERM, note)
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(args.out / f"signals-child{rank}")])
    record = {"pid": os.getpid(), "child": child.pid}
    (args.out / f"rank{rank}.json.tmp").write_text(json.dumps(record))
    os.replace(args.out / f"rank{rank}.json.tmp", args.out / f"rank{rank}.json")

    while True:
        if signal.SIGTERM in received and args.on_term == "exit":
            time.sleep(args.save_s)
            (args.out / f"saved-rank{rank}").write_text("saved")
            child.kill()
            sys.exit(args.exit_code)
        if signal.SIGUSR1 in received:
            time.sleep(args.after_usr1_s)
            (args.out / f"done-rank{rank}").write_text("done")
            child.kill()
            return
        time.sleep(0.05)

if __name__ == "__main__":
    main()
