"""Every checkpoint error, in one home: one ``except CheckpointLoadError`` catches every refused load, whatever the
format and wherever the checkpoint lies, and the same damage raises the same class on the disk and on a store (the
table: docs/checkpoints.md). The classes keep the bases that code written for Lightning Fabric catches. Standard
library only, so every layer can import it.
"""

from __future__ import annotations

import pickle

__all__ = [
    "CheckpointLoadError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointPathError",
    "CommitRecordError",
    "ConcurrentSaveError",
    "CorruptCheckpointError",
    "UnsafeCheckpointError",
]


class CheckpointLoadError(RuntimeError):
    """A checkpoint cannot be loaded (missing, damaged, unsafe, uncommitted or not fitting): the base of them all."""


class CheckpointNotFoundError(CheckpointLoadError, FileNotFoundError):
    """Nothing is saved at the checkpoint's path or URL (also the FileNotFoundError Lightning Fabric raises)."""


class CheckpointPathError(CheckpointLoadError, ValueError):
    """The checkpoint's path names something no checkpoint is read from: a FIFO, a device, a socket, a loop of links."""


class UnsafeCheckpointError(CheckpointLoadError, pickle.UnpicklingError):
    """A checkpoint holds objects that only pickled code can restore, refused under ``weights_only``."""

    # Also a pickle.UnpicklingError: what torch.load(weights_only=True), and so Lightning Fabric's load, raises
    # there, so code that catches it to retry with weights_only=False works unchanged.


class CorruptCheckpointError(CheckpointLoadError):
    """The bytes of a checkpoint are not those its save wrote: flipped, cut short, grown, missing or another save's."""


class CommitRecordError(CheckpointLoadError):
    """A URL holds no commit record a load can go by: none, another program's object, or a record of another kind."""


class CheckpointMismatchError(KeyError, ValueError, TypeError, CheckpointLoadError):
    """A checkpoint entry does not fit the object it is loaded into; raised before anything is changed."""

    # One class for every misfit, in every format. Lightning Fabric and Module.load_state_dict raise a RuntimeError,
    # earlier versions of this package a KeyError, ValueError or TypeError depending on the check: deriving from all
    # four keeps except clauses written for any of them working.

    def __str__(self) -> str:
        # KeyError's str() quotes its argument; this message is a sentence, shown as written
        return str(self.args[0]) if self.args else ""


class ConcurrentSaveError(OSError):
    """A save to a URL lost to another writer of it, which removed its objects before its commit (the other's stays)."""


def is_pickling_error(err: BaseException) -> bool:
    """Whether ``err`` is ``torch.save`` meeting an object pickle cannot handle (a lock, a lambda, an open file):
    the state's fault, whichever store the checkpoint was going to."""
    return isinstance(err, pickle.PicklingError) or (isinstance(err, (TypeError, AttributeError)) and "pickle" in str(err))
