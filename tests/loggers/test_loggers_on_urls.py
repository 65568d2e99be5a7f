"""Loggers with a URL ``root_dir``: the logs land on the store (fsspec's ``memory://`` and a real S3 server on
127.0.0.1), readable there, with versions found by listing the store; nothing is written to a local folder
named after the URL. An unusable URL is refused at construction: ``test_storage_urls.py``."""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fabric._core.urls import filesystem
from fabric.loggers import CSVLogger, TensorBoardLogger
from support import PYTHON
from support.processes import run

pytestmark = pytest.mark.usefixtures("clean_fabric_env")

pytest.importorskip("fsspec")
HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
needs_tensorboard = pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard is not installed")


@pytest.fixture
def empty_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The test runs in an empty folder, which must stay empty: a URL taken for a local path would show up here."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    yield cwd
    assert sorted(os.listdir(cwd)) == []


@pytest.fixture(params=["memory", "s3"])
def root_url(request: pytest.FixtureRequest, empty_cwd: Path) -> Iterator[str]:
    """A fresh folder on fsspec's in-memory store, or in a new bucket of a real S3 server."""
    if request.param == "s3":
        yield f"{request.getfixturevalue('s3_bucket')}/logs"
        return
    folder = f"fabric-logs-{secrets.token_hex(4)}"
    yield f"memory://{folder}"
    fs, path = filesystem(f"memory://{folder}")
    if fs.exists(path):
        fs.rm(path, recursive=True)


def read(url: str) -> str:
    fs, path = filesystem(url)
    fs.invalidate_cache()
    return bytes(fs.cat_file(path)).decode()


def csv_rows(url: str) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(read(url), newline="")))


def names(url: str) -> list[str]:
    fs, path = filesystem(url)
    fs.invalidate_cache()
    return sorted(entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(path, detail=False))


def download(url: str, local: Path) -> Path:
    """Every object under ``url`` copied below ``local``, keeping the layout."""
    fs, path = filesystem(url)
    fs.invalidate_cache()
    for remote in fs.find(path):
        target = local / remote[len(path.rstrip("/")) + 1 :]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(fs.cat_file(remote))
    return local


# ---- CSVLogger ----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_csv_logger_writes_to_the_store(root_url: str) -> None:
    logger = CSVLogger(root_url, flush_logs_every_n_steps=2)
    assert logger.log_dir == f"{root_url}/fabric_logs/version_0" and logger.is_remote
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.log_metrics({"loss": 0.5}, step=1)  # 2 rows: written
    assert csv_rows(logger.metrics_file_path) == [{"step": "0", "loss": "1.0"}, {"step": "1", "loss": "0.5"}]
    logger.log_metrics({"loss": 0.25, "acc": torch.tensor(0.75)}, step=2)  # a new column: every row again
    logger.log_hyperparams({"lr": 0.1, "opt": {"name": "adam"}})
    logger.finalize("success")
    assert csv_rows(logger.metrics_file_path) == [
        {"step": "0", "loss": "1.0", "acc": ""}, {"step": "1", "loss": "0.5", "acc": ""}, {"step": "2", "loss": "0.25", "acc": "0.75"}]
    assert json.loads(read(f"{logger.log_dir}/hparams.json")) == {"lr": 0.1, "opt": {"name": "adam"}}
    # versions are found by listing the store
    assert CSVLogger(root_url).version == 1
    following = CSVLogger(root_url, flush_logs_every_n_steps=1)
    following.log_metrics({"loss": 2.0}, step=0)
    assert names(f"{root_url}/fabric_logs") == ["version_0", "version_1"]
    assert CSVLogger(root_url).version == 2


@pytest.mark.timeout(60)
def test_csv_logger_continues_a_run_on_the_store(root_url: str) -> None:
    first = CSVLogger(root_url, version=3, flush_logs_every_n_steps=1)
    first.log_metrics({"loss": 1.0}, step=0)
    first.finalize("success")
    again = CSVLogger(root_url, version=3)
    again.log_metrics({"loss": 0.5, "acc": 0.9}, step=1)
    with pytest.warns(UserWarning, match="is continued"):
        again.finalize("success")
    assert csv_rows(again.metrics_file_path) == [{"step": "0", "loss": "1.0", "acc": ""}, {"step": "1", "loss": "0.5", "acc": "0.9"}]
    assert CSVLogger(root_url).version == 4


