"""Which of a user's paths are URLs, and the fsspec filesystem a URL names: the one rule, standard library only.

A string with a scheme (``s3://bucket/x``, ``memory://x``, ``simplecache::s3://...``) is a URL and never a
local path; ``file://`` is the local disk. Resolving a URL imports fsspec (and its storage library) on
first use only; an unknown scheme or a missing library stops with an error naming the URL (credentials
stripped) and the extra of fabric-torch that installs the library. Checkpoints on URLs:
``fabric.checkpoint.storage``.

No text we make or pass on shows a URL's credentials (a password in it, its query): messages name the URL
``redact``-ed; a storage library's error is re-raised as ours (``storage_error``) chained only to a copy without
them (``without_secrets``); and the filesystem of a URL that holds any cleans every error its calls raise. A URL
with a query or a fragment is refused before its store is used (``check_no_query``): both would become part of
the names of the objects written.

Every call to a store has a bound: on an asynchronous filesystem (s3fs, gcsfs, adlfs, http: the object stores) each
call, and each upload of a file it opened for writing, runs on fsspec's event loop for at most :func:`store_timeout`
seconds (``FABRIC_STORE_TIMEOUT``, else ``STORE_TIMEOUT_S``); then the request is cancelled there and
``StoreTimeoutError`` raised here, so a store that stops answering is an error, not a hang.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fabric._core.extras import install_hint

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


#: How long one call to a store may go unanswered, in seconds: one request with the storage library's own retries (a
#: read of up to 32 MB, an upload part: 50 MB with s3fs, a listing, a removal). The environment variable
#: ``FABRIC_STORE_TIMEOUT`` takes precedence.
STORE_TIMEOUT_S: float = 60.0
STORE_TIMEOUT_ENV = "FABRIC_STORE_TIMEOUT"


class StoreTimeoutError(TimeoutError):
    """A call to a store got no answer within :func:`store_timeout` seconds (its request was cancelled)."""


def store_timeout() -> float:
    """The bound of one call to a store, in seconds: ``FABRIC_STORE_TIMEOUT`` if set, else ``STORE_TIMEOUT_S``."""
    raw = os.environ.get(STORE_TIMEOUT_ENV, "").strip()
    value, name = (raw, STORE_TIMEOUT_ENV) if raw else (STORE_TIMEOUT_S, "fabric._core.urls.STORE_TIMEOUT_S")
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"{name}={value!r} is not valid; accepted: a number of seconds > 0, e.g. 60")
    return seconds


def unreachable(err: BaseException) -> bool:
    """Whether ``err``, or an error it was raised from or while handling, says the store could not be reached: no
    answer within the bound, a timeout, a refused, reset or dropped connection (built-in classes, and a storage
    library's whose name says Timeout or Connection: botocore's, aiohttp's). A clean-up after such an error would
    only wait again, so none is made: what a failed save left is removed by the next save."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (TimeoutError, ConnectionError)) or any(
            "Timeout" in cls.__name__ or "Connection" in cls.__name__ for cls in type(current).__mro__
        ):
            return True
        current = current.__cause__ or current.__context__
    return False


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
    """``url`` as messages show it: the password of every ``user:password@`` (in each URL of a chain such as
    ``simplecache::s3://...``, and also one holding a ``/``, as AWS secret keys do) and the query (signed URLs
    carry tokens there) become ``***``. The user name stays (an Azure URL's ``container@account`` is no secret);
    everything else is kept as written."""
    return _split_secrets(url)[0]


def secrets_of(url: str) -> list[str]:
    """What of ``url`` no text we make may show: each password and the query with its values, as written,
    %-decoded and %-encoded, and the pieces of a password with a ``/`` (a library that takes the URL's
    ``user:pass`` for a bucket stops it at the first ``/``); longest first, so a secret holding another is
    replaced whole. Pieces and values under 4 characters are no tokens: replacing them would garble messages."""
    from urllib.parse import parse_qsl, quote, unquote

    found: set[str] = set()
    for secret in _split_secrets(url)[1]:
        found.add(secret)
        found.update(piece for piece in secret.split("/") if len(piece) >= 4)
        if "=" in secret:  # a query: its values may also be shown alone
            found.update(value for _, value in parse_qsl(secret, keep_blank_values=True) if len(value) >= 4)
    for secret in list(found):
        found.update((unquote(secret), quote(secret, safe="")))
    return sorted((secret for secret in found if secret), key=len, reverse=True)


def scrub(text: str, url: str) -> str:
    """``text`` (a storage library's message, which may repeat ``url`` or a part of it: a bucket name, a key) with
    every secret of ``url`` replaced by ``***``."""
    for secret in secrets_of(url):
        text = text.replace(secret, "***")
    return text


