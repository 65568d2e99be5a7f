"""No credential of a URL in any text fabric makes or passes on, and our own errors for URLs that name no usable store.

A URL may carry credentials (``s3://KEY:SECRET@bucket/...``, a signed URL's query). Every failing path is driven
with one, against a real S3 server (moto's, on 127.0.0.1: s3fs takes ``KEY:SECRET@bucket`` for a bucket name and
botocore's error repeats it), and the secret must be in none of what a user sees: the error's message, its
whole traceback (chained causes included), its repr, what was printed, the warnings, and the line a logger
prints when the process ends. Then the URLs that name no usable store (empty, ``s3://`` alone, a read-only
``https://`` to write to): refused by name before anything is written.
"""

from __future__ import annotations

import os
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from fabric import Fabric
from fabric._core.urls import redact
from support import PYTHON
from support.processes import run

pytestmark = pytest.mark.usefixtures("clean_fabric_env")

fsspec = pytest.importorskip("fsspec")

KEY = "AKIAFABRICTESTKEY"
# an AWS-like secret key: a "/" in it splits it where s3fs splits a bucket from a key, so errors show its first part
SLASHED = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYFABRICSECRET"
PLAIN = "fabricPlainSecretValue42"


def pieces(secret: str) -> list[str]:
    """The secret, and the parts of it a library may show alone."""
    return [secret, *secret.split("/")]


def shown_by(action: Callable[[], object], capsys: pytest.CaptureFixture[str]) -> tuple[BaseException | None, str]:
    """Run ``action``: its error, and every text a user would see of it: the message, the whole traceback with its
    chained causes (as Python prints it), the repr, what was printed to stdout and stderr, and the warnings."""
    error: BaseException | None = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            action()
        except Exception as err:
            error = err
    out, err_text = capsys.readouterr()
    texts = [out, err_text, *(f"{warning.category.__name__}: {warning.message}" for warning in caught)]
    if error is not None:
        texts += [str(error), repr(error), "".join(traceback.format_exception(error))]
    return error, "\n".join(texts)


def assert_hidden(text: str, secret: str) -> None:
    for piece in pieces(secret):
        assert piece not in text, f"the secret {piece!r} is shown:\n{text}"


@pytest.fixture
def empty_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The test runs in an empty folder, which must stay empty: a URL taken for a local path would show up here."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    yield cwd
    assert sorted(os.listdir(cwd)) == []


def cpu_fabric() -> Fabric:
    return Fabric(accelerator="cpu", devices=1)


# ---- redact, scrub, without_secrets ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("simplecache::s3://KEY:topsecret@bucket/x.pt", "simplecache::s3://KEY:***@bucket/x.pt"),
        ("s3://KEY:topsecret@bucket", "s3://KEY:***@bucket"),
        (f"s3://{KEY}:{SLASHED}@bucket/run/x.pt", f"s3://{KEY}:***@bucket/run/x.pt"),
        ("https://user:pw@host/x?sig=1", "https://user:***@host/x?***"),
        ("https://user:pw@host:8443/x?X-Amz-Signature=abcdef#part", "https://user:***@host:8443/x?***#part"),
        ("zip://inner.pt::s3://KEY:topsecret@bucket/a.zip", "zip://inner.pt::s3://KEY:***@bucket/a.zip"),
        # nothing secret: kept as written
        ("s3://bucket/run@v1/ckpt.pt", "s3://bucket/run@v1/ckpt.pt"),
        ("abfs://container@account.dfs.core.windows.net/ckpt.pt", "abfs://container@account.dfs.core.windows.net/ckpt.pt"),
        ("s3://", "s3://"),
        ("memory://run/x.pt", "memory://run/x.pt"),
    ],
)
def test_redact_hides_every_password_and_query(url: str, shown: str) -> None:
    assert redact(url) == shown


