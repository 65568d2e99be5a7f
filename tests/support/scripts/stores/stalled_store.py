"""A job whose S3 store stops answering while it saves, loads, lists or logs (``tests/checkpoint/storage/test_stalled_stores.py``).

``stalled_store.py MODE URL``; the environment names the server (``AWS_ENDPOINT_URL``: the server, or a proxy in
front of it that the test cuts) and the bound (``FABRIC_STORE_TIMEOUT``). Every step is reported as one JSON line on
stdout (``{"event": ...}``); where the test must act between two steps (cut the proxy, pause the server) the job
says ``ready`` and waits for a line on stdin.

- ``file``: a small checkpoint (``v`` = 0..9) is saved, then a 64 MB one at the same URL (``saving``: the test cuts
  the proxy during its upload); the error is reported (``failed``) and the job ends.
- ``sharded``: the same with sharded checkpoints (``save_sharded`` in one process): a small ``Linear(4, 4)`` seeded
  with 0, then four 16 MB layers.
- ``logger``: a CSVLogger and a TensorBoardLogger on URL write their first rows; ``ready``; after the go each
  writes one more row and ``save()`` reports its error (``failed``, ``logger``: which); the job ends without
  ``finalize``.
- ``exit``: the same loggers write rows; ``ready``; after the go each logs one more row and the job ends without
  ``finalize`` (``ending``): what they hold is written as the process ends, while the test keeps the server paused.
- ``calls``: a file checkpoint, a sharded one and a log folder are written; ``ready``; after the go (the server is
  paused) a load of each, a save, a removal and a logger's listing each report their error (``failed``, ``call``).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def say(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def wait_for_go() -> None:
    say("ready")
    if not sys.stdin.readline():
        raise SystemExit("the test closed stdin before the go")


def attempt(action: Callable[[], Any], **fields: Any) -> None:
    """Run ``action``; it must raise: report its error and how long it took (``succeeded`` if it did not raise)."""
    started = time.monotonic()
    try:
        action()
    except Exception as err:
        say("failed", type=type(err).__name__, message=str(err), elapsed=time.monotonic() - started, **fields)
    else:
        say("succeeded", elapsed=time.monotonic() - started, **fields)


def small_linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 4)


def loggers(url: str) -> list[Any]:
    from fabric.loggers import CSVLogger, TensorBoardLogger

    found = [CSVLogger(url, name="csv", flush_logs_every_n_steps=1000)]
    try:
        found.append(TensorBoardLogger(url, name="tb", flush_secs=3600))
    except ImportError:
        pass
    return found


def main(mode: str, url: str) -> None:
    from fabric.checkpoint.formats import load_sharded
    from fabric.checkpoint.formats.sharded import save_sharded
    from fabric.plugins.io import TorchCheckpointIO, atomic_save, safe_load

    if mode == "file":
        atomic_save({"v": torch.arange(10.0)}, url)
        say("saving")
        attempt(lambda: atomic_save({"big": torch.zeros(64 << 20, dtype=torch.uint8)}, url))
    elif mode == "sharded":
        save_sharded(url, {"model": small_linear()})
        torch.manual_seed(1)
        big = nn.Sequential(*(nn.Linear(2048, 2048, bias=False) for _ in range(4)))
        say("saving")
        attempt(lambda: save_sharded(url, {"model": big}))
    elif mode in ("logger", "exit"):
        writers = loggers(url)
        for step in range(3):
            for logger in writers:
                logger.log_metrics({"loss": step / 2}, step=step)
        for logger in writers:
            logger.save()
        wait_for_go()
        for logger in writers:
            logger.log_metrics({"loss": 9.0}, step=3)
            if mode == "logger":
                attempt(logger.save, logger=type(logger).__name__)
        say("ending")
    elif mode == "calls":
        atomic_save({"v": torch.arange(10.0)}, f"{url}/file.pt")
        save_sharded(f"{url}/sharded", {"model": small_linear()})
        from fabric.loggers import CSVLogger

        logger = CSVLogger(f"{url}/logs", version=0)
        logger.log_metrics({"loss": 1.0}, step=0)
        logger.save()
        wait_for_go()
        attempt(lambda: safe_load(f"{url}/file.pt"), call="load")
        attempt(lambda: load_sharded(f"{url}/sharded", {"model": small_linear()}), call="load_sharded")
        attempt(lambda: atomic_save({"v": torch.ones(3)}, f"{url}/other.pt"), call="save")
        attempt(lambda: TorchCheckpointIO().remove_checkpoint(f"{url}/file.pt"), call="remove")
        attempt(lambda: CSVLogger(f"{url}/logs").version, call="list")
        say("ending")
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
