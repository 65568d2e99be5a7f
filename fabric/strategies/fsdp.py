"""Fully sharded data parallelism on ``torch.distributed.fsdp.fully_shard`` (FSDP2).

Every rank holds a slice of each parameter, of its gradient and of the optimizer state; a layer's
full parameters exist only while it runs (gathered before its forward and backward, freed after).
Unlike Lightning Fabric this runs on the CPU too (gloo), which is how the tests run it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
from torch.nn import Module
from typing_extensions import override

from fabric.strategies.sharding import ShardedStrategy

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
STATE_DICT_TYPES = ("sharded", "full")


class FSDPStrategy(ShardedStrategy):
    """Fully sharded data parallel training (Lightning Fabric's arguments, on FSDP2).

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision: filled in by
            the connector when left as None.
        process_group_backend, timeout: as for DDP.
        cpu_offload: keep parameters, gradients and optimizer state in CPU memory between uses (True
            or a ``CPUOffloadPolicy``). On CPU devices they are there already, and nothing changes.
        mixed_precision: a ``MixedPrecisionPolicy``; by default it follows the precision plugin
            ("bf16-mixed": parameters gathered and gradients reduced in bfloat16, "16-mixed" likewise
            in float16).
        auto_wrap_policy: which submodules become their own shard unit (gathered and freed on their
            own): a set of module classes, ``callable(module) -> bool``, or an FSDP1-style policy
            ``callable(module, recurse, nonwrapped_numel) -> bool``. The root module is always one.
        activation_checkpointing_policy: which submodules recompute their activations in backward
            instead of keeping them: a set of module classes or ``callable(module) -> bool``.
        activation_checkpointing: Lightning's older name: a module class or a list of them.
        sharding_strategy: "FULL_SHARD" (free gathered parameters after forward), "SHARD_GRAD_OP"
            (keep them until backward), "NO_SHARD" (every rank holds everything: DDP-like),
            "HYBRID_SHARD" (shard within a group of ranks, replicate across groups; see ``device_mesh``).
        state_dict_type: "sharded" (each rank saves its shards into a folder) or "full" (one file).
        device_mesh: for "HYBRID_SHARD", ``(replicas, shard size)`` or a ``DeviceMesh``; by default
            (number of nodes, processes per node).
        start_method: "popen" (re-run the script), "spawn", "fork" or "forkserver".
        **kwargs: passed to ``fully_shard`` (e.g. ``reshard_after_forward``, ``shard_placement_fn``).
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
        cpu_offload: Any = None,
        mixed_precision: Any = None,
        auto_wrap_policy: Any = None,
        activation_checkpointing: Any = None,
        activation_checkpointing_policy: Any = None,
        sharding_strategy: Any = "FULL_SHARD",
        state_dict_type: str = "sharded",
        device_mesh: Any = None,
        start_method: str = "popen",
        **kwargs: Any,
    ) -> None:
        super().__init__(
            accelerator, parallel_devices, cluster_environment, checkpoint_io, precision, process_group_backend, timeout, start_method
        )
        self.sharding_strategy = _parse_sharding_strategy(sharding_strategy)
        if state_dict_type not in STATE_DICT_TYPES:
            raise ValueError(f"state_dict_type={state_dict_type!r} is not supported; accepted: 'sharded', 'full'")
        if activation_checkpointing is not None and activation_checkpointing_policy is not None:
            raise ValueError("Pass activation_checkpointing_policy or activation_checkpointing (its older form), not both")
        if activation_checkpointing is not None:
            classes = activation_checkpointing if isinstance(activation_checkpointing, (list, tuple, set)) else [activation_checkpointing]
            activation_checkpointing_policy = set(classes)
        self._auto_wrap_policy = _check_policy(auto_wrap_policy, "auto_wrap_policy")
        self._checkpointing_policy = _check_policy(activation_checkpointing_policy, "activation_checkpointing_policy")
        self.cpu_offload = _check_cpu_offload(cpu_offload)
        self.mixed_precision = mixed_precision
        self._state_dict_type = state_dict_type
        self._full_checkpoints = state_dict_type == "full"
        self._mesh_request = _check_mesh_request(device_mesh, self.sharding_strategy)
        self._fully_shard_kwargs = kwargs

    # ---- the mesh and the sharding ----------------------------------------------------------------------

    @override
    def _build_device_mesh(self) -> Any:
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        if isinstance(self._mesh_request, DeviceMesh):
            return self._mesh_request
        device_type = self.root_device.type
        world = self.world_size
        if self.sharding_strategy == "NO_SHARD":
            shape: tuple[int, ...] = (world, 1)
        elif self.sharding_strategy == "HYBRID_SHARD":
            shape = self._mesh_request or (self.num_nodes, world // self.num_nodes)
        else:
            return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
        if shape[0] * shape[1] != world:
            raise ValueError(f"device_mesh={shape} has {shape[0] * shape[1]} ranks, but the job has {world}")
        return init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))

    @override
    def _shard(self, module: Module) -> Module:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if any(isinstance(m, FSDPModule) for m in module.modules()):
            raise ValueError(f"{type(module).__name__} is already sharded with fully_shard; pass the unsharded module")
        if self._checkpointing_policy is not None:
            from torch.distributed._composable import checkpoint

            for submodule in _selected(module, self._checkpointing_policy, include_root=False):
                checkpoint(submodule)
        kwargs = self._fully_shard_arguments()
        if self._auto_wrap_policy is not None:
            for submodule in _selected(module, self._auto_wrap_policy, include_root=False):
                fully_shard(submodule, **kwargs)  # children first: _selected walks bottom-up
        fully_shard(module, **kwargs)
        if reduces_gradients_by_summing(torch.__version__, torch.distributed.get_backend()):
            for submodule in module.modules():
                if isinstance(submodule, FSDPModule):
                    submodule.set_force_sum_reduction_for_comms(True)  # FSDP then divides by the world size itself
        return module

    def _offloads(self) -> bool:
        return self.cpu_offload is not None and self.root_device.type != "cpu"

    @override
    def _materialization_device(self) -> torch.device:
        """With CPU offload the shards live in CPU memory (fully_shard insists), else on this rank's device."""
        return torch.device("cpu") if self._offloads() else self.root_device

    def _fully_shard_arguments(self) -> dict[str, Any]:
        from torch.distributed.fsdp import CPUOffloadPolicy

        kwargs: dict[str, Any] = {"mesh": self.device_mesh, "reshard_after_forward": self.sharding_strategy != "SHARD_GRAD_OP"}
        policy = self.mixed_precision if self.mixed_precision is not None else mixed_precision_policy(self.precision)
        if policy is not None:
            kwargs["mp_policy"] = policy
        if self._offloads():
            kwargs["offload_policy"] = self.cpu_offload if isinstance(self.cpu_offload, CPUOffloadPolicy) else CPUOffloadPolicy()
        kwargs.update(self._fully_shard_kwargs)
        return kwargs

    def __repr__(self) -> str:
        return f"FSDPStrategy(sharding_strategy={self.sharding_strategy!r}, state_dict_type={self._state_dict_type!r})"