def test_scrub_removes_the_secret_and_the_parts_a_library_shows() -> None:
    from fabric._core.urls import scrub, secrets_of

    url = f"s3://{KEY}:{SLASHED}@bucket/x.pt?token=abcdefgh"
    botocore = f'Invalid bucket name "{KEY}:{SLASHED.split("/")[0]}": Bucket name must match the regex'
    assert scrub(botocore, url) == f'Invalid bucket name "{KEY}:***": Bucket name must match the regex'
    assert scrub(f"could not open {url}", url) == f"could not open s3://{KEY}:***@bucket/x.pt?***"
    assert scrub("abcdefgh expired", url) == "*** expired"
    assert secrets_of("s3://bucket/x.pt") == [] and scrub("s3://bucket/x.pt", "s3://bucket/x.pt") == "s3://bucket/x.pt"


def test_without_secrets_keeps_a_clean_error_and_copies_a_leaking_one() -> None:
    from fabric._core.urls import without_secrets

    url = f"s3://{KEY}:{PLAIN}@bucket/x.pt"
    clean = FileNotFoundError("The specified bucket does not exist")
    assert without_secrets(clean, url) is clean

    class LibraryError(Exception):
        def __init__(self, **fields: str) -> None:  # a library's class that takes no bare message (botocore's)
            super().__init__(f"Invalid bucket name {fields['bucket']!r}")

    try:
        try:
            raise LibraryError(bucket=f"{KEY}:{PLAIN}@bucket")
        except LibraryError as inner:
            raise PermissionError(f"denied: {KEY}:{PLAIN}@bucket/x.pt") from inner
    except PermissionError as err:
        leaking = err
    copy = without_secrets(leaking, url)
    assert isinstance(copy, PermissionError) and copy.__cause__ is None and copy.__context__ is None
    assert str(copy) == f"denied: {KEY}:***@bucket/x.pt"
    cause = without_secrets(leaking.__cause__, url)  # type: ignore[arg-type]
    assert type(cause).__name__ == "LibraryError" and str(cause) == f"Invalid bucket name '{KEY}:***@bucket'"
    assert_hidden("".join(traceback.format_exception(copy)) + "".join(traceback.format_exception(cause)), PLAIN)


# ---- every failing path, with the secret in the URL, against a real S3 server ------------------------


@pytest.fixture(
    params=[("s3", SLASHED), ("s3", PLAIN), ("simplecache::s3", SLASHED)], ids=["slashed-secret", "plain-secret", "chained-url"]
)
def secret_url(request: pytest.FixtureRequest, s3_bucket: str, empty_cwd: Path) -> tuple[str, str]:
    """(a folder of a real bucket named with credentials in its URL, the secret)."""
    scheme, secret = request.param
    return f"{scheme}://{KEY}:{secret}@{s3_bucket[len('s3://'):]}/run", secret


