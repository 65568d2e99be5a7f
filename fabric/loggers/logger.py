"""The interface every logger implements (Lightning Fabric's ``Logger``), plus shared helpers."""

from __future__ import annotations

import os
import re
import sys
import weakref
from abc import ABC, abstractmethod
from argparse import Namespace
from collections.abc import Callable, Mapping
from functools import wraps
from typing import Any

from fabric._core.env import started_by_a_cli
from fabric._core.process_end import at_process_end, run_process_end_callbacks_on_sigterm
from fabric.utilities.rank_zero import rank_zero_only

__all__ = ["Logger", "NoOpExperiment", "rank_zero_experiment", "rank_zero_only"]

DEFAULT_NAME = "fabric_logs"

# Our loggers that may hold what is not on disk yet. Weak: a logger nobody uses can still be collected.
_OPEN_LOGGERS: weakref.WeakSet[Any] = weakref.WeakSet()


def register_close_at_exit(logger: Any) -> None:
    """Have ``logger.close_at_exit()`` run when the process ends, if it still exists.

    So a script that ends without ``finalize`` keeps its last rows and events: at a normal end, after an
    exception, in a fork worker (ended with ``os._exit``), in rank 0 ended at once because another rank
    failed, and in a rank that ``fabric run`` or torchrun stops with SIGTERM for that reason (see
    :mod:`fabric._core.process_end`). One callback for all loggers.
    """
    _OPEN_LOGGERS.add(logger)
    at_process_end(_close_open_loggers)
    if started_by_a_cli() or "TORCHELASTIC_RUN_ID" in os.environ:
        # its launcher stops this rank with SIGTERM when another rank failed (under launch(), rank 0's own
        # supervision ends it through the process-end callbacks instead)
        run_process_end_callbacks_on_sigterm()


def _close_open_loggers() -> None:
    from fabric._core.urls import scrub

    for logger in list(_OPEN_LOGGERS):
        try:
            logger.close_at_exit()
        except Exception as err:  # one logger's failure must not cost the others their data
            line = f"[fabric] could not write {type(logger).__name__}'s last data at exit: {err!r}"
            print(scrub(line, str(getattr(logger, "root_dir", None) or "")), file=sys.stderr, flush=True)


_VERSION_DIR = re.compile(r"version_(\d+)")


class Logger(ABC):
    """Where ``fabric.log`` / ``fabric.log_dict`` send metrics.

    A logger decides itself which processes write; ours write on global rank 0 only, so calling
    them from every rank is safe. Subclasses implement ``name``, ``version``, ``log_metrics`` and
    ``log_hyperparams``; the rest have harmless defaults.
    """

    @property
    @abstractmethod
    def name(self) -> str | None:
        """The experiment's name (a folder under ``root_dir`` for file-based loggers)."""

    @property
    @abstractmethod
    def version(self) -> int | str | None:
        """The run's version within the experiment (``version_N`` folders for file-based loggers)."""

    @property
    def root_dir(self) -> str | None:
        """The folder that holds every experiment of this logger, or None if it writes no files."""
        return None

    @property
    def log_dir(self) -> str | None:
        """The folder this run writes to, or None if it writes no files."""
        return None

    @property
    def group_separator(self) -> str:
        """The character that groups metric names (``"train/loss"``) in loggers that support groups."""
        return "/"

    @abstractmethod
    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Record ``metrics`` (name -> number) at ``step``."""

    @abstractmethod
    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        """Record the run's hyperparameters."""

    def log_graph(self, model: Any, input_array: Any = None) -> None:
        """Record the model's graph, where the logger can show one (the default does nothing)."""

    def save(self) -> None:
        """Write what is buffered (the default has nothing buffered)."""

    def finalize(self, status: str) -> None:
        """End the run (``status``: "success", "failed", ...); writes what is buffered."""
        self.save()



