"""Metrics to a CSV file (``metrics.csv``) and hyperparameters to ``hparams.json``: no dependencies.

The folder may be on a store (a URL ``root_dir``, through fsspec). An object cannot be appended to, so there each
save rewrites the whole ``metrics.csv`` object with one PUT: the logger keeps the file's text (read once, when a
run continues an existing file), so a save reads nothing back.
"""

from __future__ import annotations

import csv
import io
import json
import os
from argparse import Namespace
from collections.abc import Mapping
from typing import Any

from fabric.loggers.logger import (
    DEFAULT_NAME,
    FolderLogger,
    add_prefix,
    list_folder,
    params_to_dict,
    rank_zero_experiment,
    rank_zero_only,
    read_text,
    register_close_at_exit,
    to_number,
    write_text,
)

__all__ = ["CSVLogger"]

METRICS_FILE = "metrics.csv"
HPARAMS_FILE = "hparams.json"


class CSVLogger(FolderLogger):
    """Log metrics to ``root_dir/name/version_N/metrics.csv``, one row per ``log_metrics`` call.

    Args:
        root_dir: the folder for all experiments.
        name: the experiment's folder under ``root_dir``.
        version: the run's folder: None takes the next free ``version_N``; an int N means ``version_N``;
            a str is used as it is. An existing ``metrics.csv`` in that folder is continued (resuming a run).
        prefix: put in front of every metric name (``"prefix-name"``).
        flush_logs_every_n_steps: rows are buffered and written every this many rows (and by
            ``save``/``finalize``, and when the interpreter exits).

    Columns are ``step`` and then every metric name in the order first seen; when a new name appears the
    file is rewritten with the wider header (earlier rows get empty cells). Only global rank 0 writes.

    ``root_dir`` may be a URL (``s3://bucket/logs``, any fsspec URL): the files are objects on that store,
    each save rewriting the whole ``metrics.csv`` object (a store cannot append).
    """

    def __init__(
        self,
        root_dir: str | os.PathLike,
        name: str = DEFAULT_NAME,
        version: int | str | None = None,
        prefix: str = "",
        flush_logs_every_n_steps: int = 100,
    ) -> None:
        if isinstance(flush_logs_every_n_steps, bool) or not isinstance(flush_logs_every_n_steps, int) or flush_logs_every_n_steps < 1:
            raise ValueError(f"flush_logs_every_n_steps={flush_logs_every_n_steps!r} is not valid; accepted: an int >= 1")
        super().__init__(root_dir, name, version)
        self._prefix = prefix
        self._flush_every = flush_logs_every_n_steps
        self._rows: list[dict[str, Any]] = []  # not yet written
        self._columns: list[str] | None = None  # the header of the file on disk (None: not read yet)
        self._text: str | None = None  # on a store: the whole metrics.csv as last written (None: not read yet)
        self._logged_rows = 0
        self._hparams: dict[str, Any] = {}
        self._checked_folder = False
        register_close_at_exit(self)  # buffered rows must not be lost when the script ends without finalize()

    def close_at_exit(self) -> None:
        """Write what is buffered (called once, as the process ends)."""
        self.save()

    def __getstate__(self) -> dict[str, Any]:
        # a copy sent to another process (spawn) starts without this process's unwritten rows
        state = self.__dict__.copy()
        state["_rows"] = []
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        register_close_at_exit(self)

    # ---- where ------------------------------------------------------------------------------------

    @property
    def metrics_file_path(self) -> str:
        return os.path.join(self.log_dir, METRICS_FILE)

    @property
    @rank_zero_experiment
    def experiment(self) -> CSVLogger:
        """The object that writes on rank 0 (the logger itself: there is no third-party writer); elsewhere one that does nothing."""
        return self

    # ---- logging ----------------------------------------------------------------------------------

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Buffer one row; ``step`` defaults to a metric named "step", else the number of rows logged before it.

        The ``step`` column holds one value per row: a metric named "step" goes there (the ``step`` argument
        wins when both are given).
        """
        row = {key: to_number(value) for key, value in add_prefix(metrics, self._prefix).items()}
        if step is None:
            step = row.get("step", self._logged_rows)
        row["step"] = int(to_number(step))
        self._rows.append(row)
        self._logged_rows += 1
        if len(self._rows) >= self._flush_every:
            self.save()

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        """Merge ``params`` into ``hparams.json`` (written at once; values JSON cannot hold become strings)."""
        self._hparams.update(params_to_dict(params))
        self._warn_if_folder_has_files()
        write_text(os.path.join(self.log_dir, HPARAMS_FILE), json.dumps(_jsonable(self._hparams), indent=2, sort_keys=True) + "\n")

    @rank_zero_only
    def save(self) -> None:
        """Write the buffered rows: appended, or the whole file rewritten when new columns appeared (on a store:
        always the whole object)."""
        if not self._rows:
            return
        self._warn_if_folder_has_files()
        if self.is_remote:
            self._save_to_store()
            return
        os.makedirs(self.log_dir, exist_ok=True)
        path = self.metrics_file_path
        if self._columns is None:
            self._columns = _read_header(path)
        columns = self._widened(self._columns)
        if columns == self._columns and os.path.exists(path):
            with open(path, "a", newline="", encoding="utf-8") as handle:
                csv.DictWriter(handle, fieldnames=columns).writerows(self._rows)
        else:
            old_rows = _read_rows(path)
            write_text(path, _csv_text(columns, [*old_rows, *self._rows]))
        self._columns = columns
        self._rows = []

    def _save_to_store(self) -> None:
        """One PUT of the whole object: its last text plus the new rows (every row again under a wider header)."""
        if self._text is None:  # continuing a run's file: read once
            self._text = read_text(self.metrics_file_path) or ""
            self._columns = next(csv.reader(io.StringIO(self._text, newline="")), [])
        assert self._columns is not None
        columns = self._widened(self._columns)
        if columns == self._columns and self._text:
            text = self._text + _csv_text(columns, self._rows, header=False)
        else:
            text = _csv_text(columns, [*csv.DictReader(io.StringIO(self._text, newline="")), *self._rows])
        write_text(self.metrics_file_path, text)  # raises before anything is forgotten: the rows stay buffered
        self._text, self._columns, self._rows = text, columns, []

    def _widened(self, columns: list[str]) -> list[str]:
        """``columns`` with the buffered rows' new names appended, ``step`` first."""
        columns = list(columns)
        for row in self._rows:
            columns.extend(key for key in row if key not in columns)
        if "step" in columns:
            columns.remove("step")
        columns.insert(0, "step")
        return columns

    @rank_zero_only
    def finalize(self, status: str) -> None:
        self.save()

    def _warn_if_folder_has_files(self) -> None:
        """Before the first write: warn (as Lightning Fabric does) when the version folder already has files.

        Unlike Lightning Fabric, which then deletes its ``metrics.csv``, the file is continued: nothing is lost.
        """
        if self._checked_folder:
            return
        self._checked_folder = True
        if list_folder(self.log_dir):
            from fabric._core.urls import redact
            from fabric.utilities.rank_zero import rank_zero_warn

            rank_zero_warn(
                f"The log folder {redact(self.log_dir)} exists and is not empty; its {METRICS_FILE} (if any) is continued."
                " Pass another version (or none, for the next free one) to start a fresh run."
            )


def _read_header(path: str) -> list[str]:
    try:
        with open(path, newline="", encoding="utf-8") as handle:
            return next(csv.reader(handle), [])
    except FileNotFoundError:
        return []


def _read_rows(path: str) -> list[dict[str, Any]]:
    try:
        with open(path, newline="", encoding="utf-8") as handle:
            return list(csv.DictReader(handle))
    except FileNotFoundError:
        return []


def _csv_text(columns: list[str], rows: list[dict[str, Any]], header: bool = True) -> str:
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=columns)
    if header:
        writer.writeheader()
    writer.writerows(rows)
    return text.getvalue()


def _jsonable(value: Any) -> Any:
    if isinstance(value, Namespace):
        value = vars(value)
    if isinstance(value, Mapping):
        return {str(key): _jsonable(inner) for key, inner in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(inner) for inner in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    try:
        number = to_number(value)
    except ValueError:  # a tensor or array of several elements
        tolist = getattr(value, "tolist", None)
        return tolist() if callable(tolist) else str(value)
    return str(value) if number is value else _jsonable(number)
