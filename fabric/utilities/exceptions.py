"""Exception classes Lightning Fabric users catch by name."""

from __future__ import annotations


class MisconfigurationException(Exception):
    """A setting (or a combination of settings) that cannot work; raised where the setting is read."""


class CheckpointMismatchError(KeyError, ValueError, TypeError, RuntimeError):
    """A checkpoint entry does not fit the object it is loaded into (keys, shapes, kinds, optimizer groups,
    the number of processes of a per-rank state). Raised before anything is changed.

    One class for every misfit, in every format. Lightning Fabric and ``Module.load_state_dict`` raise a
    RuntimeError, earlier versions of this package a KeyError, ValueError or TypeError depending on the
    check; deriving from all four keeps ``except`` clauses written for any of them working.
    """

    def __str__(self) -> str:
        # KeyError's str() quotes its argument; this message is a sentence, shown as written
        return str(self.args[0]) if self.args else ""


class InvalidArgumentError(TypeError, ValueError):
    """An argument of the wrong type where Lightning Fabric raises one of TypeError/ValueError and we the other.

    (``devices=1.5``: Lightning raises TypeError, this package ValueError; ``strategy=object()`` the other
    way round.) Deriving from both, it is caught by ``except`` clauses written for either.
    """


class MeshMismatchError(ValueError, RuntimeError):
    """A device mesh whose size does not fit the job's ranks.

    Lightning Fabric raises a RuntimeError here, this package raised a ValueError; deriving from both, it is
    caught by ``except`` clauses written for either.
    """


__all__ = ["CheckpointMismatchError", "InvalidArgumentError", "MeshMismatchError", "MisconfigurationException"]