class NoOpExperiment:
    """What ``logger.experiment`` is on ranks other than 0: any method call or item access does nothing.

    So ``fabric.logger.experiment.add_text(...)`` can be written once for every rank, as with Lightning.
    """

    def _nothing(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Callable[..., None]:
        if name.startswith("__"):  # copy, pickle and friends must not take it for a hook
            raise AttributeError(name)
        return self._nothing

    def __getitem__(self, key: Any) -> NoOpExperiment:
        return self  # experiment[0].add_image(...)

    def __setitem__(self, key: Any, value: Any) -> None:
        return None

    def __repr__(self) -> str:
        return "NoOpExperiment()"


def rank_zero_experiment(experiment: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """For a logger's ``experiment`` property: the real object on global rank 0, a :class:`NoOpExperiment` elsewhere."""

    @wraps(experiment)
    def on_rank_zero(self: Any) -> Any:
        if rank_zero_only.rank > 0:  # type: ignore[attr-defined]
            return NoOpExperiment()
        return experiment(self)

    return on_rank_zero


class FolderLogger(Logger):
    """A logger writing under ``root_dir/name/version_N``: the folder layout both file loggers share.

    ``root_dir`` may be a URL (``s3://bucket/logs``, ``memory://logs``, any fsspec URL): the folder is then on
    that store (``is_remote``), versions are found by listing it, and the subclass writes through fsspec.
    """

    def __init__(self, root_dir: str | os.PathLike, name: str, version: int | str | None) -> None:
        from fabric._core.urls import check_writable, is_url, local_or_url

        # a URL is never a local folder: its store is checked here (no place named, a query or fragment, read-only,
        # unknown scheme, missing library)
        if is_url(root_dir):
            check_writable(str(root_dir), f"write the logs of {type(self).__name__}")
        root_dir = local_or_url(os.fspath(root_dir))
        self._remote = is_url(root_dir)
        self._root_dir = os.fspath(root_dir)
        self._name = name or ""
        self._version = check_version(version)

    @property
    def is_remote(self) -> bool:
        """Whether ``root_dir`` is a URL (the logs go to a store through fsspec, not to a local folder)."""
        return self._remote

    @property
    def name(self) -> str:
        return self._name

    @property
    def version(self) -> int | str:
        """Decided on first use: the next free ``version_N`` when none was given."""
        if self._version is None:
            self._version = next_version(os.path.join(self._root_dir, self._name))
        return self._version

    @property
    def root_dir(self) -> str:
        return self._root_dir

    @property
    def log_dir(self) -> str:
        return os.path.join(self._root_dir, self._name, version_folder(self.version))

    def __repr__(self) -> str:
        from fabric._core.urls import redact

        root_dir = redact(self._root_dir) if self._remote else self._root_dir
        return f"{type(self).__name__}(root_dir={root_dir!r}, name={self._name!r}, version={self._version!r})"

def next_version(experiment_dir: str) -> int:
    """One more than the highest ``version_N`` folder in ``experiment_dir`` (0 when there is none); a URL is listed
    on its store."""
    found = [int(m.group(1)) for entry in list_folder(experiment_dir) if (m := _VERSION_DIR.fullmatch(entry))]
    return max(found) + 1 if found else 0


def list_folder(folder: str) -> list[str]:
    """The names in ``folder``, a local path or a URL (listed on its store, never from a cached listing); [] when
    there is no such folder."""
    from fabric._core.urls import filesystem, is_url, store_errors

    try:
        if not is_url(folder):
            return os.listdir(folder)
        fs, path = filesystem(folder)
        with store_errors("list the log folder", folder, passing=(FileNotFoundError, NotADirectoryError)):
            fs.invalidate_cache(path)
            return [entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(path, detail=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def write_text(path: str, text: str) -> None:
    """Replace the file ``path`` (local, or an object on a store) by ``text`` as one step: a reader sees the old
    file or the new one, never a part. Locally: a temp file renamed over it; on a store: one whole-object PUT."""
    from fabric._core.urls import filesystem, is_url, store_errors

    if is_url(path):
        fs, key = filesystem(path)
        with store_errors("write the log file", path):
            fs.pipe_file(key, text.encode("utf-8"))
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    temp = f"{path}.tmp{os.getpid()}"
    with open(temp, "w", newline="", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(temp, path)


def read_text(path: str) -> str | None:
    """The text of the file ``path`` (local or on a store), or None if there is none."""
    from fabric._core.urls import filesystem, is_url, store_errors

    try:
        if is_url(path):
            fs, key = filesystem(path)
            with store_errors("read the log file", path, passing=(FileNotFoundError,)):
                return bytes(fs.cat_file(key)).decode("utf-8")
        with open(path, newline="", encoding="utf-8") as handle:
            return handle.read()
    except FileNotFoundError:
        return None


def version_folder(version: int | str) -> str:
    return version if isinstance(version, str) else f"version_{version}"


def check_version(version: Any) -> int | str | None:
    if version is None or isinstance(version, str):
        return version
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version={version!r} is not valid; accepted: None (the next free one), an int >= 0 or a str")
    return version


def to_number(value: Any) -> Any:
    """Tensors and NumPy values of one element become Python numbers; anything else is kept."""
    item = getattr(value, "item", None)
    if item is None or not callable(item) or isinstance(value, (bool, int, float, str)):
        return value
    numel = getattr(value, "numel", None)
    size = numel() if callable(numel) else getattr(value, "size", 1)
    if size != 1:
        raise ValueError(f"Only one-element tensors or arrays can be logged as numbers, got one with {size} elements")
    return item()


def add_prefix(metrics: Mapping[str, Any], prefix: str, separator: str = "-") -> dict[str, Any]:
    if not prefix:
        return dict(metrics)
    return {f"{prefix}{separator}{key}": value for key, value in metrics.items()}


def params_to_dict(params: Any) -> dict[str, Any]:
    """Hyperparameters as a plain dict: from a dict, an ``argparse.Namespace`` or any mapping."""
    if isinstance(params, Namespace):
        return dict(vars(params))
    if isinstance(params, Mapping):
        return dict(params)
    raise TypeError(f"log_hyperparams() takes a dict or an argparse.Namespace, got {type(params).__name__}")


def flatten(params: Mapping[str, Any], separator: str = "/") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a/b": 1}`` (for loggers that show one level only)."""
    flat: dict[str, Any] = {}

    def visit(prefix: str, value: Any) -> None:
        if isinstance(value, Namespace):
            value = vars(value)
        if isinstance(value, Mapping):
            for key, inner in value.items():
                visit(f"{prefix}{separator}{key}" if prefix else str(key), inner)
        else:
            flat[prefix] = value

    visit("", params)
    return flat
