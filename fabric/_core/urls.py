"""Which of a user's paths are URLs, and the fsspec filesystem a URL names: the one rule, standard library only.

A string with a scheme (``s3://bucket/x``, ``memory://x``, ``simplecache::s3://...``) is a URL and never a
local path; ``file://`` is the local disk. Resolving a URL imports fsspec (and its storage library) on
first use only; an unknown scheme or a missing library stops with an error naming the URL (credentials
stripped) and the extra of fabric-torch that installs the library. Checkpoints on URLs:
``fabric.checkpoint.storage``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)(::[A-Za-z][A-Za-z0-9+.\-]*)*://")

# scheme -> (the module fsspec needs for it, the extra of fabric-torch that installs it)
_LIBRARIES = {
    "s3": ("s3fs", "s3"),
    "s3a": ("s3fs", "s3"),
    "gs": ("gcsfs", "gcs"),
    "gcs": ("gcsfs", "gcs"),
    "az": ("adlfs", "azure"),
    "abfs": ("adlfs", "azure"),
    "abfss": ("adlfs", "azure"),
    "adl": ("adlfs", "azure"),
}


class MissingStorageLibraryError(ImportError):
    """A URL whose storage library (fsspec, s3fs, ...) is not installed."""


def scheme_of(path: Any) -> str | None:
    """The (first) scheme of ``path`` if it is a string with one, lower case; else None."""
    if not isinstance(path, str):
        return None
    match = _SCHEME.match(path)
    return match.group(1).lower() if match else None


def is_url(path: Any) -> bool:
    """Whether ``path`` names a store reached through fsspec (a string with a scheme other than ``file``)."""
    scheme = scheme_of(path)
    return scheme is not None and scheme != "file"


def local_or_url(path: str | os.PathLike) -> str | Path:
    """The user's ``path`` made safe to use: a URL stays a string (checked: its filesystem can be reached,
    else the error says why), ``file://...`` becomes the local path, anything else is returned unchanged."""
    if isinstance(path, str):
        scheme = scheme_of(path)
        if scheme == "file":
            return path[len("file://") :] or "/"
        if scheme is not None:
            filesystem(path)
    # anything that is no path at all goes on unchanged, for the checkpoint code to refuse it by name
    return Path(os.fspath(path)) if isinstance(path, os.PathLike) and not isinstance(path, Path) else path


def redact(url: str) -> str:
    """``url`` without credentials: the password of ``user:password@`` and the query (signed URLs carry tokens there)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url.split("?", 1)[0]
    netloc = parts.netloc
    if "@" in netloc:
        user, host = netloc.rsplit("@", 1)
        netloc = f"{user.split(':', 1)[0]}:***@{host}" if ":" in user else f"{user}@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, "***" if parts.query else "", parts.fragment))


def filesystem(url: str) -> tuple[Any, str]:
    """(the fsspec filesystem, the path on it) for ``url``; a clear error if it cannot be reached."""
    scheme = scheme_of(url) or ""
    module, extra = _LIBRARIES.get(scheme, ("fsspec", "fsspec"))
    try:
        import fsspec
        from fsspec.core import url_to_fs
    except ImportError:
        raise MissingStorageLibraryError(
            f"{redact(url)!r} is a URL; reading and writing URLs needs fsspec, which is not installed:"
            f" pip install 'fabric-torch[{extra}]'"
        ) from None
    known = set(fsspec.available_protocols())
    for protocol in _protocols(url):
        if protocol not in known:
            raise ValueError(
                f"{redact(url)!r}: unknown storage scheme {protocol + '://'!r} (not a local path either). Accepted:"
                " a local path, file://, or a scheme fsspec knows, e.g. s3://, gs://, az://, memory://"
            )
        try:
            fsspec.get_filesystem_class(protocol)
        except ImportError:
            module, extra = _LIBRARIES.get(protocol, (protocol, protocol))
            raise MissingStorageLibraryError(
                f"{redact(url)!r} needs the storage library for {protocol}:// ({module}), which is not installed:"
                f" pip install 'fabric-torch[{extra}]'"
            ) from None
    fs, path = url_to_fs(url)
    return fs, path


def _protocols(url: str) -> list[str]:
    head = url.split("://", 1)[0]
    return [part.lower() for part in head.split("::") if part]
