"""One rank of a 2-process ``strategy="fsdp"`` job that saves sharded checkpoints to a store (started by
tests/checkpoint/storage/test_s3.py under torchrun; the store's address comes in the environment).

``store_job.py URL OUT save``: train ``job_model()`` 3 AdamW steps (each rank's part is written as 4 data files, as a
large model's is), ``fabric.save(URL/sync)``; one more step,
``fabric.save(URL/async, async_save=True)``; references of both states, gathered (``OUT/ref-sync.pt``,
``OUT/ref-async.pt``). Then one more step and a save to ``URL/sync`` again, in which rank 1's upload of its
data file fails after 100 kB (``OUT/failed-rank{R}.txt``: the error each rank raised); then fresh objects load
``URL/sync``: they must hold the first save's values (``OUT/after-failure.pt``).
``store_job.py URL OUT load NAME...``: fresh objects load each ``URL/NAME`` (``OUT/loaded-NAME.pt``, gathered);
``OUT/record-reads-rank{R}.txt``: how many GETs of the commit records rank R made.
``store_job.py URL OUT tp``: ``ModelParallelStrategy`` (tensor parallel over the 2 ranks) trains the residual MLP
of the sharding jobs 2 steps, saves to ``URL/tp`` (``OUT/ref-tp.pt``), and fresh objects load it
(``OUT/loaded-tp.pt``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from fabric import Fabric
from fabric.checkpoint.layout import optimizer_numbered
from fabric.strategies import FSDPStrategy
from support.dcp_jobs import job_model


def build(fabric: Fabric, seed: int):
    torch.manual_seed(seed)
    model = fabric.setup_module(job_model())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.01))
    return model, optimizer


def step(fabric: Fabric, model, optimizer) -> None:
    fabric.backward(model(torch.randn(4, 6, generator=torch.Generator().manual_seed(fabric.global_rank))).square().mean())
    optimizer.step()
    optimizer.zero_grad()


def gathered(model, optimizer) -> dict:
    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    return {
        "model": get_model_state_dict(model.module, options=options),
        "optimizer": optimizer_numbered(get_optimizer_state_dict(model.module, optimizer.optimizer, options=options)),
    }


def save_on_rank_zero(fabric: Fabric, obj, path: Path) -> None:
    if fabric.global_rank == 0:
        torch.save(obj, path)


def failing_data_uploads(original):
    """``storage.write_object`` that sends the first 100 kB of a data file, then fails as a dropped connection would."""

    def write_object(fs, path, produce, where):
        if not path.endswith(".distcp"):
            return original(fs, path, produce, where)

        def cut(file) -> None:
            class Cut:
                sent = 0

                def write(self, data) -> int:
                    view = memoryview(data).cast("B")
                    file.write(view[: max(0, 100_000 - self.sent)])
                    self.sent += len(view)
                    if self.sent >= 100_000:
                        raise OSError("injected: the connection dropped mid-upload")
                    return len(view)

            produce(Cut())

        return original(fs, path, cut, where)

    return write_object


def count_record_reads(url: str, names: list[str]) -> list[str]:
    """Every GET of the commit records of ``URL/NAME`` this process makes from now on (the list grows)."""
    from fabric._core.urls import filesystem

    fs, root = filesystem(url)
    records = {f"{root}/{name}" for name in names}
    reads: list[str] = []
    original = fs.cat_file  # an async file system's sync methods are its instance's own: wrap this one (fsspec caches it)

    def cat_file(path, *args, **kwargs):
        if str(path).rstrip("/") in records and not args and kwargs.get("start") is None:
            reads.append(str(path))
        return original(path, *args, **kwargs)

    fs.cat_file = cat_file
    return reads


def tensor_parallel(url: str, out_path: Path) -> None:
    from fabric.strategies import ModelParallelStrategy
    from support.scripts.sharding.model import make_net, parallelize

    strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=1, tensor_parallel_size=2)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()

    def objects(seed: int):
        model = fabric.setup_module(make_net(seed))
        return model, fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))

    model, optimizer = objects(seed=0)
    for _ in range(2):
        fabric.backward(model(torch.randn(8, 8, generator=torch.Generator().manual_seed(0))).square().mean())
        optimizer.step()
        optimizer.zero_grad()
    fabric.save(f"{url}/tp", {"model": model, "optimizer": optimizer, "step": 2})
    save_on_rank_zero(fabric, gathered(model, optimizer), out_path / "ref-tp.pt")
    fresh, fresh_optimizer = objects(seed=1)
    state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
    fabric.load(f"{url}/tp", state)
    save_on_rank_zero(fabric, {**gathered(fresh, fresh_optimizer), "step": state["step"]}, out_path / "loaded-tp.pt")


def main() -> None:
    url, out, mode, *names = sys.argv[1:]
    out_path = Path(out)
    if mode == "tp":
        tensor_parallel(url, out_path)
        return
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy())
    fabric.launch()
    if mode == "save":
        import fabric.checkpoint.storage.sharded_store as sharded_store

        sharded_store._BYTES_PER_FILE = 64 << 10  # each rank writes (and uploads at once) 4 data files, as a big model's
        model, optimizer = build(fabric, seed=1)
        for _ in range(3):
            step(fabric, model, optimizer)
        fabric.save(f"{url}/sync", {"model": model, "optimizer": optimizer, "step": 3})
        save_on_rank_zero(fabric, gathered(model, optimizer), out_path / "ref-sync.pt")
        step(fabric, model, optimizer)
        fabric.save(f"{url}/async", {"model": model, "optimizer": optimizer, "step": 4}, async_save=True)
        save_on_rank_zero(fabric, gathered(model, optimizer), out_path / "ref-async.pt")
        step(fabric, model, optimizer)

        import fabric.checkpoint.storage.objects as storage
        from fabric.checkpoint.async_save import wait_for_pending_save

        wait_for_pending_save()  # the async save is published before rank 1's uploads start failing (it uploads too)
        if fabric.global_rank == 1:
            storage.write_object = failing_data_uploads(storage.write_object)
        try:
            fabric.save(f"{url}/sync", {"model": model, "optimizer": optimizer, "step": 5})
        except Exception as err:  # every rank must raise
            (out_path / f"failed-rank{fabric.global_rank}.txt").write_text(f"{type(err).__name__}: {err}")
        else:
            (out_path / f"failed-rank{fabric.global_rank}.txt").write_text("no error")
        fresh, fresh_optimizer = build(fabric, seed=2)
        state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
        fabric.load(f"{url}/sync", state)
        save_on_rank_zero(fabric, {**gathered(fresh, fresh_optimizer), "step": state["step"]}, out_path / "after-failure.pt")
    elif mode == "load":
        reads = count_record_reads(url, names)
        for name in names:
            fresh, fresh_optimizer = build(fabric, seed=2)
            state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
            fabric.load(f"{url}/{name}", state)
            save_on_rank_zero(fabric, {**gathered(fresh, fresh_optimizer), "step": state["step"]}, out_path / f"loaded-{name}.pt")
        (out_path / f"record-reads-rank{fabric.global_rank}.txt").write_text(str(len(reads)))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
