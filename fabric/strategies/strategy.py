"""The strategy contract: how modules, optimizers, batches, collectives and checkpoints behave.

``Strategy`` holds everything that does not depend on the number of processes (device placement,
precision hooks, checkpoint conversion and validation); subclasses add the parallel parts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from fabric.plugins.io import CheckpointIO, TorchCheckpointIO
from fabric.plugins.io.atomic_folder import is_sharded_checkpoint
from fabric.plugins.io.state_layout import check_entries_present, filtered
from fabric.plugins.precision import Precision
from fabric.utilities.apply_func import move_data_to_device
from fabric.utilities.exceptions import CheckpointMismatchError
from fabric.utilities.init import EmptyInit

if TYPE_CHECKING:
    from fabric.accelerators import Accelerator
    from fabric.strategies.launchers import Launcher

REDUCE_OPS = ("mean", "avg", "sum", "max", "min")


class Strategy(ABC):
    """Base class of every strategy. ``Fabric`` forwards each call here and adds nothing distributed."""

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
    ) -> None:
        self._accelerator = accelerator
        self._checkpoint_io = checkpoint_io
        self._precision = precision
        self._launcher: Launcher | None = None
        self._backward_sync_control: BackwardSyncControl | None = None

    # ---- placement -------------------------------------------------------------------------------

    @property
    @abstractmethod
    def root_device(self) -> torch.device:
        """The device of this process's model and batches."""

    @property
    def launcher(self) -> Launcher | None:
        return self._launcher

    @property
    def accelerator(self) -> Accelerator | None:
        return self._accelerator

    @accelerator.setter
    def accelerator(self, accelerator: Accelerator) -> None:
        self._accelerator = accelerator

    @property
    def checkpoint_io(self) -> CheckpointIO:
        if self._checkpoint_io is None:
            self._checkpoint_io = TorchCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO) -> None:
        self._checkpoint_io = io

    @property
    def precision(self) -> Precision:
        if self._precision is None:
            self._precision = Precision()
        return self._precision

    @precision.setter
    def precision(self, precision: Precision) -> None:
        self._precision = precision

    # ---- ranks (one process unless a subclass says otherwise) ---------------------------------------

    @property
    def global_rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def node_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        """Arguments for a DistributedSampler, or None when data need not be sharded."""
        return None

    # ---- life cycle -------------------------------------------------------------------------------

    def _configure_launcher(self) -> None:
        """Create ``self._launcher`` if this strategy starts processes of its own."""

    def setup_environment(self) -> None:
        """Prepare this process (device, process group). Runs in every process, after launching."""
        assert self.accelerator is not None, "the connector sets an accelerator before set-up"
        self.accelerator.setup_device(self.root_device)

    def teardown(self) -> None:
        self.precision.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()
        self.checkpoint_io.teardown()

    def on_exception(self, exception: BaseException) -> None:
        """Called when the user's code raised; parallel strategies bring the other ranks down."""

    # ---- modules and optimizers -------------------------------------------------------------------

    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer]
    ) -> tuple[Module, list[Optimizer]]:
        module = self.setup_module(module)
        return module, [self.setup_optimizer(optimizer) for optimizer in optimizers]

    def setup_module(self, module: Module) -> Module:
        """Wrap ``module`` for this strategy (e.g. in DistributedDataParallel). Placement is separate."""
        return module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        return optimizer

    def module_to_device(self, module: Module) -> None:
        module.to(self.root_device)

    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """Create parameters directly on the device, in the precision's dtype, optionally uninitialized."""
        contexts = [self.root_device, self.precision.module_init_context()]
        if empty_init:
            contexts.append(EmptyInit())
        return _entered_together(contexts)

    def tensor_init_context(self) -> AbstractContextManager:
        return _entered_together([self.root_device, self.precision.tensor_init_context()])

    def process_dataloader(self, dataloader: Any) -> Any:
        return dataloader

    def batch_to_device(self, batch: Any, device: torch.device | None = None) -> Any:
        return move_data_to_device(batch, device or self.root_device)

    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        self.precision.backward(tensor, module, *args, **kwargs)

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        return self.precision.optimizer_step(optimizer, **kwargs)

    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        self.precision.unscale_gradients(optimizer)
        parameters = _parameters_with_grad(optimizer)
        return torch.nn.utils.clip_grad_norm_(
            parameters, max_norm=max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )

    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self.precision.unscale_gradients(optimizer)
        torch.nn.utils.clip_grad_value_(_parameters_with_grad(optimizer), clip_value=clip_val)

    # ---- collectives ------------------------------------------------------------------------------

    @abstractmethod
    def all_reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        ...

    @abstractmethod
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        ...

    @abstractmethod
    def barrier(self, name: str | None = None) -> None:
        ...

    @abstractmethod
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        ...

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """With ``all=True`` every rank must agree; with ``all=False`` one rank is enough."""
        return bool(decision)

    # ---- checkpoints ------------------------------------------------------------------------------

    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        return module.state_dict()

    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        check_state_dict_fits(module, state_dict, strict=strict)
        module.load_state_dict(state_dict, strict=strict)

    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
        check_optimizer_state_fits(optimizer, state_dict)
        optimizer.load_state_dict(state_dict)

    def save_checkpoint(
        self,
        path: str | Path,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Turn modules/optimizers/stateful objects into state dicts and write the file from rank 0."""
        checkpoint = self._convert_stateful_objects(state, filter)
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def load_checkpoint(
        self,
        path: str | Path,
        state: Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore ``state`` in place from ``path`` and return what the file held beyond it.

        Everything is checked before anything is changed, so a mismatch leaves every object as it was.
        """
        if is_sharded_checkpoint(path):  # a folder written by a sharded strategy loads anywhere
            from fabric.plugins.io.sharded import load_sharded

            return load_sharded(path, state, strict=strict, weights_only=weights_only)  # type: ignore[arg-type]
        checkpoint = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        return self._restore_from_checkpoint(path, checkpoint, state, strict)

    def _restore_from_checkpoint(
        self, path: str | Path, checkpoint: Any, state: Module | Optimizer | dict[str, Any] | None, strict: bool
    ) -> dict[str, Any]:
        """The part of :meth:`load_checkpoint` after reading: check every entry, then load them into ``state``."""
        if state is None:
            return checkpoint
        if isinstance(state, Module):
            self.load_module_state_dict(state, checkpoint, strict=strict)
            return {}
        if isinstance(state, Optimizer):
            self.load_optimizer_state_dict(state, checkpoint)
            return {}
        if not isinstance(checkpoint, dict):
            raise TypeError(f"Checkpoint {str(path)!r} holds a {type(checkpoint).__name__}, not a dict of states")
        check_entries_present(path, state, checkpoint, strict)
        present = {key: obj for key, obj in state.items() if key in checkpoint}
        for key, obj in present.items():
            if isinstance(obj, Module):
                try:
                    check_state_dict_fits(obj, checkpoint[key], strict=strict)
                except (KeyError, RuntimeError) as err:
                    raise type(err)(f"state[{key!r}]: {err.args[0]}") from None
            elif isinstance(obj, Optimizer):
                try:
                    check_optimizer_state_fits(obj, checkpoint[key])
                except ValueError as err:
                    raise ValueError(f"state[{key!r}]: {err}") from None
            elif _is_stateful(obj) and callable(getattr(obj, "check_state_dict", None)):
                # stateful objects that can tell in advance (a FabricDataLoader) are checked here too
                try:
                    obj.check_state_dict(checkpoint[key])
                except ValueError as err:
                    raise ValueError(f"state[{key!r}]: {err}") from None
        for key, obj in present.items():
            value = checkpoint.pop(key)
            if isinstance(obj, Module):
                self.load_module_state_dict(obj, value, strict=strict)
            elif isinstance(obj, Optimizer):
                self.load_optimizer_state_dict(obj, value)
            elif _is_stateful(obj):
                obj.load_state_dict(value)
            else:
                state[key] = value
        return checkpoint

    def _convert_stateful_objects(
        self, state: dict[str, Any], filter: dict[str, Callable[[str, Any], bool]] | None
    ) -> dict[str, Any]:
        converted: dict[str, Any] = {}
        for key, obj in state.items():
            if isinstance(obj, Module):
                value = self.get_module_state_dict(obj)
            elif isinstance(obj, Optimizer):
                value = self.get_optimizer_state(obj)
            elif _is_stateful(obj):
                value = obj.state_dict()
            else:
                value = obj
            converted[key] = filtered(key, value, filter)
        return converted


class BackwardSyncControl(ABC):
    """Turns off gradient synchronization for the backward passes of an accumulation step."""

    @abstractmethod
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        ...


@contextmanager
def _entered_together(contexts: list[AbstractContextManager]) -> Generator[None, None, None]:
    """Enter ``contexts`` when the ``with`` block starts, not when they are created.

    (An ExitStack filled in advance would change the default dtype/device as soon as e.g.
    ``fabric.init_module()`` is called, even if it is never used in a ``with``.)
    """
    with ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _parameters_with_grad(optimizer: Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def check_state_dict_fits(module: Module, state_dict: Any, strict: bool = True) -> None:
    """Raise before loading if ``state_dict`` would not load into ``module`` whole.

    ``Module.load_state_dict`` copies the matching tensors before it reports a shape mismatch, leaving
    the module half-loaded; checking first keeps it intact.
    """
    if not isinstance(state_dict, dict):
        raise TypeError(f"Expected a state dict (a dict of tensors) for {type(module).__name__}, got {type(state_dict).__name__}")
    expected = module.state_dict()
    if strict:
        missing = [k for k in expected if k not in state_dict]
        unexpected = [k for k in state_dict if k not in expected]
        if missing or unexpected:
            raise CheckpointMismatchError(
                f"The checkpoint does not fit {type(module).__name__}: missing keys {missing},"
                f" unexpected keys {unexpected}. Pass strict=False to load the keys that match."
            )
    for key, value in state_dict.items():
        target = expected.get(key)
        if isinstance(target, Tensor) and isinstance(value, Tensor) and target.shape != value.shape:
            raise RuntimeError(
                f"The checkpoint does not fit {type(module).__name__}: first mismatching key {key!r} has shape"
                f" {tuple(value.shape)} in the checkpoint but {tuple(target.shape)} in the model"
            )


def check_optimizer_state_fits(optimizer: Optimizer, state_dict: Any) -> None:
    if not isinstance(state_dict, dict) or "param_groups" not in state_dict:
        raise ValueError(f"Expected an optimizer state dict for {type(optimizer).__name__}, got {type(state_dict).__name__}")
    saved = [len(group["params"]) for group in state_dict["param_groups"]]
    current = [len(group["params"]) for group in optimizer.param_groups]
    if saved != current:
        raise ValueError(
            f"The optimizer state does not fit {type(optimizer).__name__}: parameter group sizes {saved} in the"
            f" checkpoint, {current} in the optimizer"
        )

