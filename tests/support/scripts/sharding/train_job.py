"""Checks run in every rank of a real torchrun job: ``torchrun --nproc-per-node N train_job.py OUTDIR``.

Each check builds its own ``Fabric`` (torchrun started the ranks, so no launcher starts more) and
records numbers instead of asserting; rank r saves them to ``OUTDIR/rank{r}.pt`` for the test.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import GLOBAL_BATCH, Block, data, full_parameters, make_net, max_difference, parallelize, reference_run

from fabric import Fabric
from fabric.strategies import FSDPStrategy, ModelParallelStrategy
from support.memory import peak_resident_bytes

STEPS = 10
MAX_NORM = 0.5


def new_fabric(strategy: Any, precision: str | None = None) -> Fabric:
    devices = dist.get_world_size() if dist.is_initialized() else "auto"
    fabric = Fabric(accelerator="cpu", devices=devices, strategy=strategy, precision=precision)
    fabric.launch()
    return fabric


def local_batch(fabric: Fabric, x: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a global batch: by data-parallel rank (tensor-parallel peers share rows)."""
    kwargs = fabric.strategy.distributed_sampler_kwargs
    per_rank = GLOBAL_BATCH // kwargs["num_replicas"]
    return x[kwargs["rank"] * per_rank : (kwargs["rank"] + 1) * per_rank]


def train(fabric: Fabric, model: Any, optimizer: Any, steps: int, clip: bool, accumulate: int = 1, start: int = 0) -> list[float]:
    xs, ys = data(start + steps)
    norms = []
    for x, y in zip(xs[start:], ys[start:]):
        x, y = local_batch(fabric, x), local_batch(fabric, y)
        chunks = list(zip(x.chunk(accumulate), y.chunk(accumulate)))
        for i, (xc, yc) in enumerate(chunks):
            with fabric.no_backward_sync(model, enabled=i < len(chunks) - 1):
                fabric.backward(F.mse_loss(model(xc), yc) / accumulate)
        if clip:
            norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
    return norms


def training_check(strategy: Any, joint_setup: bool = False, accumulate: int = 1, clip: bool = True, steps: int = STEPS) -> dict[str, Any]:
    """Sharded training on this rank's slice vs one-process training on the global batch."""
    fabric = new_fabric(strategy)
    model = make_net()
    if joint_setup:  # the optimizer is created before sharding: setup() re-points it
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        model, optimizer = fabric.setup(model, optimizer)
    else:
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    norms = train(fabric, model, optimizer, steps, clip, accumulate)
    expected, expected_norms = reference_run(steps, MAX_NORM if clip else None)
    result = {"max_diff": max_difference(full_parameters(model.module), expected)}
    if clip:
        result["norm_diff"] = max(abs(a - b) for a, b in zip(norms, expected_norms))
        result["clipped"] = sum(n > MAX_NORM for n in expected_norms)
    result["local_numel"] = sum(p.to_local().numel() for p in model.module.parameters())
    return result


def memory_check(strategy: Any, blocks: int, empty_init: bool) -> dict[str, Any]:
    """Peak memory while creating and sharding a model that is big next to the rest of the process."""
    from torch.distributed.tensor import DTensor

    fabric = new_fabric(strategy)
    with fabric.init_module(empty_init=True):  # warm-up: the imports and buffers of a first sharding
        warm_up = fabric.setup_module(_WideNet(1, width=8))
    warm_up(torch.randn(2, 8)).sum().backward()
    peak_before = peak_resident_bytes()
    with fabric.init_module(empty_init=empty_init):
        model = _WideNet(blocks)
    on_meta = all(p.is_meta for p in model.parameters())
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model = fabric.setup_module(model)
    peak_after = peak_resident_bytes()
    params = list(model.module.parameters())
    local_bytes = sum(p.to_local().numel() * p.element_size() for p in params)
    # replicated copies must agree across ranks after materialisation
    replicas_agree = True
    for p in params:
        if isinstance(p, DTensor) and any(pl.is_replicate() for pl in p.placements):
            local = p.to_local().detach().contiguous()
            gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, local)
            replicas_agree &= _replicas_equal(p, gathered)
    finite = all(bool(torch.isfinite(p.to_local()).all()) for p in params)
    out = model(torch.randn(2, 512))
    return {
        "on_meta": on_meta,
        "full_bytes": full_bytes,
        "local_bytes": local_bytes,
        "peak_growth": peak_after - peak_before,
        "replicas_agree": replicas_agree,
        "finite": finite,
        "output_shape": tuple(out.shape),
    }


