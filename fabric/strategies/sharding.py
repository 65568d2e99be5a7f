"""What the sharded strategies (FSDP, model parallel) share, built on PyTorch's DTensor machinery.

A sharded strategy splits each parameter across ranks (``fully_shard``, tensor parallel), so the
parameters after set-up are new ``DTensor`` objects. This module holds the parts that follow from
that: creating a model on the meta device and materialising it only after sharding, giving every
replica the same initial weights, re-pointing an optimizer created before sharding, the gradient
norm over all shards, and turning gradient synchronization off for accumulation.
"""

from __future__ import annotations

import warnings
import weakref
from abc import abstractmethod
from collections.abc import Generator, Iterable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from itertools import chain
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from fabric.checkpoint.fit import check_optimizer_state_fits, check_state_dict_fits
from fabric.checkpoint.pipeline import CheckpointFormat
from fabric.strategies.ddp import ProcessGroupStrategy
from fabric.strategies.strategy import BackwardSyncControl, _entered_together
from fabric.utilities.collective_device import broadcast_tensors
from fabric.utilities.group_lifetime import track_device_mesh


class ShardedStrategy(ProcessGroupStrategy):
    """A process-group strategy whose modules come out of set-up with sharded (DTensor) parameters.

    Subclasses build ``self._device_mesh`` in :meth:`_build_device_mesh` and shard a module in
    :meth:`_shard`; everything around that (meta-device init, replica agreement, optimizers, clipping,
    accumulation) is here.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._device_mesh: Any = None
        self._backward_sync_control = _ShardedBackwardSyncControl()
        # parameters that sharding replaced (by id): an optimizer still holding one was created too early
        self._replaced_parameters: dict[int, weakref.ref[Tensor]] = {}
        self._full_checkpoints = False  # True: one file from rank 0 instead of a folder of shards

    def __getstate__(self) -> dict[str, Any]:
        """Spawn-style launchers pickle the strategy: the weak references (to this process's objects) stay behind."""
        state = super().__getstate__()
        state["_replaced_parameters"] = {}
        return state

    @property
    def device_mesh(self) -> Any:
        """The ``DeviceMesh`` of this job's ranks (exists once the process group does)."""
        if self._device_mesh is None:
            raise RuntimeError(f"{type(self).__name__}.device_mesh exists only after Fabric.launch() started the ranks")
        return self._device_mesh

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self._device_mesh is None:
            self._device_mesh = self._build_device_mesh()
        track_device_mesh(self._device_mesh)  # so that leaving the group frees it (else gloo's threads outlive exit)

    @abstractmethod
    def _build_device_mesh(self) -> Any:
        """The DeviceMesh the modules are sharded over (called once the process group exists)."""

    @abstractmethod
    def _shard(self, module: Module) -> Module:
        """Apply the sharding to ``module`` (its parameters become DTensors); return the module to use."""

    # ---- modules -----------------------------------------------------------------------------------

    @override
    def module_to_device(self, module: Module) -> None:
        """Nothing here: sharding moves each rank's shards to its device, so the whole model never lands on one."""

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """With ``empty_init=True`` parameters go on the meta device: no memory until set-up shards them."""
        contexts: list[AbstractContextManager] = [self.precision.module_init_context()]
        if empty_init:
            import torch._dynamo  # torch 2.8 imports it lazily, which fails on the meta device

            contexts.insert(0, torch.device("meta"))
        return _entered_together(contexts)

    @override
    def setup_module(self, module: Module) -> Module:
        """Shard ``module``; parameters made on the meta device are then allocated (shards only) and initialized."""
        if not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__}.setup_module() needs the process group: call Fabric.launch() first")
        for name, part in module.named_modules():
            if part in self._set_up_modules:  # sharding it again would fail deep inside DTensor
                where = f"its submodule {name!r} ({type(part).__name__})" if name else "it"
                raise ValueError(
                    f"{type(module).__name__} cannot be set up: {where} was already sharded by an earlier setup() of"
                    f" {type(self).__name__}; set each module up once and keep using the module setup() returned"
                )
        on_meta = has_meta_tensors(module)
        if not on_meta:
            broadcast_module_from_rank_zero(module, self.root_device)  # like DDP: every rank starts from rank 0's weights
        before = list(module.parameters())
        module = self._shard(module)
        if on_meta:
            materialize_module(module, self._materialization_device(), self.root_device)
        move_plain_tensors(module, self.root_device)
        after = {id(p) for p in module.parameters()}
        self._replaced_parameters.update((id(p), weakref.ref(p)) for p in before if id(p) not in after)
        self._set_up_modules.add(module)  # also block_backward_sync()'s modules when given none
        return module

    @override
    def setup_module_and_optimizers(self, module: Module, optimizers: list[Optimizer]) -> tuple[Module, list[Optimizer]]:
        """Shard ``module``, then point optimizers created from its original parameters at the sharded ones."""
        names = {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}
        for optimizer in optimizers:
            if optimizer.state:
                raise ValueError(
                    f"{type(optimizer).__name__} has already stepped; its state cannot follow the parameters into"
                    f" {type(self).__name__}. Call setup_module(model) first, then create the optimizer and call"
                    " setup_optimizers(optimizer)"
                )
        module = self.setup_module(module)
        sharded: dict[str, Tensor] = dict(module.named_parameters(remove_duplicate=False))
        for optimizer in optimizers:
            repoint_optimizer(optimizer, names, sharded, type(self).__name__)
        return module, [self.setup_optimizer(optimizer) for optimizer in optimizers]

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Refuse an optimizer over parameters that sharding replaced (created from the model too early)."""
        for group in optimizer.param_groups:
            for param in group["params"]:
                replaced = self._replaced_parameters.get(id(param))
                if param.is_meta or (replaced is not None and replaced() is param):
                    raise ValueError(
                        f"The optimizer holds parameters of the model as it was before {type(self).__name__} sharded it."
                        " Call setup_module(model) first, then create the optimizer from the returned module's"
                        " parameters and call setup_optimizers(optimizer); or pass both to setup(model, optimizer)"
                    )
        return optimizer

    @override
    def clip_gradients_norm(
        self, module: Module, optimizer: Optimizer, max_norm: float | int, norm_type: float | int = 2.0, error_if_nonfinite: bool = True
    ) -> Tensor:
        self.precision.unscale_gradients(optimizer)
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        return clip_grad_norm_over_shards(parameters, max_norm, norm_type, error_if_nonfinite)


    def _materialization_device(self) -> torch.device:
        """Where the shards of a meta-device module are allocated."""
        return self.root_device

    # ---- checkpoints (their folder and file formats live in fabric.checkpoint.formats) -----------------

    @property
    @override
    def checkpoint_format(self) -> CheckpointFormat:
        """A folder in which every rank writes its shards, or with full checkpoints one file from rank 0."""
        return "full" if self._full_checkpoints else "sharded"

    @override
    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Full tensors (e.g. from ``torch.save(model.state_dict())``): each rank keeps its part of each."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        check_state_dict_fits(module, state_dict, strict=strict)
        set_model_state_dict(module, state_dict, options=StateDictOptions(full_state_dict=True, strict=strict))

    @override
    def load_optimizer_state_dict(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
        """A plain ``optimizer.state_dict()`` (numbered, full tensors) into the optimizer of sharded parameters."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

        from fabric.checkpoint.errors import CheckpointMismatchError
        from fabric.checkpoint.layout import keep_saved_group_options, module_of, optimizer_named

        check_optimizer_state_fits(optimizer, state_dict)
        refusal = (
            f"The parameters of {type(optimizer).__name__} belong to no module set up by {type(self).__name__};"
            " create the optimizer from the parameters of the module that setup_module() returned"
        )
        module = module_of(optimizer, self._set_up_modules, refusal, CheckpointMismatchError)  # (the checkpoint wing's rule)
        named = optimizer_named(state_dict, get_optimizer_state_dict(module, optimizer), "optimizer")
        set_optimizer_state_dict(module, optimizer, named, options=StateDictOptions(full_state_dict=True))
        keep_saved_group_options(optimizer, named)


