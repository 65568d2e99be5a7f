"""Loggers: CSV content and versions, tensors to numbers, rank-0-only writing, TensorBoard event files,
and ``fabric.log`` / ``fabric.log_dict`` / ``fabric.logger(s)``."""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
from argparse import Namespace
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fabric import Fabric
from fabric.loggers import CSVLogger, Logger, TensorBoardLogger
from fabric.loggers.logger import DEFAULT_NAME
from fabric.utilities.rank_zero import rank_zero_only
from support import PYTHON
from support.loading import script_path
from support.processes import fabric_run, run

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def _header(path: Path) -> list[str]:
    with open(path, newline="") as handle:
        return next(csv.reader(handle))


@pytest.fixture
def as_rank() -> Iterator[Any]:
    """Pretend to be another global rank for the duration of a test."""
    previous = rank_zero_only.rank

    def set_rank(rank: int) -> None:
        rank_zero_only.rank = rank

    yield set_rank
    rank_zero_only.rank = previous


# ---- CSVLogger -----------------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_csv_rows_steps_and_growing_columns(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path, flush_logs_every_n_steps=2)
    logger.log_metrics({"loss": 1.0})
    assert not Path(logger.metrics_file_path).exists()  # buffered until 2 rows
    logger.log_metrics({"loss": 0.5}, step=10)
    assert _header(Path(logger.metrics_file_path)) == ["step", "loss"]
    logger.log_metrics({"loss": 0.25, "acc": 0.9})  # a new column: the file is rewritten, rows kept
    logger.log_metrics({"acc": 0.95}, step=20)
    logger.finalize("success")
    path = Path(logger.metrics_file_path)
    assert path == tmp_path / "fabric_logs" / "version_0" / "metrics.csv"
    assert _header(path) == ["step", "loss", "acc"]
    assert _rows(path) == [
        {"step": "0", "loss": "1.0", "acc": ""},
        {"step": "10", "loss": "0.5", "acc": ""},
        {"step": "2", "loss": "0.25", "acc": "0.9"},
        {"step": "20", "loss": "", "acc": "0.95"},
    ]
    assert not list(path.parent.glob("*.tmp*"))


@pytest.mark.timeout(10)
def test_csv_tensors_and_numpy_become_numbers(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path, name="exp", version="run", prefix="train", flush_logs_every_n_steps=1)
    logger.log_metrics({"a": torch.tensor(2.5), "b": torch.tensor([3]), "c": np.float32(0.5), "d": np.int64(7)},
                       step=torch.tensor(4))
    assert _rows(tmp_path / "exp" / "run" / "metrics.csv") == [
        {"step": "4", "train-a": "2.5", "train-b": "3", "train-c": "0.5", "train-d": "7"}]
    with pytest.raises(ValueError, match="one-element"):
        logger.log_metrics({"vector": torch.ones(3)})


@pytest.mark.timeout(10)
def test_csv_versions(tmp_path: Path) -> None:
    first = CSVLogger(tmp_path, name="exp")
    assert first.version == 0 and first.name == "exp" and first.root_dir == str(tmp_path)
    first.log_metrics({"x": 1})
    first.save()
    assert CSVLogger(tmp_path, name="exp").version == 1
    (tmp_path / "exp" / "version_7").mkdir()
    (tmp_path / "exp" / "version_x").mkdir()
    assert CSVLogger(tmp_path, name="exp").version == 8
    assert CSVLogger(tmp_path, name="exp", version=3).log_dir == str(tmp_path / "exp" / "version_3")
    assert CSVLogger(tmp_path, name="exp", version="best").log_dir == str(tmp_path / "exp" / "best")
    with pytest.raises(ValueError, match="version=-1"):
        CSVLogger(tmp_path, version=-1)
    with pytest.raises(ValueError, match="flush_logs_every_n_steps=0"):
        CSVLogger(tmp_path, flush_logs_every_n_steps=0)


@pytest.mark.timeout(10)
def test_csv_continues_an_existing_version(tmp_path: Path) -> None:
    """Resuming a run with the same version appends to its metrics.csv."""
    logger = CSVLogger(tmp_path, version=0)
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.finalize("success")
    again = CSVLogger(tmp_path, version=0)
    again.log_metrics({"loss": 0.5}, step=1)
    again.log_metrics({"loss": 0.4, "lr": 0.1}, step=2)
    # Lightning Fabric warns here (and deletes the file); we warn and continue it
    with pytest.warns(UserWarning, match=r"version_0 exists and is not empty; its metrics.csv \(if any\) is continued"):
        again.finalize("success")
    assert _rows(Path(again.metrics_file_path)) == [
        {"step": "0", "loss": "1.0", "lr": ""}, {"step": "1", "loss": "0.5", "lr": ""}, {"step": "2", "loss": "0.4", "lr": "0.1"}]