class _WideNet(torch.nn.Module):
    """About 8 MB of float32 parameters per block; ``model.parallelize`` applies to it too (blocks with up/down)."""

    def __init__(self, blocks: int, width: int = 512) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_WideBlock(width) for _ in range(blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class _WideBlock(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def _replicas_equal(param: Any, gathered: list[torch.Tensor]) -> bool:
    """Ranks that hold the same shard (same coordinates on every sharded mesh dimension) hold equal values."""
    mesh = param.device_mesh
    coordinates = {}
    for rank in range(dist.get_world_size()):
        coordinate = tuple(int(c) for c in (mesh.mesh == rank).nonzero()[0])
        key = tuple(c for c, pl in zip(coordinate, param.placements) if not pl.is_replicate())
        coordinates.setdefault(key, []).append(rank)
    return all(torch.equal(gathered[group[0]], gathered[r]) for group in coordinates.values() for r in group)


def collectives_check(strategy: Any) -> dict[str, Any]:
    fabric = new_fabric(strategy)
    rank = fabric.global_rank
    return {
        "sum": float(fabric.all_reduce(torch.tensor(float(rank)), reduce_op="sum")),
        "gathered": fabric.all_gather(torch.tensor([rank])).flatten().tolist(),
        "broadcast": fabric.broadcast({"from": rank}, src=0),
        "any_stop": fabric.strategy.reduce_boolean_decision(rank == 1, all=False),
    }


def set_up(strategy: Any, seed: int = 0, precision: str | None = None) -> tuple[Fabric, Any, Any]:
    fabric = new_fabric(strategy, precision)
    model = fabric.setup_module(make_net(seed))
    return fabric, model, fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))


def checkpoint_save_check(folder: Path) -> dict[str, Any]:
    """Save after 3 steps, sharded (a folder) and full (one file); resume each into fresh sharded objects."""
    after3, _ = reference_run(3, None)
    after5, _ = reference_run(5, None)
    results: dict[str, Any] = {}
    fabric, model, optimizer = set_up(FSDPStrategy())
    train(fabric, model, optimizer, 3, clip=False)
    fabric.save(folder / "sharded", {"model": model, "optimizer": optimizer, "step": 3})
    full_fabric, full_model, full_optimizer = set_up(FSDPStrategy(state_dict_type="full"))
    train(full_fabric, full_model, full_optimizer, 3, clip=False)
    full_fabric.save(folder / "full.pt", {"model": full_model, "optimizer": full_optimizer, "step": 3})
    if dist.get_rank() == 0:
        raw = torch.load(folder / "full.pt", weights_only=True)
        results["full_file_diff"] = max_difference(raw["model"], after3)
        results["full_file_step"] = raw["step"]
    results["files"] = sorted(p.name for p in (folder / "sharded").iterdir())
    # load_raw: a plain torch.save of a one-process model's state dict, into a sharded model
    if dist.get_rank() == 0:
        reference = make_net()
        reference.load_state_dict(after3)
        torch.save(reference.state_dict(), folder / "raw.pt")
        torch.save(torch.optim.AdamW(reference.parameters()).state_dict(), folder / "raw_optimizer.pt")
    fabric.barrier()
    raw_fabric, raw_model, raw_optimizer = set_up(FSDPStrategy(), seed=7)
    raw_fabric.load_raw(folder / "raw.pt", raw_model)
    raw_fabric.load_raw(folder / "raw_optimizer.pt", raw_optimizer)
    results["load_raw_diff"] = max_difference(full_parameters(raw_model.module), after3)
    for name in ("sharded", "full.pt"):
        results[name] = resume_check(FSDPStrategy(), folder / name, after3, after5)
    return results


def resume_check(strategy: Any, path: Path, after3: dict[str, torch.Tensor], after5: dict[str, torch.Tensor]) -> dict[str, Any]:
    fabric, model, optimizer = set_up(strategy, seed=123)  # other weights: the load must replace them all
    remainder = fabric.load(path, {"model": model, "optimizer": optimizer})
    loaded = max_difference(full_parameters(model.module), after3)
    train(fabric, model, optimizer, 2, clip=False, start=3)
    return {"loaded_diff": loaded, "resumed_diff": max_difference(full_parameters(model.module), after5), "remainder": remainder}