class _ShardedBackwardSyncControl(BackwardSyncControl):
    """Accumulation without communication: FSDP2's ``set_requires_gradient_sync(False)`` on every sharded module."""

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        return _gradient_sync_off(module) if enabled else nullcontext()


@contextmanager
def _gradient_sync_off(module: Module) -> Generator[None, None, None]:
    from torch.distributed.fsdp import FSDPModule

    # tensor parallel alone has no gradient reduction to skip: its collectives are part of the computation
    sharded = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for m in sharded:
        m.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for m in sharded:
            m.set_requires_gradient_sync(True, recurse=False)


# ---- initial weights ----------------------------------------------------------------------------------


def has_meta_tensors(module: Module) -> bool:
    return any(t.is_meta for t in chain(module.parameters(), module.buffers()))


def broadcast_module_from_rank_zero(module: Module, device: torch.device) -> None:
    """Give every rank rank 0's parameters and buffers (before sharding: replicas must start equal).

    The tensors travel through ``device`` (the rank's device: NCCL serves nothing else) in a few packed
    broadcasts, and stay where the module has them.
    """
    broadcast_tensors(list(chain(module.parameters(), module.buffers())), device, src=0)


def materialize_module(module: Module, device: torch.device, collective_device: torch.device) -> None:
    """Allocate the meta tensors of a sharded ``module`` on ``device`` (each rank only its shards) and initialize them.

    Initialization calls each submodule's ``reset_parameters()``; replicated copies (a replicated
    dimension of the mesh, or plain tensors) are then made equal across ranks, since each rank's random
    generator filled its own copy.
    """
    module.to_empty(device=device)
    missing = []
    with torch.no_grad():
        for name, submodule in module.named_modules():
            owns_tensors = any(True for _ in chain(submodule.parameters(recurse=False), submodule.buffers(recurse=False)))
            if not owns_tensors:
                continue
            if callable(getattr(submodule, "reset_parameters", None)):
                submodule.reset_parameters()
            else:
                missing.append(f"{name or '(root)'} ({type(submodule).__name__})")
    if missing:
        warnings.warn(
            "These modules were created under init_module(empty_init=True) but have no reset_parameters(), so their"
            f" parameters and buffers hold uninitialized memory until a checkpoint is loaded: {', '.join(missing)}",
            stacklevel=3,
        )
    broadcast_replicas(module, collective_device)