def test_save_and_load_of_a_file(secret_url: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    from fabric.checkpoint.async_save import wait_for_pending_save

    folder, secret = secret_url
    url = f"{folder}/ckpt.pt"
    fabric, net = cpu_fabric(), nn.Linear(2, 2)
    for action, said in [
        (lambda: fabric.save(url, {"model": net}), "Could not save the checkpoint"),
        (lambda: fabric.load(url, {"model": net}), "Could not read the checkpoint"),
        (lambda: fabric.load(url), "Could not read the checkpoint"),
        (lambda: fabric.load_raw(url, net), "Could not read the checkpoint"),
        (lambda: (fabric.save(url, {"model": net}, async_save=True), wait_for_pending_save()), "background save"),
    ]:
        error, text = shown_by(action, capsys)
        assert_hidden(text, secret)
        assert isinstance(error, OSError | RuntimeError) and said in text and f"{KEY}:***@" in text, text


def test_sharded_save_and_load(secret_url: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    from fabric.checkpoint.formats import load_sharded
    from fabric.checkpoint.formats.sharded import save_sharded

    folder, secret = secret_url
    url = f"{folder}/sharded"
    net = nn.Linear(2, 2)
    for action, said in [
        (lambda: save_sharded(url, {"model": net}), "Saving the sharded checkpoint"),
        (lambda: load_sharded(url, {"model": net}), "Could not read the checkpoint"),
        (lambda: load_sharded(url), "Could not read the checkpoint"),
    ]:
        error, text = shown_by(action, capsys)
        assert_hidden(text, secret)
        assert error is not None and said in text and f"{KEY}:***@" in text, text


def test_consolidate(secret_url: tuple[str, str], capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from fabric.checkpoint.formats.sharded import save_sharded
    from fabric.consolidate import consolidate, main

    folder, secret = secret_url
    local = tmp_path / "local-sharded"
    save_sharded(local, {"model": nn.Linear(2, 2)})
    out = tmp_path / "out.pt"
    for action in [
        lambda: consolidate(f"{folder}/sharded", out),
        lambda: consolidate(local, f"{folder}/out.pt"),
    ]:
        error, text = shown_by(action, capsys)
        assert_hidden(text, secret)
        assert isinstance(error, OSError) and f"{KEY}:***@" in text, text
    for argv in ([f"{folder}/sharded", str(out)], [str(local), f"{folder}/out.pt"]):
        assert main(argv) == 1
        _, text = shown_by(lambda: None, capsys)
        assert_hidden(text, secret)
        assert "fabric-torch consolidate: error:" in text and f"{KEY}:***@" in text, text
    assert not out.exists()


def test_loggers(secret_url: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    from fabric.loggers import CSVLogger, TensorBoardLogger

    folder, secret = secret_url
    csv_logger = CSVLogger(folder, flush_logs_every_n_steps=1)
    actions: list[Callable[[], object]] = [
        lambda: csv_logger.log_metrics({"loss": 1.0}, step=0),
        lambda: csv_logger.log_hyperparams({"lr": 0.1}),
        lambda: csv_logger.finalize("success"),
    ]
    loggers: list[object] = [csv_logger]
    try:
        tensorboard = TensorBoardLogger(folder, version=0)
    except ImportError:  # tensorboard is not installed
        pass
    else:
        loggers.append(tensorboard)
        actions.append(lambda: tensorboard.log_metrics({"loss": 1.0}, step=0))
    for action in actions:
        error, text = shown_by(action, capsys)
        assert_hidden(text, secret)
        assert isinstance(error, OSError) and f"{KEY}:***@" in text, text
    for logger in loggers:
        assert_hidden(repr(logger), secret)
        assert f"{KEY}:***@" in repr(logger)
    csv_logger._rows = []  # what it could not write is not this test's to write at exit


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_the_line_a_logger_prints_at_exit(s3_bucket: str, tmp_path: Path) -> None:
    """A script logs to a URL with credentials that the store refuses and ends without ``finalize``: the logger's
    last write fails as the process ends, and the line saying so names the URL without the secret."""
    url = f"s3://{KEY}:{SLASHED}@{s3_bucket[len('s3://'):]}/run"
    code = (
        "import sys, traceback\nfrom fabric.loggers import CSVLogger, TensorBoardLogger\n"
        "csv_logger = CSVLogger(sys.argv[1])\n"
        "csv_logger.log_metrics({'loss': 0.5}, step=0)\n"  # buffered: written as the process ends
        "try:\n"
        "    TensorBoardLogger(sys.argv[1], name='tb').log_metrics({'loss': 0.5}, step=0)\n"
        "except ImportError:\n"
        "    pass\n"
        "except OSError:\n"
        "    traceback.print_exc()\n"
    )
    result = run([PYTHON, "-c", code, url], timeout=100, cwd=tmp_path)  # the environment names the server
    assert_hidden(result.stdout + result.stderr, SLASHED)
    assert "[fabric] could not write CSVLogger's last data at exit" in result.stderr, result.stderr
    assert f"{KEY}:***@" in result.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.usefixtures("empty_cwd")
def test_a_library_that_repeats_the_url_in_its_errors(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Where the store fails after the data is written (the commit record), and its library names the path."""
    from fsspec.implementations.memory import MemoryFileSystem

    from fabric.checkpoint.formats.sharded import save_sharded
    from fabric.loggers import CSVLogger

    def refusing(self: object, path: str, *args: object, **kwargs: object) -> None:
        raise PermissionError(f"access denied to {path}")

    import secrets

    folder = f"memory://user:{PLAIN}@fabric-tests-{secrets.token_hex(4)}"
    net = nn.Linear(2, 2)
    csv_logger = CSVLogger(folder, flush_logs_every_n_steps=1)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(MemoryFileSystem, "pipe_file", refusing)
            for action in [
                lambda: cpu_fabric().save(f"{folder}/ckpt.pt", {"model": net}),
                lambda: save_sharded(f"{folder}/sharded", {"model": net}),
                lambda: csv_logger.log_metrics({"loss": 1.0}, step=0),
            ]:
                error, text = shown_by(action, capsys)
                assert_hidden(text, PLAIN)
                assert isinstance(error, OSError | RuntimeError) and "access denied to" in text and "user:***@" in text, text
    finally:
        csv_logger._rows = []  # nothing left to write at exit
        fs = fsspec.filesystem("memory")
        if fs.exists(folder[len("memory://") :]):
            fs.rm(folder[len("memory://") :], recursive=True)


# ---- URLs that name no usable store: our error, naming the URL (redacted) and what is accepted -----------


def test_an_empty_checkpoint_path_is_refused(empty_cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fabric.consolidate import main
    from fabric.plugins.io import atomic_save, safe_load

    fabric, net = cpu_fabric(), nn.Linear(2, 2)
    for action in [lambda: fabric.save("", {"model": net}), lambda: fabric.load("", {"model": net}),
                   lambda: atomic_save({"a": 1}, ""), lambda: safe_load("")]:
        with pytest.raises(ValueError, match=r"The checkpoint path is empty\. Accepted: a file or folder path, or a URL"):
            action()
    assert main(["", "out.pt"]) == 1
    assert "The checkpoint path is empty" in capsys.readouterr().err


NO_PLACE = ["s3://", "memory://", "memory:///", "simplecache::s3://", f"s3://{KEY}:{PLAIN}@"]


@pytest.mark.parametrize("url", NO_PLACE)
def test_a_url_naming_no_place_on_its_store_is_refused(empty_cwd: Path, url: str, capsys: pytest.CaptureFixture[str]) -> None:
    from fabric.consolidate import main
    from fabric.loggers import CSVLogger, TensorBoardLogger

    said = f"{redact(url)!r} names a store but no place on it. Accepted: a local path, or a URL with a bucket or folder"
    fabric, net = cpu_fabric(), nn.Linear(2, 2)
    actions: list[Callable[[], object]] = [
        lambda: fabric.save(url, {"model": net}), lambda: fabric.load(url, {"model": net}), lambda: CSVLogger(url),
    ]
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        pass
    else:
        actions.append(lambda: TensorBoardLogger(url))
    for action in actions:
        error, text = shown_by(action, capsys)
        assert isinstance(error, ValueError), text
        assert said in str(error), str(error)
        assert_hidden(text, PLAIN)
    assert main([url, "out.pt"]) == 1 and main(["ckpt", url]) == 1
    printed = capsys.readouterr().err
    assert printed.count("names a store but no place on it") == 2, printed
    assert_hidden(printed, PLAIN)


READ_ONLY = [f"https://user:{PLAIN}@example.invalid/run/ckpt.pt", "http://example.invalid/run/ckpt.pt",
             "simplecache::https://example.invalid/run/ckpt.pt"]


@pytest.mark.parametrize("url", READ_ONLY)
def test_a_read_only_store_is_refused_for_writing(empty_cwd: Path, url: str, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("aiohttp")  # fsspec's http:// filesystem
    from fabric.checkpoint.formats.sharded import save_sharded
    from fabric.consolidate import main
    from fabric.loggers import CSVLogger
    from fabric.plugins.io import TorchCheckpointIO, atomic_save

    scheme = "https" if "https://" in url else "http"
    fabric, net = cpu_fabric(), nn.Linear(2, 2)
    for action in [
        lambda: fabric.save(url, {"model": net}),
        lambda: atomic_save({"a": torch.ones(1)}, url),
        lambda: save_sharded(url, {"model": net}),
        lambda: TorchCheckpointIO().remove_checkpoint(url),
        lambda: CSVLogger(url),
    ]:
        error, text = shown_by(action, capsys)
        assert isinstance(error, ValueError), text
        assert f"{redact(url)!r}: {scheme}:// can only be read. Accepted: a local path, or a URL of a store that can be written" in str(error)
        assert_hidden(text, PLAIN)
    assert main(["ckpt", url]) == 1
    printed = capsys.readouterr().err
    assert "can only be read" in printed
    assert_hidden(printed, PLAIN)
