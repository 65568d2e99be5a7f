"""Every checkpoint error, in one home: one ``except CheckpointLoadError`` catches every refused load, whatever the
format and wherever the checkpoint lies (the same damage raises the same class on the disk and on a store). The classes
keep the bases that code written for Lightning Fabric catches. Standard library only, so every layer can import it.
"""

from __future__ import annotations

import pickle

__all__ = [
    "CheckpointLoadError",
    "CheckpointMismatchError",
    "CommitRecordError",
    "CorruptCheckpointError",
    "UnsafeCheckpointError",
]


class CheckpointLoadError(RuntimeError):
    """A checkpoint cannot be loaded (empty, truncated, corrupt, unsafe, uncommitted or not fitting): the base of them all."""


class UnsafeCheckpointError(CheckpointLoadError, pickle.UnpicklingError):
    """A checkpoint holds objects that only pickled code can restore, refused under ``weights_only``."""

    # Also a pickle.UnpicklingError: what torch.load(weights_only=True), and so Lightning Fabric's load, raises
    # there, so code that catches it to retry with weights_only=False works unchanged.


class CorruptCheckpointError(CheckpointLoadError):
    """Bytes of a checkpoint differ from what was written (a CRC mismatch, a truncated or unreadable record)."""


class CommitRecordError(CheckpointLoadError):
    """A checkpoint on a store whose commit record is missing, unreadable, or does not match its objects."""


class CheckpointMismatchError(KeyError, ValueError, TypeError, CheckpointLoadError):
    """A checkpoint entry does not fit the object it is loaded into; raised before anything is changed."""

    # One class for every misfit, in every format. Lightning Fabric and Module.load_state_dict raise a RuntimeError,
    # earlier versions of this package a KeyError, ValueError or TypeError depending on the check: deriving from all
    # four keeps except clauses written for any of them working.

    def __str__(self) -> str:
        # KeyError's str() quotes its argument; this message is a sentence, shown as written
        return str(self.args[0]) if self.args else ""


def is_pickling_error(err: BaseException) -> bool:
    """Whether ``err`` is ``torch.save`` meeting an object pickle cannot handle (a lock, a lambda, an open file):
    the state's fault, whichever store the checkpoint was going to."""
    return isinstance(err, pickle.PicklingError) or (isinstance(err, (TypeError, AttributeError)) and "pickle" in str(err))
