"""Thin wrappers that ``Fabric.setup*`` returns: the user's objects, with the strategy's behaviour added.

They stay what they wrap: a ``FabricModule`` is an ``nn.Module`` with the same forward, attributes and
state-dict keys; a ``FabricOptimizer`` is an instance of the user's optimizer class; a
``FabricDataLoader`` iterates like the loader and moves batches to the device.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.nn import Module
from torch.optim import Optimizer

from fabric.checkpoint.resume.loader_progress import LoaderOwnState, LoaderProgress
from fabric.checkpoint.stateful import is_stateful
from fabric.strategies.strategy import Strategy
from fabric.utilities.apply_func import move_data_to_device
from fabric.utilities.compile import split_compiled
from fabric.utilities.module_call import GLOBAL_HOOKS, JIT_TRACE, SKIPPING_IS_SAFE, calls_like_module

_WRAPPER = "_forward_module."
#: Methods of the user's module that run through the strategy's wrapper without ``mark_forward_method``.
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")
_OWN_ATTRIBUTES = frozenset(
    {
        "_forward_module",
        "_original_module",
        "_strategy",
        "_precision",
        "_fast_forward",
        "_inner_prefix",
        "_forward_methods",
        "_plainly_called",
    }
)
# torch's hooks for every module (dicts it fills in place): while any is registered, a call takes nn.Module's path
_global_forward_pre_hooks, _global_forward_hooks, _global_backward_pre_hooks, _global_backward_hooks = GLOBAL_HOOKS


class FabricModule(Module):
    """The module ``Fabric.setup`` returns; forward runs under the strategy's precision."""

    def __init__(self, forward_module: Module, strategy: Strategy, original_module: Module | None = None) -> None:
        super().__init__()
        self._forward_module = forward_module
        # kept out of ``_modules``: registering it twice would duplicate every key of the state dict
        self.__dict__["_original_module"] = original_module if original_module is not None else forward_module
        self._strategy = strategy
        self._precision = strategy.precision
        self._fast_forward = strategy.precision.is_identity
        self._inner_prefix = _WRAPPER + _path_to(forward_module, self._original_module)
        # a LightningModule's step methods run the model: through the strategy's wrapper by default, as in Lightning
        self._forward_methods: set[str] = set(STEP_METHODS)
        # the wrapped module when its class calls like nn.Module (else None): then its forward can be called directly
        self.__dict__["_plainly_called"] = forward_module if calls_like_module(type(forward_module)) else None
        self._register_state_dict_hook(_drop_wrapper_prefix)
        self._register_load_state_dict_pre_hook(_add_wrapper_prefix, with_module=True)
        self.register_load_state_dict_post_hook(_report_without_prefix)
        self.__dict__["_initialized"] = True

    @property
    def module(self) -> Module:
        """The user's own module."""
        return self._original_module

    @property
    def device(self) -> torch.device:
        """Where the module's parameters (or buffers) are; the strategy's device when it has none."""
        for tensor in self._original_module.parameters():
            return tensor.device
        for tensor in self._original_module.buffers():
            return tensor.device
        return self._strategy.root_device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the module's floating-point parameters (torch's default dtype when it has none)."""
        for tensor in self._original_module.parameters():
            if tensor.is_floating_point():
                return tensor.dtype
        return torch.get_default_dtype()

    def mark_forward_method(self, method: str | Any) -> None:
        """Let ``method`` (a method of the user's module, or its name) run through the strategy's wrapper.

        Call it after ``setup`` for methods other than ``forward`` that run the model, e.g.
        ``model.mark_forward_method("training_step")``; DDP then synchronizes their gradients.
        """
        from fabric.forward_methods import check_forward_method

        self._forward_methods.add(check_forward_method(self._original_module, method))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # The hot path. With no hook on the wrapper, no global module hook and no ``torch.jit.trace`` of a
        # module recording scopes, nn.Module's call machinery would only call ``forward``: skip its two
        # frames, for the wrapper and, where it holds as well, for the wrapped module. (``compile()`` on the
        # wrapper compiles the user's module: ``__setattr__`` sends ``_compiled_call_impl`` there.) Instance
        # dicts are read directly: attribute reads of a module cost more.
        state = self.__dict__
        if (
            not SKIPPING_IS_SAFE  # torch's private names did not check out (fabric.utilities.module_call)
            or state["_forward_pre_hooks"]
            or state["_forward_hooks"]
            or state["_backward_pre_hooks"]
            or state["_backward_hooks"]
            or _global_forward_pre_hooks
            or _global_forward_hooks
            or _global_backward_pre_hooks
            or _global_backward_hooks
            or JIT_TRACE._trace_module_map is not None  # a trace recording scopes (what _slow_forward adds)
        ):
            return Module.__call__(self, *args, **kwargs)
        if not state["_fast_forward"]:
            return self.forward(*args, **kwargs)
        inner = state["_modules"]["_forward_module"]
        if state["_plainly_called"] is inner:
            inner_state = inner.__dict__
            if not (
                inner_state["_forward_pre_hooks"]
                or inner_state["_forward_hooks"]
                or inner_state["_backward_pre_hooks"]
                or inner_state["_backward_hooks"]
                or inner_state.get("_compiled_call_impl") is not None
            ):
                return inner.forward(*args, **kwargs)
        return inner(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # ``self._forward_module`` would go through two ``__getattr__`` frames
        forward_module: Any = self._modules["_forward_module"]
        if self._fast_forward:
            return forward_module(*args, **kwargs)
        precision = self._precision
        if not kwargs and len(args) == 1 and type(args[0]) is torch.Tensor:  # the common call, model(x)
            args = (precision.convert_input(args[0]),)
        elif kwargs or not all(type(arg) is torch.Tensor for arg in args):
            args, kwargs = precision.convert_input((args, kwargs))
        else:  # only tensors: no collection walk
            args = tuple(precision.convert_input(arg) for arg in args)
        with precision.forward_context():
            output = forward_module(*args, **kwargs)
        return precision.convert_output(output)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__.get("_original_module")
            if original is None:
                raise
            attribute = getattr(original, name)
            if not inspect.ismethod(attribute) or self._modules.get("_forward_module") is original:
                return attribute  # no wrapper to bypass
            from fabric.forward_methods import refusing_bypass, through_wrapper

            if name in self.__dict__.get("_forward_methods", ()):
                return through_wrapper(self.forward, original, name)
            return refusing_bypass(original, attribute, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # after set-up, the user's attributes belong on their module, not on the wrapper
        if not self.__dict__.get("_initialized") or name in _OWN_ATTRIBUTES:
            super().__setattr__(name, value)
            return
        setattr(self._original_module, name, value)
        if name in self.__dict__:
            # nn.Module state the wrapper keeps for itself too (``training``, set by train()/eval())
            super().__setattr__(name, value)

    def __repr__(self) -> str:
        return f"FabricModule({self._original_module!r})"


def _path_to(root: Module, target: Module) -> str:
    """Key prefix of ``target`` inside ``root`` ("" when they are the same, "module." inside DDP)."""
    for name, submodule in root.named_modules():
        if submodule is target:
            return f"{name}." if name else ""
    raise ValueError("the original module is not part of the wrapped module")


def _drop_wrapper_prefix(module: FabricModule, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    inner = prefix + module._inner_prefix
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)


def _add_wrapper_prefix(module: FabricModule, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    wrapped = prefix + _WRAPPER
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(wrapped)]:
        state_dict[prefix + module._inner_prefix + key[len(prefix) :]] = state_dict.pop(key)


def _report_without_prefix(module: FabricModule, incompatible_keys: Any) -> None:
    for keys in (incompatible_keys.missing_keys, incompatible_keys.unexpected_keys):
        keys[:] = [key.replace(module._inner_prefix, "", 1) for key in keys]


class FabricOptimizer:
    """Mixed in front of the user's optimizer class; ``step`` goes through the strategy.

    The wrapper reads the optimizer's parameter groups and state through to the optimizer (and shares
    its other attributes), so both views stay in sync, also after the optimizer's ``load_state_dict``.
    """

    _optimizer: Optimizer
    _strategy: Strategy
    _plain_step: bool
    _after_step_hooks: list[Any]

    def __new__(cls, optimizer: Optimizer, strategy: Strategy, callbacks: list[Any] | None = None) -> FabricOptimizer:
        wrapper: Any = object.__new__(_optimizer_class(type(optimizer)))
        wrapper.__dict__.update(_shared_attributes(optimizer))
        wrapper.__dict__["_optimizer"] = optimizer
        wrapper.__dict__["_strategy"] = strategy
        # only the callbacks with the hook: the step stays free of work when none has it
        hooks = [getattr(c, "on_after_optimizer_step", None) for c in callbacks or ()]
        wrapper.__dict__["_after_step_hooks"] = [hook for hook in hooks if callable(hook)]
        wrapper.__dict__["_plain_step"] = plain_optimizer_step(strategy) and not wrapper._after_step_hooks
        # zero_grad only clears the optimizer's gradients: the optimizer's own, with nothing in between
        wrapper.__dict__["zero_grad"] = optimizer.zero_grad
        return wrapper

    def __init__(self, optimizer: Optimizer, strategy: Strategy, callbacks: list[Any] | None = None) -> None:
        pass  # everything is set in __new__; the user's optimizer __init__ must not run again

    @property
    def optimizer(self) -> Optimizer:
        return self._optimizer

    # Read through to the optimizer: its ``load_state_dict`` replaces these objects, and a copy taken at
    # set-up would then silently detach (an LR scheduler on the wrapper would change a stale ``lr``).
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._optimizer.param_groups

    @param_groups.setter
    def param_groups(self, param_groups: list[dict[str, Any]]) -> None:
        self._optimizer.param_groups = param_groups

    @property
    def state(self) -> Any:
        return self._optimizer.state

    @state.setter
    def state(self, state: Any) -> None:
        self._optimizer.state = state

    def step(self, closure: Any = None) -> Any:
        """The strategy's step, then each callback's ``on_after_optimizer_step(strategy=..., optimizer=...)``."""
        if self._plain_step:  # decided at set-up: the strategy's step would only call this, and no callback has a hook
            return self._optimizer.step() if closure is None else self._optimizer.step(closure=closure)
        output = self._strategy.optimizer_step(self._optimizer) if closure is None else self._strategy.optimizer_step(self._optimizer, closure=closure)
        for hook in self._after_step_hooks:
            hook(strategy=self._strategy, optimizer=self._optimizer)
        return output

    def state_dict(self) -> dict[str, Any]:
        return self._strategy.get_optimizer_state(self._optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._optimizer.load_state_dict(state_dict)
        self.__dict__.update(_shared_attributes(self._optimizer))

    def __repr__(self) -> str:
        return f"FabricOptimizer({self._optimizer!r})"


_OPTIMIZER_CLASSES: dict[type, type] = {}


def _optimizer_class(optimizer_class: type) -> type:
    if optimizer_class not in _OPTIMIZER_CLASSES:
        _OPTIMIZER_CLASSES[optimizer_class] = type(
            f"Fabric{optimizer_class.__name__}", (FabricOptimizer, optimizer_class), {"__module__": __name__}
        )
    return _OPTIMIZER_CLASSES[optimizer_class]


def _shared_attributes(optimizer: Optimizer) -> dict[str, Any]:
    # "step" may be an instance attribute patched in by an LR scheduler; it must stay the optimizer's own.
    # "state" and "param_groups" are read through properties, never copied.
    return {key: value for key, value in optimizer.__dict__.items() if key not in _NOT_SHARED}


_NOT_SHARED = frozenset({"step", "zero_grad", "state", "param_groups", "_after_step_hooks", "_plain_step"})


# Asked once, when Fabric and its wrappers are made, so that a training step pays for no layer that adds nothing.
def plain_backward(strategy: Strategy) -> bool:
    """Whether ``strategy.backward(tensor, module, ...)`` is just ``tensor.backward(...)`` (no scaler, no sync of its own)."""
    return type(strategy).backward is Strategy.backward and strategy.precision.plain_backward


def plain_optimizer_step(strategy: Strategy) -> bool:
    """Whether ``strategy.optimizer_step(optimizer, ...)`` is just ``optimizer.step(...)``."""
    return type(strategy).optimizer_step is Strategy.optimizer_step and strategy.precision.plain_optimizer_step


class FabricDataLoader:
    """Iterates like the wrapped loader, with batches moved to ``device`` and the sampler's epoch advanced.

    It is also stateful (``fabric.checkpoint``'s ``CheckedStateful``). A loader with a state of its own
    (``state_dict``/``load_state_dict``: torchdata's ``StatefulDataLoader``, litdata's
    ``StreamingDataLoader``) keeps it: its state is what a checkpoint holds, as in Lightning Fabric, and every
    rank's is kept beside it (``SavedRanksStateful``) for a load by another number of processes. A plain
    DataLoader gets ours, so a run stopped mid-epoch can resume exactly (``docs/resume.md``): where this
    rank is in the data together with its random generator states (``PerRankStateful``); loading it
    restores the generators and makes the next iteration continue at that epoch after the consumed
    batches, without loading them again.
    """

    def __init__(self, dataloader: Any, device: torch.device | None = None, *, rank: int = 0, world_size: int = 1) -> None:
        self._dataloader = dataloader
        self._device = device
        self._progress: LoaderOwnState | LoaderProgress = (
            LoaderOwnState(dataloader, rank, world_size) if is_stateful(dataloader) else LoaderProgress(dataloader, rank, world_size)
        )
        self._before_batch: Callable[[], None] | None = None

    def call_before_each_batch(self, hook: Callable[[], None] | None) -> None:
        """Call ``hook`` before each batch is drawn, and before an iteration begins (the strategy's step start)."""
        self._before_batch = hook

    def data_position(self) -> tuple[int, int] | None:
        """``(epoch, batches consumed)`` of our own position; None for a loader that keeps its own state."""
        return self._progress.position() if isinstance(self._progress, LoaderProgress) else None

    def continue_at(self, epoch: int, batches_consumed: int) -> None:
        """Make the next iteration begin at ``(epoch, batches consumed)`` (see ``data_position``)."""
        if not isinstance(self._progress, LoaderProgress):
            raise TypeError(f"{type(self._dataloader).__name__} keeps its own state: its position cannot be set from outside")
        self._progress.continue_at(epoch, batches_consumed)

    @property
    def per_rank_state(self) -> bool:
        """Whether Fabric.save gathers this loader's state from every rank (our position: random states differ)."""
        return isinstance(self._progress, LoaderProgress)

    @property
    def saved_ranks_beside(self) -> bool:
        """Whether the entry is the wrapped loader's own state, with every rank's kept beside it (``SavedRanksStateful``)."""
        return isinstance(self._progress, LoaderOwnState)

    def state_from_saved_ranks(self, entry: Any, states: list[Any]) -> Any:
        """The wrapped loader's state for this rank, from every saving rank's; ValueError if it cannot take them."""
        if isinstance(self._progress, LoaderOwnState):
            return self._progress.state_from_saved_ranks(entry, states)
        return entry

    @property
    def device(self) -> torch.device | None:
        return self._device

    @property
    def dataloader(self) -> Any:
        return self._dataloader

    def __len__(self) -> int:
        return len(self._dataloader)

    def __iter__(self) -> Iterator[Any]:
        if self._before_batch is not None:
            yield from self._iterate_with_hook(self._before_batch)
            return
        device = self._device
        if device is None:
            yield from self._progress.iterate()
            return
        for batch in self._progress.iterate():
            yield move_data_to_device(batch, device)

    def _iterate_with_hook(self, before_batch: Callable[[], None]) -> Iterator[Any]:
        before_batch()  # before the iteration begins, so that a position it sets is where the iteration starts
        batches = self._progress.iterate()
        device = self._device
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            yield batch if device is None else move_data_to_device(batch, device)
            before_batch()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped loader's own state; for a plain loader, this rank's position and random generator states."""
        return self._progress.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Give the wrapped loader its own state back; for a plain loader, restore our position.

        Ours: the random generators are restored now and the next iteration resumes at the saved position;
        this rank's entry is taken when given the states of all ranks (as ``Fabric.save`` writes them).
        Everything is checked before anything changes.
        """
        self._progress.load_state_dict(state_dict)

    def check_state_dict(self, state_dict: Any) -> dict[str, Any]:
        """This rank's entry of ``state_dict``; ValueError if it cannot be loaded into this loader."""
        return self._progress.check_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in _LOADER_OWN_ATTRIBUTES:
            raise AttributeError(name)
        return getattr(self._dataloader, name)

    def __repr__(self) -> str:
        return f"FabricDataLoader({self._dataloader!r}, device={self._device})"


_LOADER_OWN_ATTRIBUTES = frozenset({"_dataloader", "_device", "_progress"})


def unwrap(obj: Any) -> Any:
    """The user's object behind a Fabric wrapper (or ``obj`` itself); also through ``torch.compile``."""
    inner, _ = split_compiled(obj)
    if isinstance(inner, FabricModule):
        return inner._original_module
    if isinstance(obj, FabricModule):
        return obj._original_module
    if isinstance(obj, FabricOptimizer):
        return obj._optimizer
    if isinstance(obj, FabricDataLoader):
        return obj._dataloader
    return obj


def _unwrap_objects(collection: Any) -> Any:
    """``collection`` (any nesting) with every Fabric wrapper replaced by the user's object.

    Lightning Fabric's private name for it, which its own ``build_your_own_trainer`` example imports.
    """
    from lightning_utilities.core.apply_func import apply_to_collection

    return apply_to_collection(collection, (FabricModule, FabricOptimizer, FabricDataLoader, Module), unwrap)


def is_wrapped(obj: Any) -> bool:
    """Whether ``obj`` came from ``Fabric.setup*`` (also after ``torch.compile`` of a set-up module)."""
    return isinstance(split_compiled(obj)[0], (FabricModule, FabricOptimizer, FabricDataLoader))


def unwrap_state(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with every wrapper replaced by the user's object, for saving and loading.

    A FabricDataLoader stays: its state (position, random states) is its own, not the loader's.
    """
    return {key: value if isinstance(value, FabricDataLoader) else unwrap(value) for key, value in state.items()}


def write_back_plain_values(state: dict[str, Any], loaded: dict[str, Any]) -> None:
    """After a load into ``unwrap_state(state)``, put the loaded plain values (a step count, ...) into ``state``.

    Modules, optimizers and wrappers were restored in place and stay the user's objects.
    """
    for key, value in loaded.items():
        if not is_wrapped(state[key]) and not isinstance(state[key], (Module, Optimizer)):
            state[key] = value
