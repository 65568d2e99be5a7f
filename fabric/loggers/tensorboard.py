"""Metrics, hyperparameters and graphs to TensorBoard event files.

tensorboard is an optional dependency: it is imported when a ``TensorBoardLogger`` is constructed,
never by ``import fabric`` or ``import fabric.loggers``.
"""

from __future__ import annotations

import os
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
    " Install it with `pip install fabric-torch[tensorboard]` (or `pip install tensorboard`)."
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

    Only global rank 0 creates the writer and files.
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
        self._writer_class = SummaryWriter
        super().__init__(os.path.expanduser(os.path.expandvars(os.fspath(root_dir))), name, version)
        self._default_hp_metric = default_hp_metric
        self._prefix = prefix
        self._sub_dir = None if sub_dir is None else os.fspath(sub_dir)
        self._kwargs = kwargs
        self._writer: Any = None
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
        """The ``SummaryWriter`` (created on first use, on rank 0); on other ranks an object that does nothing."""
        if self._writer is None:
            os.makedirs(self.log_dir, exist_ok=True)
            self._writer = self._writer_class(log_dir=self.log_dir, **self._kwargs)
        return self._writer

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """One scalar per metric; a dict value becomes a group of scalars in one chart."""
        step = None if step is None else int(to_number(step))
        for key, value in add_prefix(metrics, self._prefix).items():
            if isinstance(value, Mapping):
                self.experiment.add_scalars(key, {k: to_number(v) for k, v in value.items()}, step)
            else:
                self.experiment.add_scalar(key, to_number(value), step)

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

    @rank_zero_only
    def save(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None

    def __getstate__(self) -> dict[str, Any]:
        # a SummaryWriter holds a thread and a file: a copy sent to another process makes its own
        state = self.__dict__.copy()
        state["_writer"] = None
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
