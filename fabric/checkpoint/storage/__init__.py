"""Where checkpoints live: the local disk (``disk``: temporary name, fsync, rename) and object stores reached
through fsspec (``object_store``: a generation prefix per save, a commit record written last;
``sharded_store``: a sharded checkpoint staged locally and uploaded as it is written). The only package of the
checkpoint wing that knows what a URL is.
"""

from __future__ import annotations

import os
from pathlib import Path

from fabric.checkpoint.storage.store import Found, Kind, ShardedRead, ShardedSave, Store

__all__ = ["Found", "Kind", "ShardedRead", "ShardedSave", "Store", "locate"]


def locate(path: str | os.PathLike | Store) -> Store:
    """The store a user's checkpoint path names: the local disk, or (a URL) an object store. ``file://`` is the local
    disk; an unknown scheme or a missing storage library stops here with an error that says why."""
    from fabric._core.urls import is_url, local_or_url

    if isinstance(path, Store):
        return path
    location = local_or_url(path)
    if is_url(location):
        from fabric.checkpoint.storage.object_store import ObjectStore

        return ObjectStore(str(location))
    from fabric.checkpoint.storage.disk import DiskStore

    return DiskStore(Path(location))