def mixed_precision_policy(precision: Any) -> Any:
    """FSDP2's dtypes for a precision plugin: gather and reduce in the low dtype of "16-mixed"/"bf16-mixed"."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(str(getattr(precision, "precision", "")))
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype) if dtype is not None else None


def _parse_sharding_strategy(value: Any) -> str:
    name = getattr(value, "name", value)  # torch's ShardingStrategy enum, or its name
    if not isinstance(name, str) or name.upper() not in SHARDING_STRATEGIES:
        raise ValueError(f"sharding_strategy={value!r} is not supported; accepted: {', '.join(map(repr, SHARDING_STRATEGIES))}")
    return name.upper()


def _check_mesh_request(device_mesh: Any, sharding_strategy: str) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    if device_mesh is None or isinstance(device_mesh, DeviceMesh):
        return device_mesh
    if sharding_strategy != "HYBRID_SHARD":
        raise ValueError(f"device_mesh={device_mesh!r} is for sharding_strategy='HYBRID_SHARD', not {sharding_strategy!r}")
    if (
        not isinstance(device_mesh, tuple)
        or len(device_mesh) != 2
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in device_mesh)
    ):
        raise ValueError(f"device_mesh={device_mesh!r} is not valid; accepted: (replicas, shard size) as two ints >= 1, or a DeviceMesh")
    return device_mesh


def _check_cpu_offload(cpu_offload: Any) -> Any:
    from torch.distributed.fsdp import CPUOffloadPolicy

    if cpu_offload is None or cpu_offload is False:
        return None
    if cpu_offload is True or isinstance(cpu_offload, CPUOffloadPolicy):
        return cpu_offload
    raise TypeError(f"cpu_offload={cpu_offload!r} is not supported; accepted: True, False, None or a CPUOffloadPolicy")


def _check_policy(policy: Any, name: str) -> Any:
    if policy is None or callable(policy):
        return policy
    if isinstance(policy, Iterable) and not isinstance(policy, (str, bytes)):
        classes = set(policy)
        if all(isinstance(c, type) and issubclass(c, Module) for c in classes):
            return classes
    raise TypeError(f"{name}={policy!r} is not supported; accepted: a set of nn.Module classes, or a callable")


def _selected(root: Module, policy: Any, include_root: bool) -> list[Module]:
    """Submodules of ``root`` the policy picks, children before parents (post-order)."""
    chosen: list[Module] = []
    if isinstance(policy, set):
        decide: Callable[[Module, int], bool] = lambda m, _numel: isinstance(m, tuple(policy))  # noqa: E731
    elif _is_fsdp1_policy(policy):
        decide = lambda m, numel: bool(policy(module=m, recurse=False, nonwrapped_numel=numel))  # noqa: E731
    else:
        decide = lambda m, _numel: bool(policy(m))  # noqa: E731

    def visit(module: Module) -> int:
        """Number of parameters under ``module`` not yet in a chosen submodule."""
        numel = sum(p.numel() for p in module.parameters(recurse=False))
        numel += sum(visit(child) for child in module.children())
        if (module is not root or include_root) and decide(module, numel):
            chosen.append(module)
            return 0
        return numel

    visit(root)
    return chosen


def _is_fsdp1_policy(policy: Any) -> bool:
    """An FSDP1 auto-wrap policy function (``module, recurse, nonwrapped_numel``), as Lightning users pass."""
    try:
        parameters = inspect.signature(policy).parameters
    except (TypeError, ValueError):
        return False
    return "recurse" in parameters and "nonwrapped_numel" in parameters


def reduces_gradients_by_summing(torch_version: str, backend: str) -> bool:
    """Whether FSDP must be told to sum gradients and divide itself: gloo has no averaging reduce-scatter, and
    before torch 2.9 ``fully_shard`` asked gloo for one anyway, which then summed (gradients N times too big).
    """
    major, minor = (int(part) for part in torch_version.split("+")[0].split(".")[:2])
    return backend == "gloo" and (major, minor) < (2, 9)
