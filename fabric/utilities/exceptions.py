"""Exception classes Lightning Fabric users catch by name."""

from __future__ import annotations

from fabric.checkpoint.errors import CheckpointMismatchError  # its home; importable from here as before


class MisconfigurationException(Exception):
    """A setting (or a combination of settings) that cannot work; raised where the setting is read."""


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