def bf16_mixed_check() -> dict[str, Any]:
    """precision="bf16-mixed": autocast in forward, parameters gathered and gradients reduced in bfloat16."""
    fabric, model, optimizer = set_up(FSDPStrategy(), precision="bf16-mixed")
    x, y = (local_batch(fabric, t[0]) for t in data(1))
    output = model(x)
    expected = make_net()(x)
    with fabric.autocast():
        inside = torch.mm(x, x.T).dtype
    losses = []
    for _ in range(4):  # fitting one batch: its loss must fall
        loss = F.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return {
        "output_dtype": output.dtype,  # the wrapper hands back float32
        "autocast_dtype": inside,
        "param_dtype": next(model.module.parameters()).dtype,  # the sharded master weights stay float32
        "relative_output_diff": float((output - expected).abs().max() / expected.abs().max()),
        "losses": losses,
    }


def misuse_check() -> dict[str, str]:
    """The errors that say how to order the calls (each rank gets the same, before any collective)."""
    messages = {}
    fabric = new_fabric(FSDPStrategy())
    model = make_net()
    early = torch.optim.AdamW(model.parameters())
    sharded = fabric.setup_module(model)
    try:
        fabric.setup_optimizers(early)
    except ValueError as err:
        messages["optimizer_before_setup_module"] = str(err)
    model = make_net()
    stepped = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 8)).sum().backward()
    stepped.step()
    try:
        fabric.setup(model, stepped)
    except ValueError as err:
        messages["stepped_optimizer"] = str(err)
    messages["after_good_setup"] = type(fabric.setup_optimizers(torch.optim.AdamW(sharded.parameters()))).__name__
    return messages


def spawned_check(fabric: Fabric) -> dict[str, Any]:
    """Run by ``fabric.launch(spawned_check)`` in workers that a spawn-style strategy started."""
    model = fabric.setup_module(make_net())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    norms = train(fabric, model, optimizer, 2, clip=True)
    return {"world_size": fabric.world_size, "mesh": tuple(fabric.strategy.device_mesh.shape), "norms": norms}


def main() -> None:
    outdir = Path(sys.argv[1])
    world = int(__import__("os").environ["WORLD_SIZE"])
    results: dict[str, Any] = {}
    # memory first: the peak of a process only shows the first big model (at 4 ranks, the tensor-parallel one)
    if world == 4:
        results["tp_empty_init"] = memory_check(
            ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=2), blocks=4, empty_init=True
        )
    results["empty_init"] = memory_check(FSDPStrategy(), blocks=4, empty_init=True)
    results["fsdp"] = training_check(FSDPStrategy())
    results["collectives"] = collectives_check(FSDPStrategy())
    if world == 2:
        wrap = {"auto_wrap_policy": {Block}, "activation_checkpointing_policy": {Block}}
        results["shard_grad_op_joint"] = training_check(FSDPStrategy(sharding_strategy="SHARD_GRAD_OP", **wrap), joint_setup=True)
        results["no_shard"] = training_check(FSDPStrategy(sharding_strategy="NO_SHARD"), steps=3)
        results["accumulate"] = training_check(FSDPStrategy(auto_wrap_policy={Block}), accumulate=2, clip=False, steps=3)
        results["checkpoint"] = checkpoint_save_check(outdir / "checkpoints")
        results["bf16_mixed"] = bf16_mixed_check()
        results["misuse"] = misuse_check()
    if world == 4:
        results["hybrid"] = training_check(FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(2, 2)), steps=3)
        tp = ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=2)
        results["tp"] = training_check(tp)
        results["tp_mesh"] = {"shape": tuple(tp.device_mesh.shape), "names": tp.device_mesh.mesh_dim_names}
        results["tp_accumulate"] = training_check(
            ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=2), accumulate=2, clip=False, steps=3
        )
        if len(sys.argv) > 2:  # the folder of shards and the full file that the 2-rank job wrote
            after3, _ = reference_run(3, None)
            after5, _ = reference_run(5, None)
            saved = Path(sys.argv[2])
            results["reshard_fsdp"] = resume_check(FSDPStrategy(), saved / "sharded", after3, after5)
            tp = ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=2)
            results["reshard_tp"] = resume_check(tp, saved / "sharded", after3, after5)
            tp = ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=2)
            results["full_to_tp"] = resume_check(tp, saved / "full.pt", after3, after5)
    torch.save(results, outdir / f"rank{dist.get_rank()}.pt")


if __name__ == "__main__":
    main()
