"""The per-rank body shared by the popen and multiprocessing test scripts.

Each rank records its pid, environment and (optionally) a grandchild's pid to
``<outdir>/rank<R>.json``; then one rank fails in the requested way while the others
either block (like a collective that never completes) or finish.
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

ENV_KEYS = (
    "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
    "FABRIC_PARENT_PID", "WORKER_SETUP_IDX",
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--outdir", required=True)
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--how", default="exception", choices=["exception", "sigkill", "exit", "sysexit"])
    p.add_argument("--grandchild", action="store_true", help="every rank starts `sleep 1000`")
    p.add_argument("--block", action="store_true", help="ranks that do not fail wait forever")
    p.add_argument("--linger", type=float, default=0.0, help="non-zero ranks sleep this long before finishing")
    p.add_argument("--fail-after", type=float, default=0.0)
    p.add_argument("--start-method", default="spawn")
    p.add_argument("--echo", action="store_true",
                   help="ranks that do not fail raise as soon as the failing rank is gone, like a "
                        "collective reporting 'connection closed by peer'")
    p.add_argument("--fork-noise", action="store_true",
                   help="rank 0 forks helpers that fail / get SIGTERM, like DataLoader workers do")
    return p


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def rank_body(opts: argparse.Namespace) -> dict:
    rank = int(os.environ.get("RANK", "0"))
    outdir = Path(opts.outdir)
    main = sys.modules["__main__"]
    info = {
        "rank": rank,
        "pid": os.getpid(),
        "pgid": os.getpgrp(),
        "env": {k: os.environ.get(k) for k in ENV_KEYS},
        "argv": sys.argv,
        "main_spec": getattr(getattr(main, "__spec__", None), "name", None),
        "cwd": os.getcwd(),
    }
    if opts.echo and rank == opts.fail_rank:
        info["echo_port"] = _serve_peers()
    if opts.grandchild:
        info["grandchild"] = subprocess.Popen(
            ["sleep", "1000"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        ).pid
    _write_json(outdir / f"rank{rank}.json", info)

    if opts.fork_noise and rank == 0:
        _fork_noise()

    if rank == opts.fail_rank:
        # Fail only once every rank is on record, so the test knows every pid to check.
        deadline = time.time() + 60
        while len(list(outdir.glob("rank*.json"))) < opts.nprocs and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(opts.fail_after)
        (outdir / "fail_time").write_text(repr(time.time()))
        sys.stdout.flush()
        if opts.how == "exception":
            raise ValueError(f"boom from rank {rank}")
        if opts.how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if opts.how == "exit":
            os._exit(3)
        sys.exit(3)
    if opts.echo and opts.fail_rank >= 0:
        _raise_when_gone(outdir, opts.fail_rank)
    if opts.block:
        time.sleep(1000)
    if rank != 0:
        time.sleep(opts.linger)
    (outdir / f"done{rank}").write_text(repr(time.time()))
    return {"rank": rank}


def _fork_noise() -> None:
    """Forked copies of rank 0 inherit its hooks; their failures are not the job's."""
    import multiprocessing

    worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(100,))
    worker.start()
    time.sleep(0.3)
    worker.terminate()  # SIGTERM, as DataLoader does to a stuck worker
    worker.join()
    pid = os.fork()
    if pid == 0:
        raise RuntimeError("an exception in a forked copy of rank 0")
    os.waitpid(pid, 0)


def _serve_peers() -> int:
    """Accept the peers' connections; they see EOF when this process dies (as in gloo)."""
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    peers = []

    def accept() -> None:
        while True:
            peers.append(server.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    return server.getsockname()[1]


def _raise_when_gone(outdir: Path, rank: int) -> None:
    """Block on a connection to ``rank`` and raise once it closes, like a collective would."""
    import socket

    path = outdir / f"rank{rank}.json"
    while not path.exists():
        time.sleep(0.01)
    port = json.loads(path.read_text())["echo_port"]
    try:
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.recv(1)
    except OSError:
        pass
    raise RuntimeError(f"connection closed by peer rank {rank}")
