"""The process group's lifetime: joined so that it can be freed, left so that it is.

A gloo group runs worker threads. If the group outlives the interpreter's shutdown, a worker that lets
go of a finished collective's tensor needs the GIL and aborts the process ("terminate called without an
active exception", exit 134, after a successful run). So the group must really be freed when it is
left: nothing may keep holding it.
"""

from __future__ import annotations

import gc
import os
import time
import weakref
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "bind_default_arguments_before_the_group_exists",
    "leave_process_group",
    "leave_process_group_at_exit",
    "track_ddp_module",
    "track_device_mesh",
    "wait_until_every_rank_has_joined",
]


def bind_default_arguments_before_the_group_exists() -> None:
    """Import ``torch.distributed.nn.functional`` now, while no process group exists.

    Its functions take ``group=group.WORLD`` as a default argument, evaluated once at import. DDP imports
    it; imported after ``init_process_group`` it pins the default group for the life of the process, so
    ``destroy_process_group`` cannot free it and gloo's worker threads run on into interpreter shutdown,
    where one that lets go of a finished collective's tensor needs the GIL and aborts the process
    ("terminate called without an active exception", exit 134, after a successful run).
    """
    import torch.distributed.nn.functional  # noqa: F401


def wait_until_every_rank_has_joined() -> None:
    """Return only once every rank's ``init_process_group`` has returned (gloo groups; others: at once).

    A rank's ``init_process_group`` can return before its peers' has: of each pair of gloo ranks one
    connects and writes its identifier, and it is done once that sits in its socket, before the peer's
    process has even accepted the connection. A rank that leaves the group right away (a script that ends
    after ``launch()``: the exit hook leaves at once) closes that connection and, on rank 0, the store
    the others still read, and a slower peer's ``init_process_group`` fails ("Gloo connectFullMesh
    failed ... Connection closed by peer", or the store's "Failed to recv"). A barrier after joining
    costs one round trip and keeps every rank until all have joined. NCCL connects at the first
    collective, so it has no such race and no eager connection is forced on it; a "cpu:gloo,cuda:nccl"
    group's barrier runs on its gloo part.
    """
    if "gloo" not in str(dist.get_backend()):
        return
    dist.barrier()


# Every DDP module set up in this process, so that leaving the group can make them let go of it.
_DDP_MODULES: weakref.WeakSet[DistributedDataParallel] = weakref.WeakSet()
# Every device mesh set up in this process (roots), so that leaving the group can make them let go of it.
_DEVICE_MESHES: weakref.WeakSet[DeviceMesh] = weakref.WeakSet()
# What a DDP module holds the process group by (its C++ reducer and logger hold it too).
_GROUP_HOLDERS = ("reducer", "logger", "process_group")
# Seconds a still-running group's worker threads get at exit to finish letting go of collectives' tensors.
_LATE_RELEASE_S = 0.05


def track_device_mesh(mesh: DeviceMesh) -> None:
    """Remember a device mesh set up here (its root): it lets go of its groups when the group is left."""
    root = getattr(mesh, "_root_mesh", None) or mesh
    _DEVICE_MESHES.add(root)


def track_ddp_module(ddp: DistributedDataParallel) -> None:
    """Remember a DDP module set up here: it is made to let go of the group when the group is left."""
    _DDP_MODULES.add(ddp)


def leave_process_group() -> None:
    """Destroy the process group so that it is freed, and gloo's threads with it.

    The group is freed only once nothing holds it. A DDP module the script still refers to (a
    module-level ``model``) would; without the group it cannot communicate anyway, so it drops its
    reducer and its reference to the group first. So do the device meshes and what ``fully_shard``
    built from them (see :func:`_let_torch_objects_go_of`).
    """
    if not dist.is_initialized():
        return
    for ddp in list(_DDP_MODULES):
        for name in _GROUP_HOLDERS:
            ddp.__dict__.pop(name, None)
    _DDP_MODULES.clear()
    groups = _groups_of_tracked_meshes()
    dist.destroy_process_group()
    if groups:
        _let_torch_objects_go_of(groups)


def _groups_of_tracked_meshes() -> list[dist.ProcessGroup]:
    """The default group and every group of the meshes set up here (before they are destroyed)."""
    if not _DEVICE_MESHES:
        return []
    groups = [dist.group.WORLD]
    for mesh in list(_DEVICE_MESHES):
        groups.extend(mesh.get_all_groups())
    return [group for group in groups if group is not None]


def _let_torch_objects_go_of(groups: list[dist.ProcessGroup]) -> None:
    """Make torch's own objects let go of the (now destroyed) groups they would otherwise keep for good.

    DTensor's sharding caches keep every ``DeviceMesh`` they saw (a sharded model's specs) for the life
    of the process, and a mesh keeps its groups in a registry of its own; ``fully_shard`` keeps groups
    in the mesh information of a model the script may still hold (a module-level ``model``). None of
    these can communicate once the groups are destroyed, so letting go takes nothing from them.
    """
    for mesh in list(_DEVICE_MESHES):
        registry = getattr(mesh, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()  # a sub-mesh's groups live in its root's registry: a tracked mesh is a root
    _DEVICE_MESHES.clear()
    if not _process_group_threads_alive():
        return
    for holder in gc.get_referrers(*groups):  # one pass over the objects the collector tracks
        if type(holder).__module__.startswith("torch.distributed.") and isinstance(getattr(holder, "__dict__", None), dict):
            attributes = holder.__dict__
            for name in [name for name, value in attributes.items() if any(value is group for group in groups)]:
                del attributes[name]


def leave_process_group_at_exit() -> None:
    """Leave the group while the interpreter is whole, so that gloo's threads are joined before shutdown.

    Should something still hold a group after that, its threads live on: give them a moment with the GIL
    released, so that one still letting go of a just-finished collective's tensors does it now rather
    than during shutdown.
    """
    try:
        leave_process_group()
        if _process_group_threads_alive():
            time.sleep(_LATE_RELEASE_S)
    except Exception:  # never let exit fail over it; the process is going away anyway
        pass


_PROCESS_GROUP_THREAD_NAMES = ("pt_gloo", "pt_tcpstore")


def _process_group_threads_alive() -> bool:
    """Whether a thread of torch's process group (gloo's workers, the TCPStore's loop) still runs.

    Linux names them ("pt_gloo...", "pt_tcpstore..."); elsewhere: assume so. On torch 2.9/2.10 an FSDP job's
    store thread outlives the group by a moment, so it counts too.
    """
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return True
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                if comm.read().startswith(_PROCESS_GROUP_THREAD_NAMES):
                    return True
        except OSError:  # that thread ended meanwhile
            continue
    return False