@pytest.mark.timeout(60)
def test_csv_logger_on_the_store_keeps_its_rows_when_a_write_fails(root_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import fabric.loggers.csv_logs as csv_logs

    logger = CSVLogger(root_url, flush_logs_every_n_steps=10)
    logger.log_metrics({"loss": 1.0}, step=0)

    def failing(path: str, text: str) -> None:
        raise ConnectionError("the store is gone")

    monkeypatch.setattr(csv_logs, "write_text", failing)
    with pytest.raises(ConnectionError):
        logger.save()
    monkeypatch.undo()
    logger.log_metrics({"loss": 0.5}, step=1)
    logger.save()
    assert [row["step"] for row in csv_rows(logger.metrics_file_path)] == ["0", "1"]


# ---- TensorBoardLogger --------------------------------------------------------------------------


def scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    if tag not in events.Tags()["scalars"]:
        return []
    return [(event.step, event.value) for event in events.Scalars(tag)]


@needs_tensorboard
@pytest.mark.timeout(60)
def test_tensorboard_logger_writes_to_the_store(root_url: str, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    logger = TensorBoardLogger(root_url, name="exp", sub_dir="train")
    assert logger.log_dir == f"{root_url}/exp/version_0/train"
    logger.log_metrics({"loss": torch.tensor(0.5)}, step=1)
    staging = Path(logger.experiment.log_dir)
    assert staging.is_dir() and not str(staging).startswith(str(tmp_path / "cwd"))
    # the version folder is on the store as soon as the writer exists: the next logger takes the next version
    assert TensorBoardLogger(root_url, name="exp").version == 1
    logger.log_metrics({"loss": 0.25, "pair": {"a": 1.0, "b": 2.0}}, step=2)
    logger.log_hyperparams({"lr": 0.1, "opt": {"name": "adam"}})
    logger.finalize("success")
    assert not staging.exists()  # uploaded, then removed

    local = download(f"{root_url}/exp/version_0", tmp_path / "down")
    assert scalars(local / "train", "loss") == [(1, 0.5), (2, 0.25)]
    assert [name for name in os.listdir(local / "train") if not name.startswith("events.out.tfevents.")] == ["pair_a", "pair_b"]
    events = EventAccumulator(str(local / "train"))
    events.Reload()
    content = events.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["lr"].number_value == 0.1 and start.hparams["opt/name"].string_value == "adam"


@needs_tensorboard
@pytest.mark.timeout(60)
def test_tensorboard_logger_uploads_on_save_and_every_flush_secs(root_url: str, tmp_path: Path) -> None:
    logger = TensorBoardLogger(root_url, flush_secs=3600)
    logger.log_metrics({"loss": 1.0}, step=0)
    assert scalars(download(logger.log_dir, tmp_path / "a"), "loss") == []  # not due yet: local only
    logger.save()
    assert scalars(download(logger.log_dir, tmp_path / "b"), "loss") == [(0, 1.0)]

    every_time = TensorBoardLogger(root_url, flush_secs=0)
    every_time.log_metrics({"loss": 2.0}, step=5)
    assert scalars(download(every_time.log_dir, tmp_path / "c"), "loss") == [(5, 2.0)]
    every_time.finalize("success")
    logger.finalize("success")


@needs_tensorboard
@pytest.mark.timeout(60)
def test_tensorboard_logger_keeps_the_local_files_when_the_store_fails(s3_bucket: str, empty_cwd: Path) -> None:
    logger = TensorBoardLogger("s3://no-such-bucket-fabric/logs")
    with pytest.raises(OSError, match=r"Could not upload the TensorBoard logs to 's3://no-such-bucket-fabric/logs/fabric_logs/version_0'"):
        logger.log_metrics({"loss": 1.0}, step=0)  # the first upload, as the writer is made
    logger = TensorBoardLogger(f"{s3_bucket}/logs")
    logger.log_metrics({"loss": 1.0}, step=0)
    staging = Path(logger.experiment.log_dir)
    import s3fs

    s3fs.S3FileSystem().rm(s3_bucket[len("s3://") :], recursive=True)  # the bucket goes away mid-run
    with pytest.raises(OSError, match=rf"kept in '{staging}'"):
        logger.finalize("success")
    assert any(name.startswith("events.out.tfevents.") for name in os.listdir(staging))
    import shutil

    shutil.rmtree(staging)


# ---- at exit ------------------------------------------------------------------------------------


@pytest.mark.procs
@needs_tensorboard
@pytest.mark.timeout(90)
def test_logs_reach_the_bucket_when_the_script_ends_without_finalize(s3_bucket: str, tmp_path: Path) -> None:
    code = (
        "import sys\nfrom fabric.loggers import CSVLogger, TensorBoardLogger\n"
        "csv_logger, tb = CSVLogger(sys.argv[1]), TensorBoardLogger(sys.argv[1], name='tb')\n"
        "for step in range(3):\n"
        "    csv_logger.log_metrics({'loss': step / 2}, step=step)\n"
        "    tb.log_metrics({'loss': step / 2}, step=step)\n"
    )
    run([PYTHON, "-c", code, f"{s3_bucket}/run"], timeout=80, cwd=tmp_path)  # the environment names the server
    assert os.listdir(tmp_path) == []
    assert csv_rows(f"{s3_bucket}/run/fabric_logs/version_0/metrics.csv") == [
        {"step": str(step), "loss": str(step / 2)} for step in range(3)]
    assert scalars(download(f"{s3_bucket}/run/tb/version_0", tmp_path / "down"), "loss") == [(0, 0.0), (1, 0.5), (2, 1.0)]