def _split_secrets(url: str) -> tuple[str, list[str]]:
    """(``url`` redacted, the passwords and the query it holds)."""
    shown, secrets = [], []
    for segment in url.split("::"):
        scheme, separator, rest = segment.partition("://")
        if not separator:
            shown.append(segment)
            continue
        user, colon, password = rest.partition("@")[0].partition(":") if "@" in rest else ("", "", "")
        credentials = ""
        if colon and not any(mark in user for mark in "/?#"):  # user:password@ (the password may hold a /)
            credentials, rest = f"{user}:***@", rest[len(user) + len(password) + 2 :]
            secrets.append(password)
        path, _, query = rest.partition("?")
        query, hash_mark, fragment = query.partition("#")
        if query:
            rest = f"{path}?***{hash_mark}{fragment}"
            secrets.append(query)
        shown.append(f"{scheme}://{credentials}{rest}")
    return "::".join(shown), secrets


def error_summary(err: BaseException, url: str = "") -> str:
    """The first line of ``err``'s message (and the next, when the first only announces it, as botocore's
    "Parameter validation failed:" does), without the secrets of ``url``."""
    lines = [line.strip() for line in scrub(str(err), url).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    return f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]


def without_secrets(err: BaseException, url: str) -> BaseException:
    """``err`` itself when nothing a traceback prints of it (its chained causes included) or its ``repr`` shows a
    secret of ``url``; else a copy of it with its message scrubbed and no chain, shown under the same class name
    (a library's error class may not take a bare message, so the copy's class derives from the nearest built-in
    one: ``except OSError`` and ``except FileNotFoundError`` catch the copy as they catch ``err``)."""
    import traceback

    hidden = secrets_of(url)
    if not hidden:
        return err
    text = "".join(traceback.format_exception(err)) + repr(err)
    if not any(secret in text for secret in hidden):
        return err
    message = scrub(str(err), url)
    try:
        copy = _stand_in(type(err))(message)
    except Exception:  # a built-in class with other arguments (UnicodeDecodeError)
        copy = RuntimeError(f"{type(err).__name__}: {message}")
    if isinstance(err, OSError) and isinstance(copy, OSError):
        copy.errno = err.errno
    return copy


_STAND_INS: dict[type[BaseException], type[BaseException]] = {}


