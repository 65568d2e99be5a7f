"""What ``Fabric.setup*`` accept, and how a user's DataLoader is prepared for this strategy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.nn import Module
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from fabric.strategies.strategy import Strategy
from fabric.utilities.compile import compile_again, split_compiled
from fabric.utilities.seed import add_worker_seeding
from fabric.wrappers import FabricDataLoader, FabricModule, FabricOptimizer


def check_module(module: Any) -> None:
    if isinstance(module, FabricModule):
        raise ValueError("This model was already set up; pass each model to setup() once")
    if not isinstance(module, Module):
        raise TypeError(f"setup() takes a torch.nn.Module, got {type(module).__name__}")


def prepare_module(
    module: Any, strategy: Strategy, move_to_device: bool, optimizers: Sequence[Any] = (), reapply_compile: bool = True
) -> tuple[Module, Module, Any]:
    """``(module for the strategy, the user's module, compile options)``: checked, converted to the precision, moved.

    The ``optimizers`` set up with it are checked too, before the module is changed. A ``torch.compile``-d
    module is taken apart: the strategy wraps the module inside, which :func:`wrap_module` compiles again
    with the same options (None: it was not compiled). With ``reapply_compile=False`` (Lightning's
    ``_reapply_compile``, for when compiling the strategy's wrapper fails) the strategy wraps the compiled
    module as it is; the user's module inside still names the state-dict keys.
    """
    inner, compile_context = split_compiled(module)
    check_module(inner)
    check_optimizers(optimizers)
    if not reapply_compile:
        compile_context = None
    else:
        module = inner
    module = strategy.precision.convert_module(module)
    if move_to_device:
        strategy.module_to_device(module)
    return module, inner, compile_context


def wrap_module(wrapped: Module, module: Module, strategy: Strategy, compile_context: Any) -> FabricModule:
    """The ``FabricModule`` around the strategy's ``wrapped`` module (compiled again if the user's was). A strategy
    that keeps only part of the user's module (this rank's pipeline stages) returns a module that does not hold it:
    that module is then the one the wrapper stands for."""
    if compile_context is not None:
        wrapped = compile_again(wrapped, compile_context)
    if not any(part is module for part in wrapped.modules()):
        module = wrapped
    return FabricModule(wrapped, strategy, original_module=module)


def check_optimizers(optimizers: Sequence[Any]) -> None:
    for optimizer in optimizers:
        if isinstance(optimizer, FabricOptimizer):
            raise ValueError("This optimizer was already set up; pass each optimizer to setup() once")
        if isinstance(optimizer, LRScheduler):
            raise TypeError(
                f"setup() takes the optimizers positionally, got a learning-rate scheduler ({type(optimizer).__name__});"
                " pass it by name: fabric.setup(model, optimizer, scheduler=scheduler)"
            )
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"setup() takes torch.optim.Optimizer instances, got {type(optimizer).__name__}")


def check_scheduler(scheduler: Any, optimizers: Sequence[Any]) -> None:
    """A scheduler comes back from ``setup`` after the optimizers it steps; without them it would be dropped."""
    if scheduler is None:
        return
    if not callable(getattr(scheduler, "step", None)):
        raise TypeError(
            f"setup(scheduler=...) takes a learning-rate scheduler (an object with a step() method, e.g."
            f" torch.optim.lr_scheduler.StepLR), got {type(scheduler).__name__}"
        )
    if not optimizers:
        raise ValueError(
            f"setup(model, scheduler=...) got a {type(scheduler).__name__} but no optimizer; pass the optimizer(s)"
            " it steps too: fabric.setup(model, optimizer, scheduler=scheduler)"
        )


def prepare_dataloader(
    dataloader: Any, strategy: Strategy, use_distributed_sampler: bool, device: torch.device | None
) -> FabricDataLoader:
    """Shard ``dataloader`` across ranks, seed its workers, and wrap it to move batches to ``device``."""
    if isinstance(dataloader, FabricDataLoader):
        raise ValueError("This dataloader was already set up; pass each dataloader to setup_dataloaders() once")
    if not isinstance(dataloader, torch.utils.data.DataLoader):
        # as in Lightning Fabric: a list or a custom iterable cannot be sharded, so under DDP every rank
        # would silently iterate all of the data
        raise TypeError(
            f"setup_dataloaders() takes torch.utils.data.DataLoader objects, got {type(dataloader).__name__};"
            " wrap the data in a DataLoader (e.g. DataLoader(dataset, batch_size=...))"
        )
    sampler_kwargs = strategy.distributed_sampler_kwargs
    if use_distributed_sampler and sampler_kwargs is not None:
        from fabric.utilities.data import shard_dataloader

        dataloader = shard_dataloader(dataloader, sampler_kwargs["num_replicas"], sampler_kwargs["rank"])
    dataloader = strategy.process_dataloader(dataloader)
    add_worker_seeding(dataloader, rank=strategy.global_rank)
    loader = FabricDataLoader(dataloader, device=device, rank=strategy.global_rank, world_size=strategy.world_size)
    loader.call_before_each_batch(strategy.watch_dataloader(loader))
    return loader
