"""Metrics, hyperparameters and graphs to TensorBoard event files.

tensorboard is an optional dependency: it is imported when a ``TensorBoardLogger`` is constructed,
never by ``import fabric`` or ``import fabric.loggers``.

With a URL ``root_dir`` the writer writes to a local folder of its own and the logger uploads its files, each
as one whole object, through fsspec (the same resolver and credentials as checkpoints): when the writer is
made (so the version folder exists at once), on ``save``/``finalize``/exit, and while logging every
``flush_secs`` (120 s, the writer's own default). tensorboard's own remote writing was not used: without boto3,
and for every scheme but s3, it goes through fsspec and rewrites the whole event file on every record.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from argparse import Namespace
from collections.abc import Mapping
from typing import Any

from fabric.loggers.logger import (
    DEFAULT_NAME,
    FolderLogger,
    add_prefix,
    flatten,
    params_to_dict,
    rank_zero_experiment,
    rank_zero_only,
    register_close_at_exit,
    to_number,
)

__all__ = ["TensorBoardLogger"]

_INSTALL_HINT = (
    "TensorBoardLogger needs the tensorboard package, which is not installed."
    " Install it with `pip install fabric-torch[tensorboard]` (from a checkout of fabric: `pip install -e '.[tensorboard]'`;"
    " or `pip install tensorboard`)."
)


class TensorBoardLogger(FolderLogger):
    """Log to ``root_dir/name/version_N[/sub_dir]`` in TensorBoard's event-file format.

    Args:
        root_dir: the folder for all experiments (``tensorboard --logdir root_dir``); ``~`` and ``$VARS`` in
            it are expanded.
        name: the experiment's folder under ``root_dir``.
        version: None takes the next free ``version_N``; an int N means ``version_N``; a str is used as is.
        default_hp_metric: with ``log_hyperparams(params)`` and no metrics, also log ``hp_metric=-1`` so
            TensorBoard's HPARAMS tab shows the run (log a real ``hp_metric`` later to fill it in).
        prefix: put in front of every metric name (``"prefix-name"``).
        sub_dir: an extra folder under the version folder.
        **kwargs: passed to ``torch.utils.tensorboard.SummaryWriter`` (e.g. ``flush_secs``).

    Only global rank 0 creates the writer and files. ``root_dir`` may be a URL (``s3://bucket/runs``, any fsspec
    URL): the writer then writes to a local temporary folder (``experiment.log_dir``) whose files are uploaded
    to ``log_dir`` on the store as whole objects: at once, every ``flush_secs`` while logging, on ``save()``,
    ``finalize()`` and when the process ends.
    """

    def __init__(
        self,
        root_dir: str | os.PathLike,
        name: str = DEFAULT_NAME,
        version: int | str | None = None,
        default_hp_metric: bool = True,
        prefix: str = "",
        sub_dir: str | os.PathLike | None = None,
        **kwargs: Any,
    ) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # torch raises ImportError when tensorboard is absent
            raise ImportError(_INSTALL_HINT) from err
        from fabric._core.urls import is_url

        self._writer_class = SummaryWriter
        root = os.fspath(root_dir)
        super().__init__(root if is_url(root) else os.path.expanduser(os.path.expandvars(root)), name, version)
        self._default_hp_metric = default_hp_metric
        self._prefix = prefix
        self._sub_dir = None if sub_dir is None else os.fspath(sub_dir)
        self._kwargs = kwargs
        self._writer: Any = None
        # with a URL root_dir: the writer's local folder, what of it is on the store, and when it was uploaded
        self._staging: str | None = None
        self._uploaded: dict[str, tuple[int, int]] = {}
        self._last_upload = 0.0
        self._upload_every = float(kwargs.get("flush_secs", 120))
        register_close_at_exit(self)  # the writer's last events must not be lost when the script ends without finalize()

    def close_at_exit(self) -> None:
        """Flush and close the writer (called once, as the process ends)."""
        self.finalize("success")

    @property
    def log_dir(self) -> str:
        return os.path.join(super().log_dir, self._sub_dir) if self._sub_dir else super().log_dir

    @property
    def sub_dir(self) -> str | None:
        return self._sub_dir

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        """The ``SummaryWriter`` (created on first use, on rank 0); on other ranks an object that does nothing.

        With a URL ``root_dir`` it writes to a local temporary folder, uploaded to ``log_dir`` (see the class)."""
        if self._writer is None:
            if not self.is_remote:
                os.makedirs(self.log_dir, exist_ok=True)
                self._writer = self._writer_class(log_dir=self.log_dir, **self._kwargs)
                return self._writer
            self._staging = tempfile.mkdtemp(prefix="fabric-tensorboard-")
            self._writer = self._writer_class(log_dir=self._staging, **self._kwargs)
            try:
                self._sync()  # the version folder is on the store from now on: the next logger takes the next version
            except BaseException:
                self._writer.close()
                shutil.rmtree(self._staging, ignore_errors=True)
                self._writer, self._staging = None, None
                raise
        return self._writer

    def _sync(self, quiet: bool = False) -> None:
        """Flush the writer and upload its new or grown files to the store, each as one whole object.

        ``quiet``: a failure is a warning (the files stay local and are uploaded by the next sync) instead of
        an error, for the uploads that happen while logging."""
        if self._writer is None or self._staging is None:
            return
        self._writer.flush()  # waits for the writer's thread: the files hold whole records only
        try:
            self._upload()
        except Exception as err:
            from fabric._core.urls import error_summary, redact, without_secrets

            message = (
                f"Could not upload the TensorBoard logs to {redact(self.log_dir)!r}: {type(err).__name__}:"
                f" {error_summary(err, self.log_dir)} (they are kept in {self._staging!r}"
            )
            if not quiet:
                raise OSError(f"{message})") from without_secrets(err, self.log_dir)
            from fabric.utilities.rank_zero import rank_zero_warn

            rank_zero_warn(f"{message}; the next upload tries again)")
        finally:
            self._last_upload = time.monotonic()

    def _upload(self) -> None:
        from fabric._core.urls import filesystem

        assert self._staging is not None
        fs, base = filesystem(self.log_dir)
        for folder, _, files in os.walk(self._staging):
            for name in sorted(files):
                local = os.path.join(folder, name)
                stat = os.stat(local)
                seen = (stat.st_size, stat.st_mtime_ns)
                if self._uploaded.get(local) == seen:
                    continue
                relative = os.path.relpath(local, self._staging).replace(os.sep, "/")
                fs.put_file(local, f"{base}/{relative}")  # one whole object: a reader sees the old or the new file
                self._uploaded[local] = seen

    def _sync_if_due(self) -> None:
        if self._staging is not None and time.monotonic() - self._last_upload >= self._upload_every:
            self._sync(quiet=True)

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """One scalar per metric; a dict value becomes a group of scalars in one chart."""
        step = None if step is None else int(to_number(step))
        for key, value in add_prefix(metrics, self._prefix).items():
            if isinstance(value, Mapping):
                self.experiment.add_scalars(key, {k: to_number(v) for k, v in value.items()}, step)
            else:
                self.experiment.add_scalar(key, to_number(value), step)
        self._sync_if_due()

    @rank_zero_only
    def log_hyperparams(
        self, params: dict[str, Any] | Namespace, metrics: Mapping[str, Any] | None = None, *args: Any, **kwargs: Any
    ) -> None:
        """Show ``params`` (nested dicts flattened to ``a/b``) in TensorBoard's HPARAMS tab."""
        from torch.utils.tensorboard.summary import hparams

        flat = {key: _hparam_value(value) for key, value in flatten(params_to_dict(params)).items()}
        if metrics is None and self._default_hp_metric:
            metrics = {"hp_metric": -1}
        metrics = {key: to_number(value) for key, value in (metrics or {}).items()}
        experiment, session_start, session_end = hparams(flat, metrics)
        writer = self.experiment._get_file_writer()
        for summary in (experiment, session_start, session_end):
            writer.add_summary(summary)
        if metrics:
            self.log_metrics(metrics, step=0)
        self._sync_if_due()

    @rank_zero_only
    def log_graph(self, model: Any, input_array: Any = None) -> None:
        """Trace ``model`` with ``input_array`` (or its ``example_input_array``) and show the graph.

        Without an input there is nothing to trace: a warning, and no graph (as in Lightning Fabric).
        """
        import torch

        from fabric.utilities.rank_zero import rank_zero_warn

        example = input_array if input_array is not None else getattr(model, "example_input_array", None)
        if example is None:
            rank_zero_warn("log_graph() skipped: pass input_array (or give the model an example_input_array) to trace it")
            return
        if not isinstance(example, (torch.Tensor, tuple)):
            rank_zero_warn(
                f"log_graph() skipped: the input is a {type(example).__name__}; TensorBoard traces a tensor or a"
                " tuple of forward()'s positional arguments"
            )
            return
        module = getattr(model, "module", model)  # a FabricModule / DDP wrapper traces as its inner module
        self.experiment.add_graph(module, example)
        self._sync_if_due()

    @rank_zero_only
    def save(self) -> None:
        """Flush the writer (with a URL ``root_dir``: and upload what is new)."""
        if self._staging is not None:
            self._sync()
        elif self._writer is not None:
            self._writer.flush()

    @rank_zero_only
    def finalize(self, status: str) -> None:
        """Flush and close the writer (with a URL ``root_dir``: upload its files, then remove the local folder; if
        the upload fails, the error names the local folder, which is kept)."""
        if self._writer is not None:
            self._writer.flush()
            self._sync()  # with a URL root_dir: raises naming the kept local folder if the upload fails
            self._writer.close()
            self._writer = None
            staging, self._staging, self._uploaded = self._staging, None, {}
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)

    def __getstate__(self) -> dict[str, Any]:
        # a SummaryWriter holds a thread and a file: a copy sent to another process makes its own
        state = self.__dict__.copy()
        state.update(_writer=None, _staging=None, _uploaded={}, _last_upload=0.0)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        register_close_at_exit(self)


def _hparam_value(value: Any) -> Any:
    """TensorBoard shows numbers, strings, bools and tensors; anything else is shown as its str."""
    try:
        value = to_number(value)
    except ValueError:
        return str(value)
    return value if isinstance(value, (bool, int, float, str)) else str(value)
