"""Loading a large checkpoint lazily: ``_lazy_load(path)`` reads no tensor's bytes until the tensor is used.

The names are Lightning Fabric's (``lightning.fabric.utilities.load``), which applications built on it import (litgpt
loads its models with ``lazy_load(path)`` and converts checkpoints tensor by tensor). The mechanism is torch's
own: ``torch.load(mmap=True)`` maps the file into memory and builds every tensor on the mapping, so a tensor's
pages are read from disk only when something touches them (copying it into a model's parameter, for example),
and the kernel can drop them again, as they are the file's. A model never needs the checkpoint's size twice.

Unlike ``fabric.load``, nothing here reads the whole file, so the CRC-32 of its records is not checked; and, as
everywhere in fabric, the file is unpickled with ``weights_only=True`` unless the caller says otherwise.
"""

from __future__ import annotations

import os
import pickle
from collections import OrderedDict
from typing import Any

import torch

from fabric.utilities.types import _PATH


class _NotYetLoadedTensor:
    """The name of Lightning's placeholder for a tensor not read yet, kept for code that imports it.

    Lightning's lazy loader returns such placeholders (not tensors: ``_load_tensor()`` reads one). Ours returns real
    ``torch.Tensor``s whose memory is the file's map, so every torch function, ``nn.Parameter(t)`` and
    ``load_state_dict(..., assign=True)`` work on them, and no value is ever of this class: annotations naming it
    still work, and ``isinstance(t, _NotYetLoadedTensor)`` / ``hasattr(t, "_load_tensor")`` are false, so code that
    reads a placeholder before use takes its branch for tensors already loaded.
    """


class _LazyCheckpoint:
    """The checkpoint's top-level dict is also a context manager: leaving the ``with`` block empties it, so the
    memory map is released as soon as no tensor of it is kept elsewhere (the tensors a model took over stay valid).
    Pickled or saved, it is an OrderedDict again (what ``torch.load(weights_only=True)`` reads; a plain dict's
    subclass can only be pickled through a class it refuses).
    """

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.clear()  # type: ignore[attr-defined]

    def __reduce__(self) -> Any:
        state = vars(self) or None
        return OrderedDict, (), state, None, iter(self.items())  # type: ignore[attr-defined]


class _LazyDict(_LazyCheckpoint, dict):
    pass


class _LazyOrderedDict(_LazyCheckpoint, OrderedDict):
    pass


def _lazy_load(filename: _PATH, *, weights_only: bool = True) -> Any:
    """What ``torch.save`` wrote to ``filename``, its tensors read from disk only when used.

    Every tensor is a CPU tensor on the file's memory map: its bytes are read when it is first used, and a copy
    (``model.load_state_dict``, ``.to(dtype)``, ``.clone()``) is what takes memory of its own. A dict comes back as
    a dict (with the attributes ``torch.save`` kept, such as a state dict's ``_metadata``) that may also be used as
    ``with _lazy_load(path) as state: model.load_state_dict(state)``. The file must be in torch's zip format (the
    default of ``torch.save`` since torch 1.6). ``weights_only=False`` lets it restore pickled objects (only for
    files you trust: unpickling can run code).
    """
    if not os.path.isfile(filename):
        raise FileNotFoundError(f"Path {str(filename)!r} does not exist or is not a file.")
    try:
        loaded = torch.load(filename, mmap=True, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as error:
        if not weights_only:
            raise
        lines = str(error).splitlines()
        reason = next((line.split("error:", 1)[1].strip() for line in lines if "WeightsUnpickler error:" in line), lines[0] if lines else "")
        raise pickle.UnpicklingError(
            f"{str(filename)!r} holds objects that only pickled code can restore, which is refused by default; if you"
            f" trust the file, pass weights_only=False. ({reason})"
        ) from error
    except RuntimeError as error:
        if "mmap can only be used" not in str(error):
            raise
        raise RuntimeError(
            f"{str(filename)!r} cannot be loaded lazily: it is no checkpoint in torch's zip format (a file saved with"
            " _use_new_zipfile_serialization=False or by torch < 1.6 can be read whole with torch.load)"
        ) from error
    if type(loaded) is dict:
        return _LazyDict(loaded)
    if type(loaded) is OrderedDict:
        lazy = _LazyOrderedDict(loaded)
        lazy.__dict__.update(vars(loaded))  # a state dict's _metadata
        return lazy
    return loaded


__all__: list[str] = []
