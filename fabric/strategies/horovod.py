"""Data parallelism with Horovod: processes are started by ``horovodrun``, gradients are averaged by
Horovod's ``DistributedOptimizer`` while the backward pass is still running.

Nothing is launched from here (``launcher`` is None): under ``horovodrun -np N`` every process already
is one rank, and ``fabric.launch()`` only initializes Horovod and this process's device. Each process
drives exactly one device, so ``devices`` may be left at "auto" (or 1): rank ``r`` runs on
``parallel_devices[local_rank]`` when there is such an entry, else on ``cuda:<local_rank>`` (GPU) or the CPU.

Horovod is imported when the strategy is constructed, never by ``import fabric``.

Design choices worth knowing:

* Gradient accumulation (``fabric.no_backward_sync``): inside the block the Horovod hooks are told to
  hold back (the per-parameter countdown Horovod keeps for ``backward_passes_per_step`` is set out of
  reach), so gradients accumulate locally; the first backward outside the block, or else the next
  ``step()``, all-reduces the accumulated gradients once. Backward passes inside the block do not
  count. Several backward passes without the block are also allowed (each one is synchronized, as
  with DDP) instead of Horovod's "computed more than backward_passes_per_step times" assertion.
* ``optimizer.step()`` waits for the gradient all-reduce first (``synchronize``) and then steps without
  a second synchronization, so precision plugins (gradient unscaling) and ``clip_gradients`` always
  see the averaged gradients.
* Optimizer state is sent from rank 0 as one pickled state dict rather than with
  ``hvd.broadcast_optimizer_state``: that function takes an optimizer step with zero gradients when the
  state is empty, which applies weight decay and counts an Adam step before training starts.
* ``teardown()`` does not call ``hvd.shutdown()``: Horovod cannot be initialized again in the same
  process after a shutdown, and it shuts itself down at process exit (``atexit``).
* Horovod process sets are not supported: any ``group`` other than None raises ValueError.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from fabric._core.cluster import HOROVOD_RANK
from fabric.checkpoint.fit import check_optimizer_state_fits
from fabric.strategies.horovod_environment import HorovodEnvironment
from fabric.strategies.horovod_optimizer import (
    broadcast_optimizer_state,
    distributed_optimizer,
    is_distributed,
    load_optimizer_state_in_place,
    synchronize,
)
from fabric.strategies.parallel import ParallelStrategy
from fabric.strategies.strategy import REDUCE_OPS, BackwardSyncControl
from fabric.utilities.rank_zero import rank_zero_warn, set_rank_zero_rank

_INSTALL_HINT = (
    "strategy='horovod' needs Horovod with its PyTorch extension, and it could not be imported ({reason}). "
    "Install it with `make horovod` (or `bash scripts/build_horovod.sh`), which builds Horovod 0.28.1 "
    "with Gloo for the torch in this environment and installs it. A plain `pip install horovod` fails "
    "for torch >= 2.1: the published source asks CMake for C++14, while torch's headers need C++17; "
    "the script patches that and caches the wheel."
)

# parameters whose Horovod countdown is set this high never trigger an all-reduce from a hook
_HOLD_BACK = 1 << 30

# dtypes Horovod 0.28 refuses, and the dtype each travels as (values convert exactly both ways)
_CARRIER = {
    torch.bool: torch.int32,
    torch.uint8: torch.int32,
    torch.int8: torch.int32,
    torch.bfloat16: torch.float32,
}
# for broadcast and gather (no arithmetic) a narrower carrier is enough
_MOVE_CARRIER = {torch.bool: torch.uint8, torch.bfloat16: torch.float32}


def _import_horovod() -> Any:
    try:
        import horovod.torch as hvd
    except ImportError as err:
        raise ImportError(_INSTALL_HINT.format(reason=f"{type(err).__name__}: {err}")) from err
    if not hasattr(hvd, "init"):
        # horovod.torch imports but prints a warning when its compiled extension fails to load
        raise ImportError(
            _INSTALL_HINT.format(
                reason="its compiled PyTorch extension did not load, usually because it was built against"
                f" another torch than {torch.__version__}; rebuild it"
            )
        )
    return hvd


class HorovodStrategy(ParallelStrategy):
    """One process per device, started by ``horovodrun``; gradients are all-reduced by Horovod."""

    handles_gradient_accumulation = True

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: Any = None,
        precision: Any = None,
    ) -> None:
        self._hvd = _import_horovod()
        self._initialized = False
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=HorovodEnvironment(self._horovod),
            checkpoint_io=checkpoint_io,
            precision=precision,
        )
        self._backward_sync_control = _HorovodBackwardSyncControl(self)
        # every DistributedOptimizer made here: no_backward_sync and backward() adjust their bookkeeping
        # (typed Any: they carry Horovod's attributes, _handles, synchronize(), ...)
        self._optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
        # id(parameter) -> name, from the modules set up so far (Horovod names each gradient all-reduce)
        self._parameter_names: dict[int, str] = {}
        self._num_modules = 0
        self._num_optimizers = 0

    # ---- Horovod and ranks ------------------------------------------------------------------------

    def _horovod(self) -> Any:
        """The ``horovod.torch`` module, initialized (rank properties may be read before ``launch()``)."""
        if not self._initialized:
            if not self._hvd.is_initialized():
                self._hvd.init()
            self._initialized = True
        return self._hvd

    @override
    def _set_world_ranks(self) -> None:
        # Horovod decides the ranks, and asking it would initialize it already in Fabric(...): rank-zero
        # output follows horovodrun's variable until setup_environment() asks Horovod itself
        rank = os.environ.get(HOROVOD_RANK, "")
        if rank.isdigit():
            set_rank_zero_rank(int(rank))

    @property
    @override
    def num_nodes(self) -> int:
        """Machines in the job (Horovod's cross size); before Horovod is initialized, what was asked for."""
        return self._hvd.cross_size() if self._initialized else self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        # horovodrun decides how many machines take part; the connector's value is only kept for repr
        self._num_nodes = num_nodes

    @property
    @override
    def num_processes(self) -> int:
        return self._horovod().local_size()

    @property
    @override
    def root_device(self) -> torch.device:
        devices = self.parallel_devices
        kind = devices[0].type if devices else "cpu"
        if kind == "cpu":
            return torch.device("cpu")
        local_rank = self.local_rank
        if local_rank < len(devices):  # type: ignore[arg-type]
            return devices[local_rank]  # type: ignore[index]
        # devices=1 under horovodrun on a multi-GPU machine: one GPU per process, chosen by local rank
        return torch.device(kind, local_rank)

    @override
    def setup_environment(self) -> None:
        hvd = self._horovod()
        if hvd.size() == 1 and self.parallel_devices is not None and len(self.parallel_devices) > 1:
            rank_zero_warn(
                f"strategy='horovod' was given {len(self.parallel_devices)} devices but runs as 1 process:"
                " Horovod starts no processes itself. Run the script with"
                f" `horovodrun -np {len(self.parallel_devices)} python ...`"
            )
        super().setup_environment()
        set_rank_zero_rank(hvd.rank())

    # ---- modules and optimizers -------------------------------------------------------------------

    @override
    def setup_module(self, module: Module) -> Module:
        """Start every rank from rank 0's parameters and buffers; the module itself is not wrapped."""
        hvd = self._horovod()
        prefix = f"module{self._num_modules}."
        self._num_modules += 1
        for name, parameter in module.named_parameters():
            self._parameter_names.setdefault(id(parameter), prefix + name)
        if hvd.size() > 1:
            tensors = {name: value for name, value in module.state_dict().items() if isinstance(value, Tensor)}
            hvd.broadcast_parameters(tensors, root_rank=0)
        self._set_up_modules.add(module)
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Start from rank 0's optimizer state, then all-reduce gradients through Horovod."""
        hvd = self._horovod()
        index = self._num_optimizers
        self._num_optimizers += 1
        if hvd.size() > 1:
            broadcast_optimizer_state(hvd, optimizer)
        named = [
            (f"optimizer{index}.{self._parameter_names.get(id(p), f'unnamed.{g}.{i}')}", p)
            for g, group in enumerate(optimizer.param_groups)
            for i, p in enumerate(group["params"])
        ]
        distributed = distributed_optimizer(hvd, optimizer, named)
        self._optimizers.add(distributed)
        return distributed

    @override
    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        for optimizer in self._optimizers:
            # a second backward before step(): let the first all-reduce finish, so the hooks can run again
            if any(handle is not None for handle, _ in optimizer._handles.values()):
                optimizer.synchronize()
            optimizer._synchronized = False
        super().backward(tensor, module, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if not is_distributed(optimizer):
            return super().optimizer_step(optimizer, **kwargs)
        closure = kwargs.pop("closure", None)
        closure_result = None
        if closure is not None:
            # the closure's backward must finish before the gradients are all-reduced
            with torch.enable_grad():
                closure_result = closure()
        synchronize(optimizer)
        should_synchronize = optimizer._should_synchronize
        optimizer._should_synchronize = False
        try:
            result = super().optimizer_step(optimizer, **kwargs)
        finally:
            optimizer._should_synchronize = should_synchronize
        return closure_result if closure is not None else result

    @override
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        synchronize(optimizer)  # clip the averaged gradients, the same on every rank
        return super().clip_gradients_norm(
            module, optimizer, max_norm=max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )

    @override
    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        synchronize(optimizer)
        super().clip_gradients_value(module, optimizer, clip_val=clip_val)

    @override
    def load_optimizer_state_dict(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
        check_optimizer_state_fits(optimizer, state_dict)
        load_optimizer_state_in_place(optimizer, state_dict)

    # ---- collectives ------------------------------------------------------------------------------

    @override
    def all_reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        """Reduce ``tensor`` over all ranks ("mean"/"avg", "sum", "max", "min") into a new, detached tensor.

        As with DDP: the mean of an integer tensor is a float tensor, the sum of a bool tensor counts the
        True entries (int64). Non-tensors come back unchanged.
        """
        _check_group(group)
        op_name = _reduce_op_name(reduce_op)
        if not isinstance(tensor, Tensor):
            return tensor
        hvd = self._horovod()
        wire, result_dtype = tensor.detach(), tensor.dtype
        if op_name == "Average" and not (tensor.is_floating_point() or tensor.is_complex()):
            wire = wire.to(torch.get_default_dtype())
            result_dtype = wire.dtype
        elif tensor.dtype == torch.bool and op_name == "Sum":
            wire = wire.to(torch.int64)  # count the True votes instead of saturating at True
            result_dtype = torch.int64
        elif tensor.dtype in _CARRIER:
            wire = wire.to(_CARRIER[tensor.dtype])
        if wire.is_complex():
            if op_name not in ("Average", "Sum"):
                raise ValueError(f"reduce_op={reduce_op!r} is not defined for complex tensors; use 'sum' or 'mean'")
            return torch.view_as_complex(hvd.allreduce(torch.view_as_real(wire), op=getattr(hvd, op_name)))
        result = hvd.allreduce(wire, op=getattr(hvd, op_name))
        return result if result.dtype == result_dtype else result.to(result_dtype)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Stack ``tensor`` from every rank into [world_size, ...] (same shape on every rank).

        With ``sync_grads`` the result is differentiable: a rank's input gets the sum over all ranks of
        the gradients flowing into its slice (as with ``torch.distributed.nn.all_gather`` under DDP).
        """
        _check_group(group)
        if not isinstance(tensor, Tensor):
            return tensor
        self._horovod()
        carrier = _MOVE_CARRIER.get(tensor.dtype)
        wire = tensor.to(carrier) if carrier is not None else tensor
        if sync_grads:
            gathered = _AllGatherSumGrad.apply(wire)
        else:
            with torch.no_grad():
                gathered = self._hvd.allgather(wire.detach().unsqueeze(0).contiguous())
        return gathered.to(tensor.dtype) if carrier is not None else gathered

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Send ``obj`` from rank ``src`` to all ranks: tensors by Horovod broadcast, anything else pickled.

        Whether ``obj`` is a tensor is decided by rank ``src``, so other ranks may pass anything (e.g. None).
        """
        hvd = self._horovod()
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < hvd.size():
            raise ValueError(f"broadcast(src={src!r}) must be a rank between 0 and {hvd.size() - 1}")
        if hvd.size() == 1:
            return obj
        is_src = hvd.rank() == src
        # one small message first, so every rank takes the same path whatever it holds itself
        header = (tuple(obj.shape), obj.dtype, obj.device.type) if is_src and isinstance(obj, Tensor) else None
        header = hvd.broadcast_object(header, root_rank=src, name="fabric.broadcast.header")
        if header is None:
            return hvd.broadcast_object(obj if is_src else None, root_rank=src, name="fabric.broadcast.object")
        shape, dtype, device_type = header
        if is_src or (isinstance(obj, Tensor) and tuple(obj.shape) == shape and obj.dtype == dtype):
            payload = obj.detach()
        else:
            payload = torch.empty(shape, dtype=dtype, device=self.root_device if device_type != "cpu" else "cpu")
        carrier = _MOVE_CARRIER.get(dtype)
        wire = payload.to(carrier) if carrier is not None else payload
        if wire.is_complex():
            wire = torch.view_as_real(wire)
        result = hvd.broadcast(wire.contiguous(), root_rank=src, name="fabric.broadcast.tensor")
        if dtype.is_complex:
            result = torch.view_as_complex(result)
        return result.to(dtype) if carrier is not None else result

    @override
    def barrier(self, name: str | None = None) -> None:
        hvd = self._horovod()
        if hvd.size() == 1:
            return
        if hasattr(hvd, "barrier"):
            hvd.barrier()
        else:  # Horovod before 0.23
            hvd.allreduce(torch.zeros(1), name=f"fabric.barrier.{name or ''}")

    def __repr__(self) -> str:
        return f"HorovodStrategy(initialized={self._initialized})"


class _HorovodBackwardSyncControl(BackwardSyncControl):
    """Holds back Horovod's gradient all-reduce for the backward passes inside the block."""

    def __init__(self, strategy: HorovodStrategy) -> None:
        self._strategy = strategy

    @override
    @contextmanager
    def no_backward_sync(self, module: Module, enabled: bool) -> Generator[None, None, None]:
        if not enabled:
            yield
            return
        parameters = {id(p) for p in module.parameters()}
        saved: list[tuple[dict[Tensor, int], Tensor, int]] = []
        for optimizer in self._strategy._optimizers:
            countdown = optimizer._allreduce_delay
            for p in countdown:
                if id(p) in parameters:
                    saved.append((countdown, p, countdown[p]))
                    countdown[p] = _HOLD_BACK
        try:
            yield
        finally:
            # the next backward outside the block (or the next step) all-reduces what accumulated
            for countdown, p, value in saved:
                countdown[p] = value


class _AllGatherSumGrad(torch.autograd.Function):
    """All-gather whose backward sums the incoming gradients over ranks.

    Horovod's own differentiable allgather averages them, which differs from DDP's all_gather by a
    factor of world_size.
    """

    @staticmethod
    def forward(ctx: Any, tensor: Tensor) -> Tensor:
        import horovod.torch as hvd

        ctx.rank = hvd.rank()
        return hvd.allgather(tensor.unsqueeze(0).contiguous())

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> Tensor:
        import horovod.torch as hvd

        return hvd.allreduce(grad_output.contiguous(), op=hvd.Sum)[ctx.rank]


def _check_group(group: Any) -> None:
    if group is not None:
        raise ValueError(
            f"group={group!r} is not supported by strategy='horovod' (Horovod process sets are not supported"
            " here); pass group=None to use all ranks"
        )


def _reduce_op_name(reduce_op: Any) -> str:
    """The ``horovod.torch`` attribute for ``reduce_op``: a name or a ``torch.distributed.ReduceOp``."""
    names = {"mean": "Average", "avg": "Average", "sum": "Sum", "max": "Max", "min": "Min"}
    if isinstance(reduce_op, str) and reduce_op.lower() in names:
        return names[reduce_op.lower()]
    if not isinstance(reduce_op, str):
        import torch.distributed as dist

        if dist.is_available():
            ops = dist.ReduceOp
            for member, name in ((ops.SUM, "Sum"), (ops.AVG, "Average"), (ops.MAX, "Max"), (ops.MIN, "Min")):
                try:
                    if reduce_op == member:
                        return name
                except TypeError:
                    break
    accepted = ", ".join(repr(name) for name in REDUCE_OPS)
    raise ValueError(
        f"reduce_op={reduce_op!r} is not supported by strategy='horovod'; accepted: {accepted}"
        " or torch.distributed.ReduceOp.SUM/AVG/MAX/MIN"
    )


__all__ = ["HorovodEnvironment", "HorovodStrategy"]
