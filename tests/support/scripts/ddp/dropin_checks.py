"""What a Lightning Fabric user's DDP code relies on, checked inside a real 2-process job (see test_dropin.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fabric import Fabric


class StepModel(nn.Module):
    """A model trained through a method of its own, as Lightning-style code does."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, x: torch.Tensor) -> torch.Tensor:
        return self(x).pow(2).mean()

    def evaluate(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).sum()


def grads_agree(fabric: Any, module: nn.Module) -> bool:
    """Whether every rank holds the same gradients (DDP synchronized them)."""
    flat = torch.cat([p.grad.reshape(-1) for p in module.parameters()])
    gathered = fabric.all_gather(flat)
    return bool(torch.allclose(gathered[0], gathered[1]))


def rank_batch(fabric: Any) -> torch.Tensor:
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(100 + fabric.global_rank))


def dropin_job(fabric: Any, directory: str) -> dict[str, Any]:
    from fabric.utilities.distributed import is_shared_filesystem

    results: dict[str, Any] = {}
    torch.manual_seed(0)
    model = fabric.setup(StepModel())
    model.mark_forward_method("training_step")
    fabric.backward(model.training_step(rank_batch(fabric)))
    results["marked_method_grads_agree"] = grads_agree(fabric, model)
    try:
        model.evaluate(rank_batch(fabric))
        results["unmarked_method"] = "no error"
    except RuntimeError as err:
        results["unmarked_method"] = str(err)

    torch.manual_seed(0)
    plain = StepModel()
    compiled = fabric.setup(torch.compile(plain, backend="eager"))
    results["compiled_forward_module"] = type(compiled._forward_module).__name__
    results["compiled_inner"] = type(compiled._forward_module._orig_mod).__name__
    results["compiled_keys"] = sorted(compiled.state_dict())
    fabric.backward(compiled(rank_batch(fabric)).pow(2).mean())
    results["compiled_grads_agree"] = grads_agree(fabric, plain)

    # Lightning's _reapply_compile=False: DDP wraps the compiled module, which is not compiled again
    torch.manual_seed(0)
    plain = StepModel()
    compiled_inside = fabric.setup_module(torch.compile(plain, backend="eager"), _reapply_compile=False)
    results["not_recompiled_outer"] = type(compiled_inside._forward_module).__name__
    results["not_recompiled_inner"] = type(compiled_inside._forward_module.module).__name__
    results["not_recompiled_keys"] = sorted(compiled_inside.state_dict())
    fabric.backward(compiled_inside(rank_batch(fabric)).pow(2).mean())
    results["not_recompiled_grads_agree"] = grads_agree(fabric, plain)

    # the same module set up twice (accepted, as by Lightning): either wrapper averages the gradients
    model = nn.Linear(2, 1, bias=False)
    first, second = fabric.setup(model), fabric.setup(model)
    x = torch.full((1, 2), float(fabric.global_rank + 1))
    results["set_up_twice_grads"] = []
    for wrapper in (first, second, first):
        model.zero_grad()
        fabric.backward(wrapper(x).sum())
        results["set_up_twice_grads"].append(model.weight.grad.tolist())

    results["shared_filesystem"] = is_shared_filesystem(fabric.strategy, directory)
    return results


class DropinFabric(Fabric):
    """Lightning Fabric's older style: the program is the ``run`` method of a subclass (``DropinFabric(...).run(directory)``)."""

    def run(self, directory: str) -> dict[str, Any]:
        return {**dropin_job(self, directory), "run_on": (self.global_rank, self.world_size)}