@pytest.mark.timeout(10)
def test_csv_warns_once_about_a_folder_with_files_only(tmp_path: Path, recwarn: Any) -> None:
    fresh = CSVLogger(tmp_path, version=0)
    fresh.log_hyperparams({"lr": 0.1})
    fresh.log_metrics({"loss": 1.0})
    fresh.save()
    assert len(recwarn) == 0  # its own files do not count
    (tmp_path / DEFAULT_NAME / "version_1").mkdir(parents=True)
    empty = CSVLogger(tmp_path, version=1)
    empty.log_metrics({"loss": 1.0})
    empty.save()
    assert len(recwarn) == 0  # an empty folder is no reason to warn
    (tmp_path / DEFAULT_NAME / "version_2").mkdir()
    (tmp_path / DEFAULT_NAME / "version_2" / "notes.txt").write_text("x")
    other = CSVLogger(tmp_path, version=2)
    with pytest.warns(UserWarning, match="version_2 exists and is not empty"):
        other.log_hyperparams({"lr": 0.2})
    other.log_metrics({"loss": 1.0})
    other.save()
    assert len(recwarn) == 0  # once: not again when the metrics are written


@pytest.mark.timeout(10)
def test_csv_hyperparameters(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path)
    logger.log_hyperparams(Namespace(lr=0.1, layers=[64, 10]))
    logger.log_hyperparams({"optimizer": {"name": "adam", "betas": (0.9, 0.99)}, "scale": torch.tensor(2.0),
                            "device": torch.device("cpu"), "weights": torch.arange(3)})
    saved = json.loads((Path(logger.log_dir) / "hparams.json").read_text())
    assert saved == {"lr": 0.1, "layers": [64, 10], "optimizer": {"name": "adam", "betas": [0.9, 0.99]},
                     "scale": 2.0, "device": "cpu", "weights": [0, 1, 2]}
    with pytest.raises(TypeError, match=r"dict or an argparse\.Namespace"):
        logger.log_hyperparams([("lr", 1)])


@pytest.mark.procs
@pytest.mark.timeout(150)
def test_csv_rows_are_written_when_the_script_ends_without_finalize(tmp_path: Path) -> None:
    """... and importing the loggers imports no tensorboard (it is imported when a logger is built)."""
    code = ("import sys\nfrom fabric.loggers import CSVLogger\n"
            "assert not [m for m in sys.modules if m.startswith(('tensorboard', 'torch.utils.tensorboard'))]\n"
            "logger = CSVLogger(sys.argv[1])\nlogger.log_metrics({'loss': 0.5}, step=3)\n")
    # a hang guard, not a time bound: a fresh interpreter importing torch took over 25 s beside two loaded suites
    run([PYTHON, "-c", code, str(tmp_path)], timeout=120)
    assert _rows(tmp_path / "fabric_logs" / "version_0" / "metrics.csv") == [{"step": "3", "loss": "0.5"}]


@pytest.mark.timeout(10)
def test_loggers_write_nothing_on_other_ranks(tmp_path: Path, as_rank: Any) -> None:
    as_rank(1)
    loggers: list[Logger] = [CSVLogger(tmp_path, flush_logs_every_n_steps=1)]
    if HAS_TENSORBOARD:
        loggers.append(TensorBoardLogger(tmp_path, name="tb"))
    for logger in loggers:
        logger.log_metrics({"loss": 1.0}, step=0)
        logger.log_hyperparams({"lr": 0.1})
        logger.save()
        logger.finalize("success")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_only_rank_zero_writes_in_a_two_process_job(tmp_path: Path) -> None:
    args = ["--tensorboard"] if HAS_TENSORBOARD else []
    run(fabric_run("--accelerator", "cpu", "--devices", "2", script_path("multinode", "log_job.py"), tmp_path, *args), timeout=55)
    assert sorted(p.name for p in (tmp_path / "csv").iterdir()) == ["version_0"]  # no version_1 from rank 1
    assert _rows(tmp_path / "csv" / "version_0" / "metrics.csv") == [
        {"step": "0", "who": "0", "value": "", "world": ""}, {"step": "1", "who": "", "value": "0.5", "world": "2"}]
    assert json.loads((tmp_path / "csv" / "version_0" / "hparams.json").read_text()) == {"rank": 0}
    if HAS_TENSORBOARD:
        assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == ["version_0"]
        assert len(list((tmp_path / "tb" / "version_0").glob("events.out.tfevents.*"))) == 1