def _stand_in(cls: type[BaseException]) -> type[BaseException]:
    """``cls`` if it is built in; else a class of the same name and module deriving from ``cls``'s nearest built-in base."""
    if cls.__module__ == "builtins":
        return cls
    if cls not in _STAND_INS:
        base = next(base for base in cls.__mro__ if base.__module__ == "builtins")
        doc = f"A copy of a {cls.__qualname__} whose message no longer shows a URL's credentials."
        _STAND_INS[cls] = type(cls.__name__, (base,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": doc})
    return _STAND_INS[cls]


def storage_error(what: str, url: str, err: BaseException) -> OSError:
    """Our error for a storage library's ``err``: ``what`` (e.g. "Could not read the checkpoint 's3://...'", the URL
    redacted) and the library's message without the secrets of ``url``; of ``err``'s built-in OSError class
    (FileNotFoundError, PermissionError, ConnectionError, ...), else an OSError. Raise it
    ``from without_secrets(err, url)``: the library's own text is never chained unscrubbed."""
    cls = next((base for base in type(err).__mro__ if base.__module__ == "builtins" and issubclass(base, OSError)), OSError)
    error = cls(f"{what}: {type(err).__name__}: {error_summary(err, url)}")
    if isinstance(err, OSError):
        error.errno = err.errno
    return error



@contextmanager
def store_errors(doing: str, url: str, passing: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """A storage library's error in the block re-raised as ours (:func:`storage_error`: "Could not ``doing`` URL", the
    URL redacted), chained only to a copy without ``url``'s secrets; errors of the classes ``passing`` pass (ours, or a
    missing file the caller takes for "none")."""
    try:
        yield
    except passing:
        raise
    except Exception as err:
        raise storage_error(f"Could not {doing} {redact(url)!r}", url, err) from without_secrets(err, url)


def check_place(url: str) -> None:
    """A URL must name a place on its store: ``s3://`` or ``memory://`` alone names none (nor a chain ending so)."""
    path = url.rsplit("::", 1)[-1].partition("://")[2]
    if "@" in path.partition("/")[0]:
        path = path.partition("@")[2]
    if not path.split("?", 1)[0].split("#", 1)[0].strip("/"):
        raise ValueError(
            f"{redact(url)!r} names a store but no place on it. Accepted: a local path, or a URL with a bucket or folder"
            " after '://', e.g. s3://bucket/run/ckpt.pt, gs://bucket/logs, memory://run/ckpt.pt"
        )


def check_no_query(url: str) -> None:
    """A checkpoint's or a log's URL names its objects by its path: a query (``?...``, where a signed URL carries its
    token) or a fragment (``#...``) would become part of every object's name, readable by whoever can list the store.
    Refused by name, the query redacted."""
    shown = redact(url)  # a password holding "?" or "#" is no query: redacted, it is "***"
    if "?" in shown or "#" in shown:
        raise ValueError(
            f"{shown!r} has a {'query (?...)' if '?' in shown else 'fragment (#...)'}, which would become part of the name"
            " of every object written, readable by whoever can list the store (a signed URL's token with it)."
            " Accepted: a URL without '?' or '#', e.g. s3://bucket/run/ckpt.pt; the storage library takes credentials"
            " from its usual sources (environment variables, its config files)"
        )


# schemes fsspec can only read from
_READ_ONLY = ("http", "https", "github", "gist", "git", "tar", "libarchive", "data", "reference")


def check_writable(url: str, doing: str) -> None:
    """``doing`` (e.g. "save a checkpoint") needs a store that can be written: an http(s):// URL and other read-only
    fsspec schemes are refused, naming the URL (redacted) and what is accepted."""
    read_only = [protocol for protocol in _protocols(url) if protocol in _READ_ONLY]
    if read_only:
        raise ValueError(
            f"Cannot {doing} at {redact(url)!r}: {read_only[0]}:// can only be read. Accepted: a local path, or a URL of"
            " a store that can be written, e.g. s3://bucket/..., gs://bucket/..., az://container/..., memory://..."
        )


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
            f" {install_hint(extra)}"
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
                f" {install_hint(extra)}"
            ) from None
    check_place(url)
    check_no_query(url)
    store_timeout()  # a bad FABRIC_STORE_TIMEOUT is refused before anything is written
    try:
        fs, path = url_to_fs(url)
    except Exception as err:
        raise storage_error(f"Could not open the store of {redact(url)!r}", url, err) from without_secrets(err, url)
    from fsspec.asyn import AsyncFileSystem

    if isinstance(fs, AsyncFileSystem):
        fs = _Bounded(fs)
    # a library may repeat the URL, or a part of it, in its errors: with credentials in it, none of them passes uncleaned
    return (_Scrubbed(fs, url) if secrets_of(url) else fs), path


def _runs_on_loop(method: Any) -> bool:
    """Whether ``method`` is an asynchronous filesystem's blocking face of a coroutine (fsspec's ``sync_wrapper``: it
    takes ``timeout=``)."""
    import inspect

    return callable(method) and inspect.iscoroutinefunction(getattr(method, "__wrapped__", None))


class _Bounded:
    """An asynchronous fsspec filesystem whose blocking calls each wait at most :func:`store_timeout` seconds: fsspec's
    ``sync(..., timeout=)`` cancels the request on the event loop, and ``StoreTimeoutError`` is raised here. A file it
    opens for writing makes its uploads through it (the file's ``fs``), so each of those is bounded too; a read goes
    through ``cat_file`` (a file open for reading fetches through a path that takes no bound). Setting an attribute sets
    it on the filesystem itself."""

    def __init__(self, target: Any) -> None:
        object.__setattr__(self, "_target", target)

    def __getattr__(self, name: str) -> Any:
        if name == "_target":  # not set yet (a copy being made): no recursion through __getattr__
            raise AttributeError(name)
        if name == "open":
            return self._open
        value = getattr(self._target, name)
        if not _runs_on_loop(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            if "timeout" in kwargs:  # the caller's own bound
                return value(*args, **kwargs)
            from fsspec.exceptions import FSTimeoutError

            bound = store_timeout()
            try:
                return value(*args, timeout=bound, **kwargs)
            except FSTimeoutError:
                raise StoreTimeoutError(f"no answer from the store within {bound:g} s ({STORE_TIMEOUT_ENV} sets the bound)") from None

        return call

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._target, name, value)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        file = self._target.open(path, mode, **kwargs)
        if "r" not in mode and getattr(file, "fs", None) is self._target:
            file.fs = self  # its uploads (s3fs: call_s3 for each part and the commit) go through the bound
        return file

    def __repr__(self) -> str:
        return repr(self._target)


class _Scrubbed:
    """An fsspec filesystem (or a file it opened) whose calls raise ``without_secrets(err, url)`` for an error
    ``err``: the library's own error where it shows no secret of ``url``, else a scrubbed copy without a chain."""

    def __init__(self, target: Any, url: str) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_url", url)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._target, name, value)  # (a file given up is marked closed: the file itself)

    def __getattr__(self, name: str) -> Any:
        if name in ("_target", "_url"):  # not set yet (a copy being made): no recursion through __getattr__
            raise AttributeError(name)
        value = getattr(self._target, name)
        if not callable(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            result = self._call(value, *args, **kwargs)
            return _Scrubbed(result, self._url) if name == "open" else result

        return call

    def _call(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except Exception as err:
            clean = without_secrets(err, self._url)
            if clean is err:
                raise
            raise clean from None

    def __enter__(self) -> _Scrubbed:
        self._call(self._target.__enter__)
        return self

    def __exit__(self, *exc_info: Any) -> Any:
        return self._call(self._target.__exit__, *exc_info)

    def __repr__(self) -> str:
        return scrub(repr(self._target), self._url)


def _protocols(url: str) -> list[str]:
    head = url.split("://", 1)[0]
    return [part.lower() for part in head.split("::") if part]
