"""Horovod's ``DistributedOptimizer``, made safe to wrap, and the optimizer-state helpers Horovod needs.

hvd.DistributedOptimizer returns an instance of a class made on the fly from the user's optimizer
class; its step/zero_grad/load_state_dict call ``super(self.__class__, self)``, which recurses forever
as soon as anything subclasses it, as FabricOptimizer does. It also keeps flags in plain attributes,
which FabricOptimizer (sharing the optimizer's __dict__ by copy) would see go stale. The class made
here puts Horovod's methods on the user's class (one class per user class), replaces those three with
versions that name the user's class explicitly, and keeps the flags in a dict every view shares.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

__all__ = [
    "broadcast_optimizer_state",
    "distributed_optimizer",
    "is_distributed",
    "load_optimizer_state_in_place",
    "synchronize",
]

_SHARED_FLAGS = ("_synchronized", "_should_synchronize", "backward_passes_per_step")
_SAFE_CLASSES: dict[type, type] = {}
# attributes of Horovod's class that are not behaviour to copy (or that we replace)
_NOT_COPIED = frozenset({"__dict__", "__weakref__", "__init__", "__module__", "__qualname__", "__doc__"})


def _shared_flag(name: str) -> property:
    def get(self: Any) -> Any:
        return self.__dict__["_fabric_flags"][name]

    def set(self: Any, value: Any) -> None:
        self.__dict__["_fabric_flags"][name] = value

    return property(get, set)


def _safe_class(horovod_class: type, user_class: type[Any], hvd_synchronize: Callable[[Any], Any]) -> type:
    """One class per user optimizer class, with Horovod's behaviour and none of its ``super`` traps."""
    if user_class in _SAFE_CLASSES:
        return _SAFE_CLASSES[user_class]

    def step(self: Any, closure: Callable[[], Any] | None = None) -> Any:
        if self._should_synchronize:
            self.synchronize()
        self._synchronized = False
        return user_class.step(self) if closure is None else user_class.step(self, closure)

    # user_class.step already runs the step hooks; keep torch from wrapping this step a second time
    step.hooked = True  # type: ignore[attr-defined]

    def zero_grad(self: Any, set_to_none: bool = True) -> None:
        # wait for all-reduces still writing into .grad instead of racing them (Horovod raises here)
        for handle, _ in list(self._handles.values()):
            if handle is not None and not callable(handle):
                hvd_synchronize(handle)
        if self._handles:
            self._handles.clear()
            for p in self._allreduce_delay:
                self._allreduce_delay[p] = self.backward_passes_per_step
        self._synchronized = False
        user_class.zero_grad(self, set_to_none=set_to_none)

    def load_state_dict(self: Any, state_dict: dict[str, Any]) -> None:
        self._handles.clear()
        self._synchronized = False
        self._should_synchronize = True
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        load_optimizer_state_in_place(self, state_dict, load=lambda sd: user_class.load_state_dict(self, sd))

    namespace = {key: value for key, value in vars(horovod_class).items() if key not in _NOT_COPIED}
    namespace.update({name: _shared_flag(name) for name in _SHARED_FLAGS})
    namespace.update(step=step, zero_grad=zero_grad, load_state_dict=load_state_dict, __module__=__name__)
    cls = type(user_class.__name__, (user_class,), namespace)
    _SAFE_CLASSES[user_class] = cls
    return cls


def distributed_optimizer(hvd: Any, optimizer: Optimizer, named_parameters: list[tuple[str, Tensor]]) -> Optimizer:
    """``hvd.DistributedOptimizer(optimizer)`` sharing param groups, state and hooks with ``optimizer``."""
    try:
        distributed = hvd.DistributedOptimizer(optimizer, named_parameters=named_parameters)
    except TypeError as err:
        cls = type(optimizer).__name__
        raise TypeError(
            f"Horovod re-creates the optimizer as {cls}(param_groups) and that failed ({err}); with"
            f" strategy='horovod', {cls}.__init__ needs defaults for every argument but the parameters"
        ) from err
    flags = {name: distributed.__dict__.pop(name) for name in _SHARED_FLAGS}
    distributed.__dict__["_fabric_flags"] = flags
    # Horovod built a fresh Optimizer around the same group dicts; share the user's state, defaults and
    # hooks too, so the user's optimizer object and the returned one stay one optimizer
    for key, value in optimizer.__dict__.items():
        if key != "step":
            distributed.__dict__[key] = value
    distributed.__class__ = _safe_class(type(distributed), type(optimizer), hvd.synchronize)
    return distributed


def is_distributed(optimizer: Any) -> bool:
    return "_fabric_flags" in getattr(optimizer, "__dict__", {})


def synchronize(optimizer: Optimizer) -> None:
    """Finish the gradient all-reduce of ``optimizer`` unless that already happened this step."""
    if is_distributed(optimizer) and not optimizer._synchronized:  # type: ignore[attr-defined]
        optimizer.synchronize()  # type: ignore[attr-defined]


def broadcast_optimizer_state(hvd: Any, optimizer: Optimizer) -> None:
    state = optimizer.state_dict() if hvd.rank() == 0 else None
    if state is not None:  # pickle from the CPU, so every rank unpickles onto a device it has
        state = _tensors_to_cpu(state)
    state = hvd.broadcast_object(state, root_rank=0, name="fabric.optimizer_state")
    if hvd.rank() != 0:
        load_optimizer_state_in_place(optimizer, state)


def _tensors_to_cpu(data: Any) -> Any:
    from lightning_utilities.core.apply_func import apply_to_collection

    return apply_to_collection(data, Tensor, lambda t: t.detach().cpu())


def load_optimizer_state_in_place(
    optimizer: Optimizer, state_dict: dict[str, Any], load: Callable[[dict[str, Any]], None] | None = None
) -> None:
    """``optimizer.load_state_dict`` that keeps the ``param_groups`` list, its dicts and ``state``.

    ``Optimizer.load_state_dict`` replaces them with new objects, which would leave every other view of
    the optimizer (the user's original object, the FabricOptimizer, LR schedulers) on the old ones.
    """
    groups, group_dicts, state = optimizer.param_groups, list(optimizer.param_groups), optimizer.state
    (load or optimizer.load_state_dict)(state_dict)
    for old, new in zip(group_dicts, optimizer.param_groups):
        if old is not new:
            old.clear()
            old.update(new)
    groups[:] = group_dicts
    if optimizer.state is not state:
        new_state = optimizer.state
        state.clear()
        state.update(new_state)
    optimizer.__dict__["param_groups"] = groups
    optimizer.__dict__["state"] = state