# ---- TensorBoardLogger ---------------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard is not installed (pip install fabric-torch[tensorboard])")
def test_tensorboard_writes_scalars_and_hparams(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    logger = TensorBoardLogger(tmp_path, name="exp", sub_dir="train")
    assert logger.log_dir == str(tmp_path / "exp" / "version_0" / "train")
    logger.log_metrics({"loss": torch.tensor(0.5)}, step=1)
    logger.log_metrics({"loss": 0.25, "acc": np.float64(0.75)}, step=2)
    logger.log_metrics({"pair": {"a": 1.0, "b": torch.tensor(2.0)}}, step=3)
    logger.log_hyperparams({"lr": 0.1, "opt": {"name": "adam"}, "device": torch.device("cpu")})
    logger.log_graph(torch.nn.Linear(2, 1), torch.zeros(1, 2))
    logger.finalize("success")

    events = EventAccumulator(logger.log_dir)
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {"loss", "acc", "hp_metric"} <= set(scalars)
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 0.5), (2, 0.25)]
    content = events.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["lr"].number_value == 0.1
    assert start.hparams["opt/name"].string_value == "adam" and start.hparams["device"].string_value == "cpu"
    assert events.Graph() is not None
    assert TensorBoardLogger(tmp_path, name="exp").version == 1


@pytest.mark.timeout(30)
def test_tensorboard_expands_home_and_variables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RUNS_FOLDER", "runs")
    logger = TensorBoardLogger("~/$RUNS_FOLDER", name="exp")
    assert logger.root_dir == str(tmp_path / "home" / "runs")
    assert logger.log_dir == str(tmp_path / "home" / "runs" / "exp" / "version_0")
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.finalize("success")
    assert (tmp_path / "home" / "runs" / "exp" / "version_0").is_dir()
    assert not Path("~").exists() and not Path("$RUNS_FOLDER").exists()


@pytest.mark.timeout(30)
def test_tensorboard_log_graph_without_an_input_warns_and_skips(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path)
    with pytest.warns(UserWarning, match="log_graph\\(\\) skipped: pass input_array"):
        logger.log_graph(torch.nn.Linear(2, 1))
    with pytest.warns(UserWarning, match="log_graph\\(\\) skipped: the input is a list"):
        logger.log_graph(torch.nn.Linear(2, 1), [torch.zeros(1, 2)])
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.finalize("success")
    events = EventAccumulator(logger.log_dir)
    events.Reload()
    assert not events.Tags()["graph"]


@pytest.mark.timeout(10)
def test_tensorboard_missing_gives_an_install_hint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # makes the import fail
    with pytest.raises(ImportError, match=r"pip install fabric-torch\[tensorboard\]"):
        TensorBoardLogger(tmp_path)


# ---- the base class ---------------------------------------------------------------------------------


class RecordingLogger(Logger):
    def __init__(self) -> None:
        self.metrics: list[tuple[dict[str, Any], int | None]] = []
        self.saved = 0

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: Any, step: int | None = None) -> None:
        self.metrics.append((dict(metrics), step))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def save(self) -> None:
        self.saved += 1


@pytest.mark.timeout(10)
def test_base_logger_defaults() -> None:
    with pytest.raises(TypeError):
        Logger()  # type: ignore[abstract]
    logger = RecordingLogger()
    assert logger.root_dir is None and logger.log_dir is None and logger.group_separator == "/"
    logger.log_graph(torch.nn.Linear(1, 1))
    logger.finalize("success")
    assert logger.saved == 1


# ---- Fabric.log / log_dict / logger / loggers ----------------------------------------------------------


@pytest.mark.timeout(10)
def test_fabric_log_sends_numbers_to_every_logger() -> None:
    first, second = RecordingLogger(), RecordingLogger()
    fabric = Fabric(accelerator="cpu", devices=1, loggers=[first, second])
    assert fabric.loggers == [first, second] and fabric.logger is first
    fabric.log("loss", torch.tensor(1.5, requires_grad=True) * 2, step=3)
    fabric.log_dict({"a": torch.tensor(1), "b": 2.0, "c": {"nested": torch.tensor(0.5)}})
    assert first.metrics == second.metrics == [({"loss": 3.0}, 3), ({"a": 1, "b": 2.0, "c": {"nested": 0.5}}, None)]
    assert type(first.metrics[0][0]["loss"]) is float and type(first.metrics[1][0]["a"]) is int


