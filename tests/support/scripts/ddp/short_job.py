"""The shortest job: every rank joins and the script ends at once (the user's two-line start-up check).

    python short_job.py --devices N [--slow-peers]     # Fabric(devices=N).launch()
    fabric-torch run --devices N short_job.py [--slow-peers] [--collective]
    python short_job.py --devices N --timeout T --late S   # (or under fabric-torch run, torchrun)

Every rank prints ``joined <rank>``. ``--slow-peers``: every rank but 0 takes its time between writing
its own gloo address to the store and connecting to its peers, as a rank on a loaded machine does (the
first read from the store waits 1.5 s). A rank that is done joining before its peers must not
leave them behind: the job must end with status 0. ``--collective``: the ranks join with
``TorchCollective().setup(...)`` (on a store of the job's own) instead of ``Fabric``.

``--timeout T --late S``: the group's timeout is T seconds and every rank but 0 starts S seconds late (it
sleeps before ``Fabric``), as a rank does whose interpreter starts slowly; after joining the ranks sum
their ranks in an all-reduce and print ``sum <total> store timeout <seconds>``.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import fabric.strategies.ddp as ddp
from fabric import Fabric
from fabric.plugins.collectives import TorchCollective
from fabric.strategies.ddp import DDPStrategy

_DELAY_S = 1.5


class SlowFirstRead(dist.Store):
    """A store that waits before its first read and otherwise forwards everything to ``inner``."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner
        self.delayed = False

    def get(self, key: str) -> bytes:
        if not self.delayed:
            self.delayed = True
            time.sleep(_DELAY_S)
        return self.inner.get(key)

    def set(self, key: str, value: Any) -> None:
        self.inner.set(key, value)

    def add(self, key: str, value: int) -> int:
        return self.inner.add(key, value)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: Any) -> None:
        self.inner.set_timeout(timeout)


def join_with_the_collective_plugin(slow_peers: bool) -> None:
    """Join as ``TorchCollective`` users do, under ``fabric-torch run`` (its environment names the ranks)."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store: Any = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=rank == 0)
    if slow_peers and rank != 0:
        store = SlowFirstRead(store)
    TorchCollective().setup(backend="gloo", store=store, rank=rank, world_size=world_size)
    print(f"joined {rank}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int)
    parser.add_argument("--slow-peers", action="store_true")
    parser.add_argument("--collective", action="store_true")
    parser.add_argument("--timeout", type=float, default=0.0)
    parser.add_argument("--late", type=float, default=0.0)
    args = parser.parse_args()
    if args.collective:
        join_with_the_collective_plugin(args.slow_peers)
        return
    if args.slow_peers and os.environ.get("RANK", "0") != "0":
        job_store = ddp._job_store
        ddp._job_store = lambda *a, **k: SlowFirstRead(job_store(*a, **k))  # type: ignore[assignment]
    if args.late and os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) != "0":
        time.sleep(args.late)
    options: dict[str, Any] = {"accelerator": "cpu", "devices": args.devices} if args.devices else {}
    if args.timeout:
        options["strategy"] = DDPStrategy(timeout=timedelta(seconds=args.timeout))
    fabric = Fabric(**options)
    fabric.launch()
    print(f"joined {fabric.global_rank}", flush=True)
    if args.timeout:
        total = fabric.all_reduce(torch.tensor(fabric.global_rank), reduce_op="sum")
        store_timeout = dist.distributed_c10d._get_default_store().timeout.total_seconds()
        os.write(1, f"sum {int(total)} store timeout {store_timeout:g}\n".encode())  # one write: ranks share the pipe


if __name__ == "__main__":
    main()