def broadcast_replicas(module: Module, device: torch.device) -> None:
    """Make the copies of each replicated shard equal: the first rank of each replicating group sends its copy.

    Plain tensors are replicated on every rank; a DTensor's local part is replicated over each mesh
    dimension it is not sharded on. The copies of one group travel packed, through ``device``.
    """
    from torch.distributed.distributed_c10d import get_global_rank

    by_group: dict[Any, list[Tensor]] = {}
    for tensor in chain(module.parameters(), module.buffers()):
        if not isinstance(tensor, DTensor):
            by_group.setdefault(None, []).append(tensor.data)
            continue
        local = tensor.to_local()
        for mesh_dim, placement in enumerate(tensor.placements):
            if placement.is_replicate() and tensor.device_mesh.size(mesh_dim) > 1:
                by_group.setdefault(tensor.device_mesh.get_group(mesh_dim), []).append(local)
    for group, tensors in by_group.items():
        src = 0 if group is None else get_global_rank(group, 0)
        broadcast_tensors(tensors, device, src=src, group=group)


def move_plain_tensors(module: Module, device: torch.device) -> None:
    """Move parameters and buffers that no sharding placed (plain tensors) to ``device``."""
    if any(not isinstance(t, DTensor) and t.device != device for t in chain(module.parameters(), module.buffers())):
        for submodule in module.modules():
            for tensor in list(submodule._parameters.values()) + list(submodule._buffers.values()):
                if tensor is not None and not isinstance(tensor, DTensor) and tensor.device != device:
                    tensor.data = tensor.data.to(device)


# ---- optimizers and gradients -------------------------------------------------------------------------


def repoint_optimizer(optimizer: Optimizer, names: dict[int, str], sharded: dict[str, Tensor], strategy: str) -> None:
    """Replace the original parameters in ``optimizer``'s groups by the sharded parameters of the same name."""
    groups = []
    for group in optimizer.param_groups:
        params = []
        for param in group["params"]:
            name = names.get(id(param))
            if name is None or name not in sharded:
                what = "is not a parameter of the model" if name is None else f"{name!r} was renamed by the sharding"
                raise ValueError(
                    f"setup(model, optimizer) under {strategy} cannot re-point the optimizer: a parameter {what}."
                    " Call setup_module(model) first, then create the optimizer and call setup_optimizers(optimizer)"
                )
            params.append(sharded[name])
        groups.append(params)
    for group, params in zip(optimizer.param_groups, groups):
        group["params"] = params


def clip_grad_norm_over_shards(
    parameters: Iterable[Tensor], max_norm: float | int, norm_type: float | int = 2.0, error_if_nonfinite: bool = True,
    across: Any = None,
) -> Tensor:
    """Scale gradients so their norm over the whole model (every shard on every rank) is at most ``max_norm``.

    Gradients of one mesh and placement (a model sharded one way, or plain tensors) go through torch's
    ``clip_grad_norm_``, as under Lightning: the same numbers (the norm in the gradients' dtype, a DTensor for
    DTensor gradients) and the same return type. torch cannot combine gradients of several meshes or
    placements (tensor parallel beside data parallel): those are grouped by mesh and placement, the norm of
    each group is reduced over its mesh (DTensor knows which ranks hold shards and which hold copies), and
    the groups are combined in float32. ``across``: a process group whose ranks each hold other parameters of
    the model (the stages of a pipeline), whose norms are combined too. Returns the total norm before clipping,
    the same on every rank.
    """
    given = list(parameters)
    parameters = [p for p in given if p.grad is not None]
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads and across is None:
        return torch.tensor(0.0)
    norm_type = float(norm_type)
    groups: dict[Any, list[Tensor]] = {}
    for grad in grads:
        key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
        groups.setdefault(key, []).append(grad)
    if len(groups) == 1 and across is None:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type=norm_type, foreach=False)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    # a rank without gradients still joins the reduction ``across``: on its parameters' device (NCCL serves no other)
    device = norms[0].device if norms else next((p.device for p in given), torch.device("cpu"))
    stacked = torch.stack([n.to(device=device, dtype=torch.float32) for n in norms]) if norms else torch.zeros(1, device=device)
    infinity = norm_type == float("inf")
    total = stacked.max() if infinity else stacked.pow(norm_type).sum()
    if across is not None:
        dist.all_reduce(total, op=dist.ReduceOp.MAX if infinity else dist.ReduceOp.SUM, group=across)
    if not infinity:
        total = total.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} of the gradients is {total.item()}; clipping would make them"
            " meaningless. Pass error_if_nonfinite=False to clip anyway"
        )
    coefficient = float(max_norm) / (total.item() + 1e-6)
    if coefficient < 1.0:
        with torch.no_grad():
            for grad in grads:
                grad.mul_(coefficient)
    return total
