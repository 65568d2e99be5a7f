"""DistributedDataParallel: one process per device, gradients averaged in backward.

The processes come from a launcher ("popen" re-runs the script, "spawn"/"fork"/"forkserver" start
workers that run a function) or from an external launcher (torchrun, SLURM, ...). Every process then
joins one ``torch.distributed`` process group in :meth:`DDPStrategy.setup_environment`.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from fabric._core.env import export_rendezvous
from fabric._core.listening import keep_gloo_on_loopback, tcp_store_arguments
from fabric.strategies.parallel import ParallelStrategy, check_reduce_op
from fabric.strategies.strategy import BackwardSyncControl
from fabric.utilities.collective_device import on_collective_device
from fabric.utilities.group_lifetime import (
    bind_default_arguments_before_the_group_exists,
    leave_process_group,
    leave_process_group_at_exit,
    track_ddp_module,
    wait_until_every_rank_has_joined,
)

START_METHODS = ("popen", "spawn", "fork", "forkserver")
# How long the ranks wait for each other to join, at least, whatever the group's timeout: a short timeout is
# there to end a hung collective quickly, not to fail a job whose ranks start a few seconds apart (a loaded
# machine, another node that starts later). After joining the store's calls take the group's timeout.
JOIN_TIMEOUT_FLOOR = timedelta(minutes=5)

_NAMED_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


class ProcessGroupStrategy(ParallelStrategy):
    """One process per device joined in a ``torch.distributed`` process group; no module wrapping.

    The launcher, the process group's life cycle, device placement and the collectives, shared by every
    strategy built on a process group (DDP, FSDP, model parallel). Subclasses say how a module is wrapped.

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision: filled in by
            the connector when left as None.
        process_group_backend: "gloo", "nccl", ...; by default "nccl" on CUDA devices, else "gloo".
        timeout: how long a collective waits for the other ranks before failing.
        start_method: "popen" (re-run the script), "spawn", "fork" or "forkserver".
    """

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = timedelta(seconds=1800),
        start_method: str = "popen",
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
        )
        if start_method not in START_METHODS:
            raise ValueError(
                f"start_method={start_method!r} is not supported; accepted: {', '.join(map(repr, START_METHODS))}"
            )
        self._start_method = start_method
        self._process_group_backend = process_group_backend
        self._timeout = timeout

    # ---- placement and ranks ------------------------------------------------------------------------

    @property
    @override
    def start_method(self) -> str:
        return self._start_method

    @property
    @override
    def root_device(self) -> torch.device:
        if not self.parallel_devices:
            raise RuntimeError(f"{type(self).__name__} has no parallel_devices yet; the connector sets them")
        return self.parallel_devices[self.local_rank]

    @property
    def process_group_backend(self) -> str:
        """The backend given, else "nccl" for CUDA devices and "gloo" for everything else."""
        if self._process_group_backend is not None:
            return self._process_group_backend
        return "nccl" if self.parallel_devices and self.root_device.type == "cuda" else "gloo"

    # ---- life cycle ---------------------------------------------------------------------------------

    @override
    def configure_launcher(self) -> None:
        """"popen" re-runs the script for the other local ranks; the others start worker processes."""
        from fabric.strategies.launchers import MultiprocessingLauncher, SubprocessScriptLauncher

        if self._start_method == "popen" or self.launched_externally:
            # also under torchrun/SLURM/`fabric run`: the launcher then starts nothing and only runs the
            # function here, so a script written for "ddp_spawn" does not start a second set of ranks
            self._launcher = SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            # its workers run only the function given to Fabric.launch() (launcher.requires_function)
            self._launcher = MultiprocessingLauncher(self, start_method=self._start_method)

    def setup_worker(self, process_idx: int) -> None:
        """Set-up of a worker started by the multiprocessing launcher: it is local rank ``process_idx``."""
        # the environment reads the local rank from here (LightningEnvironment does)
        os.environ["LOCAL_RANK"] = str(process_idx)
        self.setup_environment()

    @override
    def setup_environment(self) -> None:
        """Set the ranks, the device and join the process group (once per process; repeat calls are cheap)."""
        self._set_world_ranks()
        assert self.accelerator is not None, "the connector sets an accelerator before set-up"
        self.accelerator.setup_device(self.root_device)
        self._init_process_group()

    def _init_process_group(self) -> None:
        if not dist.is_available():
            raise RuntimeError(f"torch.distributed is not available in this build of PyTorch; {type(self).__name__} needs it")
        if dist.is_initialized():
            return
        from fabric.utilities.seed import reset_seed

        reset_seed()  # a seed set before launching holds in every process (spawned workers start unseeded)
        env = self.cluster_environment
        export_rendezvous(env.main_address, env.main_port)
        kwargs: dict[str, Any] = {}
        if self._timeout is not None:
            kwargs["timeout"] = self._timeout
        # every rank on this machine: the store and gloo listen on loopback only (fabric/_core/listening.py)
        single_machine = self._ranks_on_one_machine()
        if single_machine:
            keep_gloo_on_loopback()
        timeout = self._timeout or _default_timeout(self.process_group_backend)
        joining = max(timeout, JOIN_TIMEOUT_FLOOR)
        store = _restart_attempt_store(env.main_address, env.main_port, self.world_size, joining)
        if store is None:
            store = _job_store(env.main_address, env.main_port, self.global_rank, self.world_size, single_machine,
                               joining)
        kwargs["store"] = store
        _wait_for_every_rank(store, self.global_rank, self.world_size, joining)
        bind_default_arguments_before_the_group_exists()
        dist.init_process_group(self.process_group_backend, rank=self.global_rank, world_size=self.world_size, **kwargs)
        # no rank may leave (and close its connections) while a peer is still joining
        wait_until_every_rank_has_joined()
        store.set_timeout(timeout)  # from here on the store's calls are bounded as the collectives are
        # Leaving the group explicitly at exit is cheap (~10 ms); left to the destructors, a gloo group can
        # hold the interpreter's exit up by half a second, which every rank of every job pays.
        atexit.register(leave_process_group_at_exit)

    def _ranks_on_one_machine(self) -> bool:
        """Whether every process that reaches this job's store and gloo sockets runs on this machine."""
        return self.num_nodes == 1 and self.world_size == self.num_processes

    @override
    def teardown(self) -> None:
        """Leave the process group (so a later job in this process can join a new one)."""
        from fabric.checkpoint.async_save import wait_for_pending_save

        wait_for_pending_save()  # a background save still talks over the process group
        if dist.is_available():
            leave_process_group()
        super().teardown()

    # ---- collectives ----------------------------------------------------------------------------------

    @override
    def all_reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        """Reduce ``tensor`` over all ranks (a new tensor; the input is left alone).

        "mean" is a sum divided by the world size (gloo has no AVG) and returns floats for integer input.
        """
        if not isinstance(tensor, Tensor):
            return tensor
        check_reduce_op(reduce_op)
        if not (dist.is_available() and dist.is_initialized()):
            return tensor
        op, mean = _to_reduce_op(reduce_op)
        result = tensor.detach()
        # a copy on the rank's device (NCCL serves nothing else): the caller's tensor is left alone
        result = result.clone() if result.device == self.root_device else result.to(self.root_device)
        if result.dtype == torch.bool and (mean or op == dist.ReduceOp.SUM):
            result = result.to(torch.int64)  # a boolean sum would saturate at True: count the votes
        dist.all_reduce(result, op=op, group=group)
        if mean:
            if not (result.is_floating_point() or result.is_complex()):
                result = result.to(torch.get_default_dtype())
            result = result / dist.get_world_size(group)
        return result

    @override
    def barrier(self, name: str | None = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            return
        if dist.get_backend() == "nccl" and self.root_device.type == "cuda":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Send ``obj`` (a tensor or anything picklable, of any shape) from rank ``src`` to all ranks."""
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        # tensors arrive on the device rank ``src`` pickled them on: each rank takes them to its own. The same walk
        # runs on every device (so CPU jobs take the GPU's path); a frozen dataclass, which cannot be rebuilt,
        # comes back as it was sent (the checkpoint pipeline's outcomes are such)
        return apply_to_collection(box[0], Tensor, on_collective_device, self.root_device, allow_frozen=True)


class DDPStrategy(ProcessGroupStrategy):
    """Data parallelism over processes with :class:`torch.nn.parallel.DistributedDataParallel`.

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision: filled in by
            the connector when left as None.
        ddp_comm_state, ddp_comm_hook: a DDP communication hook and its state, registered on the
            wrapped module (e.g. ``default_hooks.allreduce_hook`` with a process group or None).
        ddp_comm_wrapper: wraps the hook, e.g. ``default_hooks.fp16_compress_wrapper``.
        model_averaging_period: post-local SGD. After the warm-up (the ``start_localSGD_iter`` of a
            ``PostLocalSGDState`` given as ``ddp_comm_state``; 0 without one) gradients are reduced
            only inside ``subgroup`` (by default the processes of one machine) and the parameters of
            all replicas are averaged every ``model_averaging_period`` optimizer steps.
        process_group_backend: "gloo", "nccl", ...; by default "nccl" on CUDA devices, else "gloo".
        timeout: how long a collective waits for the other ranks before failing.
        start_method: "popen" (re-run the script), "spawn", "fork" or "forkserver".
        **kwargs: passed to ``DistributedDataParallel`` (e.g. ``find_unused_parameters=True``).
    """

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision: Any = None,
        ddp_comm_state: object | None = None,
        ddp_comm_hook: Callable | None = None,
        ddp_comm_wrapper: Callable | None = None,
        model_averaging_period: int | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = timedelta(seconds=1800),
        start_method: str = "popen",
        **kwargs: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        if model_averaging_period is not None and (
            isinstance(model_averaging_period, bool) or not isinstance(model_averaging_period, int) or model_averaging_period < 1
        ):
            raise ValueError(f"model_averaging_period={model_averaging_period!r} is not valid; accepted: an int >= 1 or None")
        if model_averaging_period is not None:
            ddp_comm_hook, ddp_comm_state = _post_local_sgd_parts(ddp_comm_hook, ddp_comm_state)
        self._ddp_comm_state = ddp_comm_state
        self._ddp_comm_hook = ddp_comm_hook
        self._ddp_comm_wrapper = ddp_comm_wrapper
        self._model_averaging_period = model_averaging_period
        self._model_averager: Any = None
        self._ddp_kwargs = kwargs
        self._backward_sync_control = _DDPBackwardSyncControl()

    # ---- modules and optimizers -----------------------------------------------------------------------

    @override
    def setup_module(self, module: Module) -> DistributedDataParallel:
        """Wrap ``module`` in DistributedDataParallel (which broadcasts rank 0's weights to every rank)."""
        if not dist.is_initialized():
            raise RuntimeError("DDPStrategy.setup_module() needs the process group: call Fabric.launch() first")
        device_ids = [self.root_device.index] if self.root_device.type == "cuda" else None
        ddp = DistributedDataParallel(module, device_ids=device_ids, **self._ddp_kwargs)
        self._register_comm_hook(ddp)
        self._set_up_modules.add(ddp)
        track_ddp_module(ddp)
        return ddp

    def _register_comm_hook(self, ddp: DistributedDataParallel) -> None:
        if self._ddp_comm_hook is None:
            return
        hook = self._ddp_comm_hook
        if self._ddp_comm_wrapper is not None:
            hook = self._ddp_comm_wrapper(hook)
        if self._model_averaging_period is not None:
            from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

            state: Any = self._ddp_comm_state
            if state.subgroup is None and state.post_local_gradient_allreduce and self.root_device.type != "cuda":
                # torch picks the machine's processes as the subgroup only when it can count GPUs; say it here
                # (a collective: every rank sets up its module at the same point)
                state.subgroup, _ = dist.new_subgroups(group_size=self.num_processes)
            warmup = state.start_localSGD_iter
            self._model_averager = PeriodicModelAverager(period=self._model_averaging_period, warmup_steps=warmup)
        ddp.register_comm_hook(state=self._ddp_comm_state, hook=hook)

    @override
    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """Step; with post-local SGD, then average the parameters across ranks when the period is due."""
        output = super().optimizer_step(optimizer, **kwargs)
        if self._model_averager is not None:
            self._model_averager.average_parameters(optimizer.param_groups)
        return output

    @override
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        return _unwrap_ddp(module).state_dict()

    @override
    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        super().load_module_state_dict(_unwrap_ddp(module), state_dict, strict=strict)

    @override
    def teardown(self) -> None:
        self._model_averager = None
        super().teardown()

    def __repr__(self) -> str:
        return f"DDPStrategy(start_method={self._start_method!r}, backend={self._process_group_backend!r})"


class _DDPBackwardSyncControl(BackwardSyncControl):
    """Gradient accumulation without communication: DDP's own ``no_sync()``."""

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        if not isinstance(module, DistributedDataParallel):
            raise TypeError(
                f"no_backward_sync() needs the DistributedDataParallel module that DDPStrategy.setup_module()"
                f" returned, got {type(module).__name__}"
            )
        return module.no_sync()


def _restart_attempt_store(host: str, port: int, world_size: int, timeout: timedelta) -> Any:
    """Under torchrun, a store of this restart attempt's own; None elsewhere (torch's env:// store is fine).

    torchrun's agent keeps one store for the whole job (static and c10d rendezvous alike), and the
    ranks of every attempt rendezvous in it. Without a prefix per attempt, a restarted rank reads the
    failed attempt's keys (its peers' old gloo addresses) and fails with "Connection refused".
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    client = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"fabric/attempt_{attempt}", client)


def _job_store(host: str, port: int, rank: int, world_size: int, single_machine: bool, timeout: timedelta) -> Any:
    """The store torch's ``env://`` rendezvous would create (rank 0 the server), listening on loopback for a
    one-machine job and on the main address's interface otherwise, rather than on every interface."""
    from fabric.utilities.rank_zero import rank_zero_warn

    store = dist.TCPStore(**tcp_store_arguments(host, port, is_server=rank == 0, single_machine=single_machine,
                                                timeout=timeout, world_size=world_size, warn=rank_zero_warn))
    return dist.PrefixStore("default_pg", store)  # the keys where torch's own rendezvous puts them


def _wait_for_every_rank(store: Any, rank: int, world_size: int, timeout: timedelta) -> None:
    """Return once every rank has reached the store (at most ``timeout``).

    torch's group joins with the group's own timeout (gloo waits that long for a peer's address), so a
    rank whose start took longer than a short timeout failed the job; past this wait every rank is there.
    """
    store.set(f"fabric/arrived/{rank}", b"1")
    store.wait([f"fabric/arrived/{peer}" for peer in range(world_size)], timeout)


def _default_timeout(backend: str) -> timedelta:
    """torch's default timeout of a group of ``backend`` (also its store's, when torch creates the store)."""
    from torch.distributed import constants

    nccl = getattr(constants, "default_pg_nccl_timeout", None)
    if backend == "nccl" and isinstance(nccl, timedelta):
        return nccl
    return constants.default_pg_timeout


def _unwrap_ddp(module: Module) -> Module:
    return module.module if isinstance(module, DistributedDataParallel) else module


def _to_reduce_op(reduce_op: Any) -> tuple[Any, bool]:
    """(the ReduceOp to run, whether to divide by the world size afterwards)."""
    if isinstance(reduce_op, str):
        name = reduce_op.lower()
        if name in ("mean", "avg"):
            return dist.ReduceOp.SUM, True
        return _NAMED_OPS[name], False
    if reduce_op == dist.ReduceOp.AVG:
        return dist.ReduceOp.SUM, True
    return reduce_op, False


def _post_local_sgd_parts(hook: Callable | None, state: Any) -> tuple[Callable, Any]:
    """Check (or default) the hook and state for post-local SGD."""
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook

    if hook is None:
        hook = post_localSGD_hook
    if state is None:
        state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=0)
    if not isinstance(state, PostLocalSGDState):
        raise ValueError(
            f"model_averaging_period needs ddp_comm_state to be a PostLocalSGDState (or None), got {type(state).__name__}"
        )
    if hook is not post_localSGD_hook:
        raise ValueError(
            f"model_averaging_period needs ddp_comm_hook=post_localSGD_hook (or None), got {getattr(hook, '__name__', hook)!r}"
        )
    return hook, state
