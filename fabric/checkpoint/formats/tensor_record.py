"""Reading a saved tensor's bytes straight into a tensor of ours, without ``torch.load``.

Every item of a shard file is a ``torch.save`` archive of one tensor: a small pickle and one record of the
storage's bytes, which ``torch.load`` reads into storage of its own, so a load into new storage of ours would
hold the state twice, and a resumed job's fresh optimizer state would be allocated, then thrown away. The
pickle is read by an unpickler that builds no tensor; anything else (another layout) is left to ``torch.load``.
"""

from __future__ import annotations

import ctypes
import functools
import io
import pickle
import warnings
from collections import OrderedDict
from typing import Any, NamedTuple

import torch
from torch import Tensor

from fabric.checkpoint.integrity import CheckedArchive

__all__ = ["read_into"]


class _Storage(NamedTuple):
    dtype: torch.dtype
    numel: int


class _Layout(NamedTuple):
    storage: _Storage
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _NotPlain(Exception):
    """The pickle is not one plain tensor: ``torch.load`` reads it."""


@functools.cache
def _storage_dtypes() -> dict[str, torch.dtype]:
    """Legacy storage class name (what ``torch.save`` pickles) -> dtype, e.g. ``FloatStorage`` -> float32."""
    found = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reading a legacy storage class's dtype warns that the class is deprecated
        for name in [name for name in dir(torch) if name.endswith("Storage")]:
            value = getattr(torch, name)
            if isinstance(value, type) and issubclass(value, torch.storage.TypedStorage):
                dtype = getattr(value, "dtype", None)
                if isinstance(dtype, torch.dtype):
                    found[name] = dtype
    return found


def _rebuild(storage: Any, offset: int, size: Any, stride: Any, requires_grad: Any, hooks: Any, metadata: Any = None) -> _Layout:
    if not isinstance(storage, _Storage) or requires_grad is not False or hooks or metadata:
        raise _NotPlain
    return _Layout(storage, int(offset), tuple(size), tuple(stride))


class _LayoutUnpickler(pickle.Unpickler):
    """Reads the pickle of a one-tensor archive into a :class:`_Layout`; refuses every other name."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name in _storage_dtypes():
            return _storage_dtypes()[name]
        raise _NotPlain

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], torch.dtype) and pid[2] == "0"):
            raise _NotPlain
        _, dtype, _, _, numel = pid
        return _Storage(dtype, int(numel))


def read_into(archive: CheckedArchive, destination: Tensor) -> bool:
    """Read the one tensor that ``archive`` holds straight into ``destination`` (a CPU tensor of new storage, whose
    bytes may be overwritten whatever the outcome), every record checked, and return True; False, nothing read
    into it, where the saved layout differs from the destination's or the pickle is not one plain tensor's."""
    if destination.device.type != "cpu" or not destination.is_contiguous():
        return False
    names = archive.names()
    pickles = [name for name in names if name.endswith("/data.pkl")]
    data = [name for name in names if "/data/" in name]
    byteorder = [name for name in names if name.endswith("/byteorder")]
    if len(pickles) != 1 or data != [pickles[0][: -len("data.pkl")] + "data/0"] or len(byteorder) > 1:
        return False
    if byteorder and archive.read_record(byteorder[0]) != b"little":
        return False
    try:
        layout = _LayoutUnpickler(io.BytesIO(archive.read_record(pickles[0]))).load()
    except (_NotPlain, pickle.UnpicklingError, EOFError, ValueError, TypeError):
        return False
    if not isinstance(layout, _Layout):
        return False
    nbytes = destination.numel() * destination.element_size()
    if (
        layout.storage.dtype != destination.dtype
        or layout.offset != 0
        or layout.size != tuple(destination.shape)
        or layout.stride != tuple(destination.stride())
        or layout.storage.numel != destination.numel()
        or archive.record_size(data[0]) != nbytes
    ):
        return False
    if nbytes:
        archive.read_record_into(data[0], (ctypes.c_ubyte * nbytes).from_address(destination.data_ptr()))
    archive.finish()
    return True

