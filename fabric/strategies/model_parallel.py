"""Tensor parallelism combined with fully sharded data parallelism, chosen by the user's own function.

The ranks form a 2-D ``DeviceMesh`` (data parallel x tensor parallel). The user's ``parallelize_fn``
gets the module and the mesh and applies ``torch.distributed.tensor.parallel`` plans on the
"tensor_parallel" dimension and ``fully_shard`` on the "data_parallel" dimension, as they see fit.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch.nn import Module
from typing_extensions import override

from fabric.strategies.sharding import ShardedStrategy

MESH_DIMENSIONS = ("data_parallel", "tensor_parallel")


class ModelParallelStrategy(ShardedStrategy):
    """2-D parallelism (Lightning Fabric's arguments): the user's ``parallelize_fn`` shards the model.

    Args:
        parallelize_fn: ``fn(module, device_mesh) -> module`` applying tensor parallelism and/or
            ``fully_shard``; ``device_mesh`` has the dimensions "data_parallel" and "tensor_parallel".
        data_parallel_size: ranks that see different data; "auto" is the number of nodes.
        tensor_parallel_size: ranks that split each layer; "auto" is the number of processes per node.
        save_distributed_checkpoint: save a folder of shards (True) or one full file (False).
        process_group_backend, timeout: as for DDP.
        start_method: "popen" (re-run the script), "spawn", "fork" or "forkserver".
    """

    def __init__(
        self,
        parallelize_fn: Callable[[Module, Any], Module],
        data_parallel_size: int | str = "auto",
        tensor_parallel_size: int | str = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = timedelta(seconds=1800),
        start_method: str = "popen",
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision: Any = None,
    ) -> None:
        super().__init__(
            accelerator, parallel_devices, cluster_environment, checkpoint_io, precision, process_group_backend, timeout, start_method
        )
        if not callable(parallelize_fn):
            raise TypeError(f"parallelize_fn={parallelize_fn!r} must be a function (module, device_mesh) -> module")
        for name, size in (("data_parallel_size", data_parallel_size), ("tensor_parallel_size", tensor_parallel_size)):
            if size != "auto" and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
                raise ValueError(f"{name}={size!r} is not valid; accepted: 'auto' or an int >= 1")
        self._parallelize_fn = parallelize_fn
        self._data_parallel_size = data_parallel_size
        self._tensor_parallel_size = tensor_parallel_size
        self._save_distributed_checkpoint = save_distributed_checkpoint
        self._full_checkpoints = not save_distributed_checkpoint

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Ranks of one tensor-parallel group read the same batches: shard data over the data-parallel dimension."""
        mesh = self.device_mesh["data_parallel"]
        return {"num_replicas": mesh.size(), "rank": mesh.get_local_rank()}

    @override
    def _build_device_mesh(self) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        data = self.num_nodes if self._data_parallel_size == "auto" else self._data_parallel_size
        tensor = self.num_processes if self._tensor_parallel_size == "auto" else self._tensor_parallel_size
        if self._data_parallel_size == "auto" and self._tensor_parallel_size != "auto":
            data = self.world_size // int(tensor)
        elif self._tensor_parallel_size == "auto" and self._data_parallel_size != "auto":
            tensor = self.world_size // int(data)
        if int(data) * int(tensor) != self.world_size:
            from fabric.utilities.exceptions import MeshMismatchError

            raise MeshMismatchError(
                f"data_parallel_size={self._data_parallel_size!r} and tensor_parallel_size={self._tensor_parallel_size!r}"
                f" make a {data} x {tensor} mesh, but the job has {self.world_size} ranks; their product must equal it"
            )
        return init_device_mesh(self.root_device.type, (int(data), int(tensor)), mesh_dim_names=MESH_DIMENSIONS)

    @override
    def _shard(self, module: Module) -> Module:
        result = self._parallelize_fn(module, self.device_mesh)
        if not isinstance(result, Module):
            raise TypeError(f"parallelize_fn must return the nn.Module it parallelized, but returned {type(result).__name__}")
        return result

    def __repr__(self) -> str:
        return f"ModelParallelStrategy(data_parallel_size={self._data_parallel_size!r}, tensor_parallel_size={self._tensor_parallel_size!r})"
