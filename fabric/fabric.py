"""The ``Fabric`` facade: the user's loop stays theirs; each call is forwarded to the strategy.

It has no distributed logic of its own (it never imports torch.distributed). Beyond forwarding, it
wraps objects, prints on rank 0, seeds, and dispatches to callbacks and loggers.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any, cast, overload

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from fabric._core.env import started_by_a_cli
from fabric._core.urls import local_or_url
from fabric.accelerators import Accelerator
from fabric.callbacks import call_hook, callbacks_from_argument, loggers_from_argument
from fabric.checkpoint.state import check_filter
from fabric.connector import Connector
from fabric.input_types import (
    AcceleratorInput,
    CallbacksInput,
    DevicesInput,
    LoggersInput,
    PluginInput,
    PrecisionInput,
    StrategyInput,
)
from fabric.launching import check_launch_request, check_takes_fabric, do_nothing
from fabric.setup_inputs import check_optimizers, check_scheduler, prepare_dataloader, prepare_module, wrap_module
from fabric.strategies.strategy import Strategy
from fabric.utilities.apply_func import CPU, as_moved_to_cpu, convert_tensors_to_scalars, convert_to_tensors, move_data_to_device
from fabric.utilities.rank_zero import rank_zero_deprecation, set_rank_zero_rank
from fabric.utilities.seed import seed_everything as _seed_everything
from fabric.wrappers import FabricModule, FabricOptimizer, plain_backward, unwrap, unwrap_state, write_back_plain_values


class Fabric:
    """Accelerate a PyTorch training loop on CPUs, GPUs, processes and machines.

    Args:
        accelerator: "cpu", "cuda", "mps", "gpu" or "auto" (a GPU if there is one), or an Accelerator.
        strategy: "auto", "ddp", "ddp_spawn", "ddp_fork", "ddp_notebook", "ddp_forkserver", "dp",
            "horovod", ... or a Strategy instance.
        devices: how many devices (processes on the CPU) per node, which ones ("0,1", [0, 1]), -1 or "auto".
        num_nodes: number of machines.
        precision: "32-true", "64-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true" or 32, 64, 16, "bf16".
        plugins: a Precision, CheckpointIO or ClusterEnvironment instance, or a list of them.
        callbacks: objects whose methods ``fabric.call(name, ...)`` invokes.
        loggers: loggers for ``fabric.log`` / ``fabric.log_dict``.
    """

    def __init__(
        self,
        *,
        accelerator: AcceleratorInput = "auto",
        strategy: StrategyInput = "auto",
        devices: DevicesInput = "auto",
        num_nodes: int = 1,
        precision: PrecisionInput = None,
        plugins: PluginInput = None,
        callbacks: CallbacksInput = None,
        loggers: LoggersInput = None,
    ) -> None:
        connector = Connector(
            accelerator=accelerator,
            strategy=strategy,
            devices=devices,
            num_nodes=num_nodes,
            precision=precision,
            plugins=plugins,
        )
        self._strategy: Strategy = connector.strategy
        self._callbacks = callbacks_from_argument(callbacks)
        self._loggers = loggers_from_argument(loggers)
        self._launched = False  # launch() was called, or the process was set up on first use
        self._plain_backward = plain_backward(self._strategy)  # the precision plugin is fixed from here on
        self._device_is_cpu: bool | None = None  # found on the first to_device(): a rank's device may not exist yet
        if started_by_a_cli():
            # `fabric run` (ours or Lightning's) started every process: set this one up now, as Lightning Fabric
            # does under its CLI,
            # so the script may use torch.distributed (or a collective) straight after creating Fabric
            self._set_up_process()
        # ``fabric.run(*args)`` launches, then runs the (overridden) method in every process, as in Lightning Fabric
        self.run = partial(self._launch_run, type(self).run)  # type: ignore[method-assign]

    # ---- properties -------------------------------------------------------------------------------

    @property
    def accelerator(self) -> Accelerator:
        return self._strategy.accelerator  # type: ignore[return-value]

    @property
    def strategy(self) -> Strategy:
        return self._strategy

    @property
    def device(self) -> torch.device:
        """The device of this process: where ``setup`` moves models and ``to_device`` moves data."""
        return self._strategy.root_device

    @property
    def global_rank(self) -> int:
        return self._strategy.global_rank

    @property
    def local_rank(self) -> int:
        return self._strategy.local_rank

    @property
    def node_rank(self) -> int:
        return self._strategy.node_rank

    @property
    def world_size(self) -> int:
        return self._strategy.world_size

    @property
    def is_global_zero(self) -> bool:
        return self._strategy.is_global_zero

    @property
    def loggers(self) -> list[Any]:
        return self._loggers

    @property
    def logger(self) -> Any:
        """The first logger; raises when there is none, like Lightning Fabric."""
        if not self._loggers:
            raise RuntimeError("Fabric has no logger; pass Fabric(loggers=...)")
        return self._loggers[0]

    # ---- launching --------------------------------------------------------------------------------

    def launch(self, function: Callable[..., Any] = do_nothing, *args: Any, **kwargs: Any) -> Any:
        """Start the processes of this strategy and set up each one.

        With start method "popen" (strategy "ddp"), call it without a function: the script itself is
        re-run for the other ranks. With "spawn"/"fork"/"forkserver", pass ``function``; each process
        runs ``function(fabric, *args, **kwargs)`` and rank 0's return value comes back here.
        Under an external launcher (torchrun, srun, mpirun, ``fabric-torch run``) nothing is started: the
        process is only set up, and a script may leave ``launch()`` out altogether. Calling it again is
        allowed, as in Lightning Fabric: the processes already started are kept, and ``function`` runs again.
        """
        check_launch_request(self._strategy, function)
        if function is do_nothing:
            return self._launch(do_nothing)
        check_takes_fabric(function)
        return self._launch(function, self, *args, **kwargs)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """Override it in a subclass to make the whole program one method (Lightning Fabric's older style).

        ``MyFabric(...).run(*args)`` launches as ``launch`` does and calls the override with ``args`` in every
        process; rank 0's return value comes back. ``Fabric`` itself has nothing to run.
        """

    def _launch_run(self, run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        function = partial(run, self)
        check_launch_request(self._strategy, function)
        return self._launch(function, *args, **kwargs)

    def _launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        to_run = partial(self._run_with_setup, function)
        launcher = self._strategy.launcher
        if launcher is None:
            return to_run(*args, **kwargs)
        return launcher.launch(to_run, *args, **kwargs)

    def _run_with_setup(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._set_up_process()
        try:
            return function(*args, **kwargs)
        except BaseException as exception:
            if function is not do_nothing:
                self._strategy.on_exception(exception)
            raise

    def _set_up_process(self) -> None:
        self._strategy.setup_environment()
        self._launched = True
        if self._strategy.world_size > 1:
            set_rank_zero_rank(self._strategy.global_rank)

    def _check_launched(self, what: str) -> None:
        if self._launched or not self._strategy.requires_launch:
            return
        if self._strategy.launched_externally:
            # torchrun, srun, mpirun, horovodrun or `fabric run` started every process: nothing is left to
            # launch, so this process is set up here, as launch() would (a script need not call it)
            self._set_up_process()
            return
        raise RuntimeError(
            f"Fabric.{what}() was called before Fabric.launch(). With strategy"
            f" {type(self._strategy).__name__}, call fabric.launch() first (in every process)"
        )

    # ---- set-up of the user's objects ---------------------------------------------------------------

    def setup(
        self,
        module: Module,
        *optimizers: Optimizer,
        scheduler: Any | None = None,
        move_to_device: bool = True,
        _reapply_compile: bool = True,
    ) -> Any:
        """Wrap ``module`` and ``optimizers`` for this strategy; returns them in the same order.

        A ``scheduler`` (an LR scheduler of one of the optimizers) comes back last, as it was given, as in
        Lightning Fabric: ``model, optimizer, scheduler = fabric.setup(model, optimizer, scheduler=scheduler)``.
        A module compiled with ``torch.compile`` is wrapped inside and compiled again with the same options;
        ``_reapply_compile=False`` lets the strategy wrap the compiled module instead.
        """
        self._check_launched("setup")
        check_scheduler(scheduler, optimizers)
        module, original, compile_context = prepare_module(module, self._strategy, move_to_device, optimizers, _reapply_compile)
        wrapped, wrapped_optimizers = self._strategy.setup_module_and_optimizers(module, list(optimizers))
        fabric_module = wrap_module(wrapped, original, self._strategy, compile_context)
        lightning_module = self._register_lightning_module(original)  # before the optimizers read the callbacks' hooks
        fabric_optimizers = [FabricOptimizer(o, self._strategy, self._callbacks) for o in wrapped_optimizers]
        if lightning_module:
            cast(Any, original)._fabric_optimizers = fabric_optimizers
        self.call("on_after_setup", fabric=self, module=fabric_module)
        if not optimizers:
            return fabric_module
        if scheduler is not None:
            return (fabric_module, *fabric_optimizers, scheduler)
        return (fabric_module, *fabric_optimizers)

    def setup_module(self, module: Module, move_to_device: bool = True, _reapply_compile: bool = True) -> FabricModule:
        """Wrap ``module`` alone (optimizers can be set up later with ``setup_optimizers``)."""
        self._check_launched("setup_module")
        module, original, compile_context = prepare_module(module, self._strategy, move_to_device, reapply_compile=_reapply_compile)
        fabric_module = wrap_module(self._strategy.setup_module(module), original, self._strategy, compile_context)
        self._register_lightning_module(original)
        return fabric_module

    def _register_lightning_module(self, module: Module) -> bool:
        """Attach a LightningModule (anything with a ``_fabric`` attribute) to this Fabric, as Lightning Fabric does.

        Its ``self.log``, ``self.logger``, ``self.optimizers()`` and ``self.trainer.<attribute>`` then reach this
        object, and it becomes a callback, so ``fabric.call("on_train_epoch_end")`` runs its hooks.
        """
        if not hasattr(module, "_fabric"):
            return False
        cast(Any, module)._fabric = self
        if not any(callback is module for callback in self._callbacks):
            self._callbacks.append(module)
        return True

    def setup_optimizers(self, *optimizers: Optimizer) -> FabricOptimizer | tuple[FabricOptimizer, ...]:
        self._check_launched("setup_optimizers")
        if not optimizers:
            raise ValueError("setup_optimizers() needs at least one optimizer")
        check_optimizers(optimizers)
        wrapped = [FabricOptimizer(self._strategy.setup_optimizer(o), self._strategy, self._callbacks) for o in optimizers]
        return wrapped[0] if len(wrapped) == 1 else tuple(wrapped)

    def setup_dataloaders(
        self, *dataloaders: Any, use_distributed_sampler: bool = True, move_to_device: bool = True
    ) -> Any:
        """Shard each loader across ranks (a DistributedSampler) and move its batches to the device."""
        self._check_launched("setup_dataloaders")
        if not dataloaders:
            raise ValueError("setup_dataloaders() needs at least one dataloader")
        device = self.device if move_to_device and self._strategy.moves_batches else None
        wrapped = [prepare_dataloader(d, self._strategy, use_distributed_sampler, device) for d in dataloaders]
        return wrapped[0] if len(wrapped) == 1 else wrapped

    # ---- the training step ------------------------------------------------------------------------

    def backward(self, tensor: Tensor, *args: Any, model: FabricModule | None = None, **kwargs: Any) -> None:
        """``tensor.backward()`` with the precision's scaling and the strategy's gradient sync."""
        try:
            if self._plain_backward:  # neither scales nor syncs by itself (DDP syncs in autograd hooks)
                if args or kwargs:
                    tensor.backward(*args, **kwargs)
                else:  # the common call: a plain call is cheaper than one that unpacks
                    tensor.backward()
            else:
                self._strategy.backward(tensor, model._forward_module if isinstance(model, FabricModule) else model, *args, **kwargs)
        except RuntimeError:
            if args or "gradient" in kwargs or not isinstance(tensor, Tensor) or not tensor.requires_grad or tensor.numel() == 1:
                raise
            # torch's "grad can be implicitly created only for scalar outputs" names no shape
            raise RuntimeError(
                f"fabric.backward() needs a scalar tensor (one element, such as a loss), got one of shape"
                f" {tuple(tensor.shape)}; reduce it first (e.g. loss.mean() or loss.sum()), or pass the gradient to"
                " back-propagate: fabric.backward(tensor, gradient)"
            ) from None

    def pipeline_step(
        self, model: FabricModule, *inputs: Any, target: Any = None, loss_fn: Callable[[Any, Any], Tensor] | None = None,
        backward: bool = True,
    ) -> Tensor:
        """One step of a pipeline-parallel model (``ModelParallelStrategy(pipeline_parallel_size=...)``): forward and
        backward over the microbatches the batch is split into (the first stage takes ``inputs``, the last
        ``target``), in place of ``model(x)`` and ``fabric.backward(loss)``.

        ``loss_fn(output, target)`` gives one microbatch's loss. Returns the step's loss on every rank: the mean over
        its microbatches and the data-parallel ranks. Gradients accumulate over steps until ``optimizer.step()``,
        which sees the mean over every microbatch since the last one. ``backward=False`` evaluates (no gradients).
        """
        return self._strategy.pipeline_step(model, inputs, target, loss_fn, backward)

    def clip_gradients(
        self,
        module: Module,
        optimizer: Optimizer,
        clip_val: float | int | None = None,
        max_norm: float | int | None = None,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor | None:
        """Clip gradients by value (``clip_val``) or by total norm (``max_norm``; returns the norm)."""
        if clip_val is not None and max_norm is not None:
            raise ValueError(f"clip_gradients() takes clip_val or max_norm, not both (got {clip_val!r} and {max_norm!r})")
        if clip_val is None and max_norm is None:
            raise ValueError("clip_gradients() needs clip_val (clip by value) or max_norm (clip by norm)")
        module, optimizer = unwrap(module), unwrap(optimizer)
        if max_norm is not None:
            return self._strategy.clip_gradients_norm(
                module, optimizer, max_norm=max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
            )
        self._strategy.clip_gradients_value(module, optimizer, clip_val=clip_val)  # type: ignore[arg-type]
        return None

    def autocast(self) -> AbstractContextManager:
        """Run code outside the model's forward (e.g. the loss) under the same precision."""
        return self._strategy.precision.forward_context()

    @overload
    def to_device(self, obj: Module) -> Module: ...
    @overload
    def to_device(self, obj: Tensor) -> Tensor: ...
    @overload
    def to_device(self, obj: Any) -> Any: ...

    def to_device(self, obj: Any) -> Any:
        """Move a module, a tensor or any collection of tensors to this process's device."""
        device_is_cpu = self._device_is_cpu
        if device_is_cpu is None:  # whether it is the CPU never changes (which GPU may, at launch)
            device_is_cpu = self._device_is_cpu = self._strategy.root_device == CPU
        if device_is_cpu:
            if type(obj) is tuple:  # the common call, a CPU loop's (x, y): checked here, a call saved in every step
                for item in obj:
                    if type(item) is not Tensor or not item.is_cpu:
                        break
                else:
                    return obj
            moved = as_moved_to_cpu(obj)
            if moved is not None:  # a CPU loop's batch, already there: no walk (and no second check in move_data_to_device)
                return moved
        if isinstance(obj, Module):
            self._strategy.module_to_device(obj)
            return obj
        return move_data_to_device(obj, self._strategy.root_device)

    def batch_to_device(self, batch: Any) -> Any:
        """Move a batch (any nesting of containers of tensors) to this process's device."""
        return self._strategy.batch_to_device(batch)

    def no_backward_sync(self, module: FabricModule, enabled: bool = True) -> AbstractContextManager:
        """Skip gradient synchronization in backward inside this block (gradient accumulation).

        The accumulated gradients are synchronized by the first backward outside the block. A module that
        was not set up is refused here, at the call, not only when the block is entered.
        """
        if not isinstance(module, FabricModule):
            raise TypeError(f"no_backward_sync() takes the module returned by setup(), got {type(module).__name__}")
        control = self._strategy.backward_sync_control
        if not enabled or control is None:
            return nullcontext()
        return control.no_backward_sync(module._forward_module, enabled)

    def init_module(self, empty_init: bool | None = None) -> AbstractContextManager:
        """Create a model's parameters directly on the device and in the precision's dtype.

        ``empty_init=True`` skips weight initialization: use it when a checkpoint overwrites the weights.
        """
        self._check_launched("init_module")
        return self._strategy.module_init_context(empty_init=empty_init)

    def sharded_model(self) -> AbstractContextManager:
        """Deprecated, as in Lightning Fabric, where ``init_module`` replaced it; it warns and does nothing here.

        Lightning enters FSDP1's wrapping context for the modules created inside; our sharded strategies
        (FSDP2's ``fully_shard``, model parallel) shard the whole module at ``setup``, so there is nothing to enter.
        """
        rank_zero_deprecation("Fabric.sharded_model() is deprecated; create the model under Fabric.init_module() instead")
        self._check_launched("sharded_model")
        return nullcontext()

    def init_tensor(self) -> AbstractContextManager:
        """Create tensors directly on the device and in the precision's dtype."""
        return self._strategy.tensor_init_context()

    # ---- collectives ------------------------------------------------------------------------------

    def all_reduce(self, data: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """Reduce tensors (or numbers, in any nesting) over all processes: "mean", "sum", "max", "min"."""
        self._check_launched("all_reduce")
        data = convert_to_tensors(data, device=self.device)
        return apply_to_collection(data, Tensor, self._strategy.all_reduce, group=group, reduce_op=reduce_op)

    def all_gather(self, data: Any, group: Any | None = None, sync_grads: bool = False) -> Any:
        """Gather tensors (or numbers, in any nesting) from all processes, stacked as [world_size, ...].

        With one process no dimension is added, like Lightning Fabric.
        """
        self._check_launched("all_gather")
        data = convert_to_tensors(data, device=self.device)
        return apply_to_collection(data, Tensor, self._strategy.all_gather, group=group, sync_grads=sync_grads)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Send ``obj`` (a tensor or any picklable object) from rank ``src`` to every process."""
        self._check_launched("broadcast")
        return self._strategy.broadcast(obj, src=src)

    def barrier(self, name: str | None = None) -> None:
        """Wait until every process has reached this point."""
        self._check_launched("barrier")
        self._strategy.barrier(name=name)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Agree on a decision: with ``all=True`` every rank must say True; with ``all=False`` one is enough."""
        self._check_launched("reduce_boolean_decision")
        return self._strategy.reduce_boolean_decision(decision, all=all)

    @property
    def preempted(self) -> bool:
        """Whether the cluster warned any rank that it will take the machine (SIGTERM or SIGUSR1).

        A collective: read it on every rank at the same point of the loop (e.g. after each optimizer
        step); every rank gets the same answer, so all of them save and stop at the same step. The first
        read starts listening for the signals (docs/preemption.md).
        """
        self._check_launched("preempted")
        from fabric.utilities.preemption import preempted

        return preempted(self._strategy)

    @contextmanager
    def rank_zero_first(self, local: bool = False) -> Generator[None, None, None]:
        """Let rank 0 (of each node with ``local=True``) run the block first, e.g. to download data once."""
        rank = self.local_rank if local else self.global_rank
        if rank > 0:
            self.barrier()
        yield
        if rank == 0:
            self.barrier()

    # ---- output, seeding, callbacks and loggers ------------------------------------------------------

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank 0 only."""
        if self.is_global_zero:
            print(*args, **kwargs)

    @staticmethod
    def seed_everything(seed: int | None = None, workers: bool | None = None, verbose: bool = True) -> int:
        """Seed ``random``, NumPy and torch in this process and in the processes it starts."""
        if workers is None:
            workers = True
        return _seed_everything(seed=seed, workers=workers, verbose=verbose)

    def call(self, hook_name: str, *args: Any, **kwargs: Any) -> None:
        """Call ``hook_name(*args, **kwargs)`` on every callback that has such a method.

        Each method gets only the keyword arguments its signature accepts (all of them with ``**kwargs``),
        so callbacks may take different subsets; an attribute of that name that is not callable is
        skipped with a warning.
        """
        call_hook(self._callbacks, hook_name, args, kwargs)

    def log(self, name: str, value: Any, step: int | None = None) -> None:
        """Log one metric to every logger (tensors become numbers).

        Call it on every rank, as in Lightning: each logger decides who writes, and the loggers this
        package ships (``CSVLogger``, ``TensorBoardLogger``) write on global rank 0 only.
        """
        self.log_dict({name: value}, step=step)

    def log_dict(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log several metrics to every logger (tensors become numbers); see ``log`` for which rank writes."""
        metrics = convert_tensors_to_scalars(dict(metrics))
        for logger in self._loggers:
            logger.log_metrics(metrics=metrics, step=step)

    # ---- checkpoints ------------------------------------------------------------------------------

    def save(
        self,
        path: str | Path,
        state: dict[str, Any],
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
        *,
        async_save: bool = False,
    ) -> None:
        """Write ``state`` to ``path`` atomically (rank 0 writes a file; sharded strategies: every rank its shards).

        Call it on every rank. Modules and optimizers become state dicts; ``filter`` maps a key to a
        ``(name, value) -> bool`` predicate. A set-up dataloader is saved with every rank's position and
        random states (exact resume, ``docs/resume.md``). ``async_save=True`` (ours) returns once the
        tensors are copied off and writes in the background; the next save/load, teardown and exit wait.
        """
        self._check_launched("save")  # before writing anything: the collective at the end would fail late
        if not isinstance(state, dict):
            raise TypeError(f"save(state=...) takes a dict, got {type(state).__name__}")
        if filter is not None:
            check_filter(filter, state)
        path = local_or_url(path)  # a URL is never a local path: its store, or an error naming why not
        unwrapped = unwrap_state(state)
        # collective: returns on every rank once the file is written, or raises rank 0's error on every rank
        # (with async_save: once the state is copied off; the write's outcome comes with the next save)
        if async_save:
            self._strategy.save_checkpoint(path, unwrapped, filter=filter, async_save=True)
        else:  # strategies written before async saves keep working
            self._strategy.save_checkpoint(path, unwrapped, filter=filter)

    def load(
        self,
        path: str | Path,
        state: dict[str, Any] | None = None,
        strict: bool = True,
        *,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore ``state`` in place from ``path``; return the entries of the file not asked for.

        Without ``state``, return the whole file. Loading refuses pickled code unless ``weights_only=False``.
        """
        self._check_launched("load")  # before changing anything: the barrier at the end would fail late
        if state is not None and not isinstance(state, dict):
            raise TypeError(
                f"load(state=...) takes a dict of the objects to restore (e.g. {{'model': model}}), got"
                f" {type(state).__name__}; to load into one module or optimizer, use load_raw(path, obj)"
            )
        unwrapped = unwrap_state(state) if state is not None else None
        path = local_or_url(path)
        remainder = self._strategy.load_checkpoint(path, state=unwrapped, strict=strict, weights_only=weights_only)
        self.barrier()
        if state is not None and unwrapped is not None:
            write_back_plain_values(state, unwrapped)
        return remainder

    def load_raw(self, path: str | Path, obj: Module | Optimizer, strict: bool = True, *, weights_only: bool | None = None) -> None:
        """Load a file holding a bare state dict (e.g. from ``torch.save(model.state_dict())``) into ``obj``."""
        target = unwrap(obj)
        if not isinstance(target, (Module, Optimizer)):
            raise TypeError(f"load_raw() loads into a Module or an Optimizer, got {type(obj).__name__}")
        path = local_or_url(path)
        self._strategy.load_checkpoint(path, state=target, strict=strict, weights_only=weights_only)


def seed_everything(seed: int | None = None, workers: bool = False, verbose: bool = True) -> int:
    """Seed ``random``, NumPy and torch; see ``Fabric.seed_everything``."""
    return _seed_everything(seed=seed, workers=workers, verbose=verbose)
