"""One rank of a sharded-checkpoint test job (started by tests/checkpoint/formats/test_sharded.py).

``job.py OUT save``: train a tiny model under ``fully_shard`` for three AdamW steps, then write it
sharded (``OUT/sharded``), full (``OUT/full.pt``), in Lightning Fabric's sharded layout
(``OUT/lightning-layout``) and, for comparison, as one process sees the whole state
(``OUT/reference-rank{R}.pt``).
``job.py OUT save_two``: the same training, saved sharded after step 3 (``OUT/gen-a``) and again after
step 4 (``OUT/gen-b``): two saves of one model whose files have the same names and sizes.
``job.py OUT load SOURCE``: load SOURCE (folder or file) into a freshly built sharded model and
optimizer, and write what the loaded objects hold, gathered (``OUT/loaded-{NAME}-rank{R}.pt``).
``job.py OUT load_damaged SOURCE``: try to load a damaged SOURCE into a trained sharded model and write
the error and whether this rank's shards stayed exactly as they were (``OUT/damaged-rank{R}.json``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fabric.checkpoint.formats import load_sharded
from fabric.checkpoint.formats.full import save_full
from fabric.checkpoint.formats.sharded import save_sharded
from fabric.checkpoint.layout import optimizer_numbered
from fabric.utilities.group_lifetime import (
    bind_default_arguments_before_the_group_exists,
    leave_process_group_at_exit,
    track_device_mesh,
)
from support.dcp_jobs import job_model


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = job_model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    track_device_mesh(mesh)  # as fabric's sharded strategies do: leaving the group makes the mesh let go of it
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def gathered(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    return {
        "model": get_model_state_dict(model, options=options),
        "optimizer": optimizer_numbered(get_optimizer_state_dict(model, optimizer, options=options)),
    }


def local_shards(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Copies of this rank's own shards of every parameter and optimizer state tensor."""
    shards = {name: param.to_local().detach().clone() for name, param in model.named_parameters()}
    for number, (param, entry) in enumerate(optimizer.state.items()):
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                shards[f"state{number}.{name}"] = local.detach().clone()
        assert param is not None
    return shards


def save_in_lightning_layout(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, others: dict) -> None:
    """The folder Lightning Fabric's sharded save writes (FSDP / ModelParallelStrategy): torch's distributed
    state dicts of the model and the optimizer through ``dcp.save``, and rank 0's ``meta.pt`` with the rest."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=folder)
    if dist.get_rank() == 0:
        torch.save(others, folder / "meta.pt")
    dist.barrier()


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    bind_default_arguments_before_the_group_exists()  # as fabric's strategies do: the group can be freed
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if mode == "save":
        model, optimizer = build(seed=1)
        torch.manual_seed(100 + rank)
        for _ in range(3):
            model(torch.randn(5, 6)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        state = {"model": model, "optimizer": optimizer, "step": 3, "note": {"text": "hi", "rank_zero": rank == 0}}
        save_sharded(out / "sharded", state)
        save_full(out / "full.pt", state)
        torch.save(gathered(model, optimizer), out / f"reference-rank{rank}.pt")
        save_in_lightning_layout(out / "lightning-layout", model, optimizer, {"step": 3, "note": state["note"]})
    elif mode == "save_two":
        model, optimizer = build(seed=1)
        torch.manual_seed(100 + rank)
        for step in range(1, 5):
            model(torch.randn(5, 6)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            if step in (3, 4):
                save_sharded(out / ("gen-a" if step == 3 else "gen-b"), {"model": model, "optimizer": optimizer, "step": step})
    elif mode == "load":
        source = Path(sys.argv[3])
        model, optimizer = build(seed=2)
        state = {"model": model, "optimizer": optimizer, "step": 0}
        remainder = load_sharded(source, state)
        result = gathered(model, optimizer)
        result.update(step=state["step"], remainder=remainder, world_size=dist.get_world_size())
        torch.save(result, out / f"loaded-{source.name}-rank{rank}.pt")
        if len(sys.argv) > 4:  # and save again from this layout
            save_sharded(out / sys.argv[4], {"model": model, "optimizer": optimizer, "step": state["step"]})
    elif mode == "load_damaged":
        model, optimizer = build(seed=2)
        model(torch.randn(5, 6)).square().mean().backward()
        optimizer.step()  # the optimizer has state to lose
        before = local_shards(model, optimizer)
        try:
            load_sharded(Path(sys.argv[3]), {"model": model, "optimizer": optimizer})
            error = None
        except Exception as err:
            error = f"{type(err).__name__}: {err}"
        after = local_shards(model, optimizer)
        unchanged = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
        report = {"error": error, "unchanged": unchanged, "tensors": len(before)}
        (out / f"damaged-rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    leave_process_group_at_exit()  # as fabric's strategies do: the meshes let go of the group, gloo's threads end


if __name__ == "__main__":
    main()
