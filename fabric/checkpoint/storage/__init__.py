"""Where checkpoints live: the local disk (``disk``) and object stores reached through fsspec (``object_store``,
``sharded_store``). The only package of the checkpoint wing that knows what a URL is; it moves bytes and reports
facts (what a location holds, sizes, checksums), and imports no format: what the bytes are is ``formats``'s.
"""

from __future__ import annotations

import os
from pathlib import Path

from fabric.checkpoint.storage.store import Fetch, Found, Kind, ShardedRead, ShardedSave, Store

__all__ = ["Fetch", "Found", "Kind", "ShardedRead", "ShardedSave", "Store", "locate"]


def locate(path: str | os.PathLike | Store, writing: str | None = None) -> Store:
    """The store a user's checkpoint path names: the local disk, or (a URL) an object store. ``file://`` is the local
    disk; an empty path, a URL naming no place (``s3://``), an unknown scheme, a missing storage library and, when
    ``writing`` (what for: "save a checkpoint"), a read-only store (``https://``) stop here with an error that says why."""
    from fabric._core.urls import check_writable, is_url, local_or_url

    if isinstance(path, Store):
        return path
    if isinstance(path, str) and not path:
        raise ValueError("The checkpoint path is empty. Accepted: a file or folder path, or a URL such as s3://bucket/run/ckpt.pt")
    if writing is not None and is_url(path):
        check_writable(str(path), writing)
    location = local_or_url(path)
    if is_url(location):
        from fabric.checkpoint.storage.object_store import ObjectStore

        return ObjectStore(str(location))
    from fabric.checkpoint.storage.disk import DiskStore

    return DiskStore(Path(location))