@pytest.mark.timeout(10)
def test_fabric_logger_properties(tmp_path: Path) -> None:
    single = CSVLogger(tmp_path)
    assert Fabric(accelerator="cpu", devices=1, loggers=single).loggers == [single]
    fabric = Fabric(accelerator="cpu", devices=1)
    assert fabric.loggers == []
    with pytest.raises(RuntimeError, match="no logger"):
        fabric.logger  # noqa: B018 - reading the property is what raises
    fabric.log("ignored", 1.0)  # no loggers: nothing happens


_LOG_WITHOUT_FINALIZE = """\
import sys
import time
from fabric import Fabric
from fabric.loggers import CSVLogger, TensorBoardLogger


def log_and_end(fabric, ending):
    for step in range(5):
        fabric.log("reward", float(step * 10), step=step)
    fabric.log("test_reward", 123.0, step=5)  # the last event, as in an RL example's test at the end
    if ending == "rank 0 raises" and fabric.global_rank == 0:
        raise RuntimeError("the script fails after logging")
    if ending.startswith("rank 1 raises"):
        if fabric.global_rank == 1:
            time.sleep(1)
            raise RuntimeError("rank 1 fails after logging")
        if ending == "rank 1 raises while rank 0 runs":
            time.sleep(60)  # still running when rank 1 fails: the launcher ends this process


root, strategy, ending = sys.argv[1:]
fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp" if strategy == "fabric run" else strategy,
                loggers=[TensorBoardLogger(root, flush_secs=3600), CSVLogger(root)])
if strategy in ("ddp", "fabric run"):
    fabric.launch()
    log_and_end(fabric, ending)
else:
    fabric.launch(log_and_end, ending)
"""


@pytest.mark.procs
@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("strategy", "ending"),
    [
        ("ddp", "normal"),
        ("ddp", "rank 0 raises"),
        # rank 0 is ended with os._exit by its supervision thread, without atexit (rows lost before)
        ("ddp", "rank 1 raises while rank 0 runs"),
        ("ddp", "rank 1 raises after rank 0 ended"),
        # multiprocessing ends a fork worker with os._exit, without atexit (events and rows lost before)
        ("ddp_fork", "normal"),
        ("ddp_fork", "rank 0 raises"),
        # `fabric run` stops rank 0 with SIGTERM (then SIGKILL after a grace) when rank 1 failed (rows lost before)
        ("fabric run", "rank 1 raises while rank 0 runs"),
    ],
)
def test_a_script_that_ends_without_finalize_keeps_its_last_events_and_rows(tmp_path: Path, strategy: str, ending: str) -> None:
    """Rank 0 logs and never calls ``finalize``; the job ends; the event file and metrics.csv hold everything."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    from support.environment import job_environment

    script = tmp_path / "log.py"
    script.write_text(_LOG_WITHOUT_FINALIZE)
    launcher = fabric_run("--accelerator=cpu", "--devices=2", "--strategy=ddp") if strategy == "fabric run" else [sys.executable]
    result = run([*launcher, str(script), str(tmp_path / "logs"), strategy, ending], timeout=70,
                 env=job_environment(), cwd=tmp_path, check=False)
    assert result.returncode == (0 if ending == "normal" else 1), result.stderr
    event_files = list((tmp_path / "logs").rglob("events.out.tfevents.*"))
    assert len(event_files) == 1, event_files
    scalars = {}
    for event in EventFileLoader(str(event_files[0])).Load():
        for value in event.summary.value:
            scalars[(value.tag, event.step)] = value.tensor.float_val[0] if value.HasField("tensor") else value.simple_value
    assert scalars.get(("test_reward", 5)) == 123.0, (scalars, result.stderr)
    assert [scalars.get(("reward", step)) for step in range(5)] == [0.0, 10.0, 20.0, 30.0, 40.0]
    metrics = list((tmp_path / "logs").rglob("metrics.csv"))
    assert len(metrics) == 1, (metrics, result.stderr)
    rows = _rows(metrics[0])
    assert [row["step"] for row in rows] == ["0", "1", "2", "3", "4", "5"]
    assert float(rows[-1]["test_reward"]) == 123.0
