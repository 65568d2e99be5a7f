"""The strategy contract: how modules, optimizers, batches, collectives and checkpoints behave.

``Strategy`` declares what every strategy offers, with defaults (``requires_launch``, ``moves_batches``,
``handles_gradient_accumulation``, ``start_method``, ``launched_externally``, ``launcher``, ...), takes
what the connector decided through :meth:`Strategy.accept_choices`, and holds everything that does not
depend on the number of processes (device placement, precision hooks, checkpoint conversion);
subclasses add the parallel parts.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from fabric.checkpoint import pipeline
from fabric.checkpoint.fit import check_optimizer_state_fits, check_state_dict_fits
from fabric.checkpoint.pipeline import CheckpointFormat
from fabric.checkpoint.state import StateFilter
from fabric.plugins.io import CheckpointIO, TorchCheckpointIO
from fabric.plugins.precision import Precision
from fabric.utilities.apply_func import move_data_to_device
from fabric.utilities.init import EmptyInit

if TYPE_CHECKING:
    from fabric.accelerators import Accelerator
    from fabric.plugins.environments import ClusterEnvironment
    from fabric.strategies.launchers import Launcher

REDUCE_OPS = ("mean", "avg", "sum", "max", "min")


@dataclass(frozen=True)
class ConnectorChoices:
    """What the connector decided from the user's arguments and the environment.

    A strategy takes each part it was not given explicitly (:meth:`Strategy.accept_choices`); a
    checkpoint IO is only set when the user passed one as a plugin.
    """

    accelerator: Accelerator
    precision: Precision
    checkpoint_io: CheckpointIO | None
    cluster_environment: ClusterEnvironment | None
    parallel_devices: list[torch.device]
    num_nodes: int


class Strategy(ABC):
    """Base class of every strategy. ``Fabric`` forwards each call here and adds nothing distributed."""

    #: ``Fabric.launch()`` must run before set-up: there are processes to start or a group to join.
    requires_launch: ClassVar[bool] = False
    #: Batches of set-up dataloaders go to ``root_device`` (False where the strategy places them itself).
    moves_batches: ClassVar[bool] = True
    #: The strategy itself holds back the gradient sync of accumulation steps (Horovod's optimizer does).
    handles_gradient_accumulation: ClassVar[bool] = False

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
        # the modules setup_module() returned, where gradients are synchronized (block_backward_sync())
        self._set_up_modules: weakref.WeakSet[Module] = weakref.WeakSet()

    def __getstate__(self) -> dict[str, Any]:
        # spawn pickles the strategy before anything is set up; weak references cannot be pickled, so
        # weak sets travel as empty ones
        return {key: _EmptyWeakSet() if isinstance(value, weakref.WeakSet) else value for key, value in self.__dict__.items()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({key: weakref.WeakSet() if isinstance(value, _EmptyWeakSet) else value for key, value in state.items()})

    # ---- placement -------------------------------------------------------------------------------

    @property
    @abstractmethod
    def root_device(self) -> torch.device:
        """The device of this process's model and batches."""

    @property
    def launcher(self) -> Launcher | None:
        """What starts this strategy's processes in ``Fabric.launch()``; None when nothing is started."""
        return self._launcher

    @property
    def start_method(self) -> str | None:
        """How the launcher makes processes ("popen", "spawn", ...); None for a strategy that starts none."""
        return None

    @property
    def launched_externally(self) -> bool:
        """Every process of the job was started by someone else (torchrun, srun, mpirun, ``fabric-torch run``).

        Then nothing is left to launch, and ``Fabric`` sets the process up on first use if the script
        never calls ``launch()``.
        """
        return False

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

    def accept_choices(self, choices: ConnectorChoices) -> None:
        """Take the connector's decisions for every part this strategy was not given explicitly."""
        if self._accelerator is None:
            self._accelerator = choices.accelerator
        if self._precision is None:
            self._precision = choices.precision
        if choices.checkpoint_io is not None:
            self._checkpoint_io = choices.checkpoint_io
        # a CheckpointIO plugin the checkpoint format cannot honour is refused here, not ignored at the first save
        pipeline.check_checkpoint_io(self.checkpoint_format, self._checkpoint_io, type(self).__name__)

    def configure_launcher(self) -> None:
        """Create ``self._launcher`` if this strategy starts processes of its own (the connector calls it once
        the strategy holds its choices)."""

    @property
    def backward_sync_control(self) -> BackwardSyncControl | None:
        """How ``Fabric.no_backward_sync`` turns gradient synchronization off; None when there is none to turn off."""
        return self._backward_sync_control

    def setup_environment(self) -> None:
        """Prepare this process (device, process group). Runs in every process, after launching."""
        assert self.accelerator is not None, "the connector sets an accelerator before set-up"
        self.accelerator.setup_device(self.root_device)

    def teardown(self) -> None:
        from fabric.checkpoint.async_save import wait_for_pending_save

        wait_for_pending_save()  # a background save finishes (or reports its error) before the job ends
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

    def watch_dataloader(self, loader: Any) -> Callable[[], None] | None:
        """See the set-up ``FabricDataLoader``; returns what to call before each of its batches (None: nothing)."""
        return None

    def batch_to_device(self, batch: Any, device: torch.device | None = None) -> Any:
        return move_data_to_device(batch, device or self.root_device)

    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        self.precision.backward(tensor, module, *args, **kwargs)

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        return self.precision.optimizer_step(optimizer, **kwargs)

    def pipeline_step(self, module: Module, inputs: tuple[Any, ...], target: Any, loss_fn: Any, backward: bool) -> Tensor:
        """A step of a pipeline-parallel model (``Fabric.pipeline_step``): only strategies that split a model into stages run one."""
        raise TypeError(
            f"fabric.pipeline_step() runs a model split into pipeline stages, which {type(self).__name__} does not do;"
            " use ModelParallelStrategy(parallelize_fn, pipeline_parallel_size=N, pipeline_split=[...]), or call the"
            " model and fabric.backward() as usual"
        )

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

    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        """Another name of :meth:`all_reduce` (Lightning's strategies have both)."""
        return self.all_reduce(tensor, group=group, reduce_op=reduce_op)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """With ``all=True`` every rank must agree; with ``all=False`` one rank is enough."""
        return bool(decision)

    @contextmanager
    def block_backward_sync(self, module: Module | None = None) -> Generator[None, None, None]:
        """Keep gradients local in the backward passes inside this block (gradient accumulation).

        Without ``module``, every module this strategy set up is held back. A strategy without
        gradient synchronization has nothing to hold back.
        """
        control = self._backward_sync_control
        if control is None:
            yield
            return
        modules = [module] if module is not None else list(self._set_up_modules)
        with ExitStack() as stack:
            for target in modules:
                stack.enter_context(control.no_backward_sync(target, True))
            yield

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

    @property
    def checkpoint_format(self) -> CheckpointFormat:
        """How this strategy's checkpoints are written: "file" (one file from rank 0 through the CheckpointIO
        plugin); sharded strategies write "sharded" folders or gathered "full" files (``fabric.checkpoint.pipeline``)."""
        return "file"

    def save_checkpoint(
        self,
        path: str | Path,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: StateFilter | None = None,
        async_save: bool = False,
    ) -> None:
        """Write ``state`` (modules, optimizers, stateful objects, plain values) to ``path`` in this strategy's format.

        Collective: call it on every rank. When rank 0 fails to write, every rank raises the same error,
        so no rank waits for a file that will not come. With ``async_save`` the tensors are copied off and
        written in the background; a failure there is raised by the next save or load, teardown or exit.
        """
        pipeline.save(self, path, state, filter=filter, async_save=async_save, storage_options=storage_options)

    def load_checkpoint(
        self,
        path: str | Path,
        state: Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore ``state`` in place from ``path`` (a file, or a folder of shards from any number of ranks) and
        return what the checkpoint held beyond it. Everything is checked before anything is changed."""
        return pipeline.load(self, path, state, strict=strict, weights_only=weights_only)


class _EmptyWeakSet:
    """Stands in for a ``weakref.WeakSet`` attribute while a strategy is pickled."""


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


def _parameters_with_grad(optimizer: Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


__all__ = [
    "REDUCE_OPS",
    "BackwardSyncControl",
    "ConnectorChoices",
    "Strategy",
    "check_optimizer_state_fits",
    "check_state_dict_fits",
]
