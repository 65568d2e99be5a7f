"""Every call to a store has a bound (``fabric._core.urls``: ``FABRIC_STORE_TIMEOUT``, else ``STORE_TIMEOUT_S``): on a
filesystem that never answers (``support/stalled_fs.py``) each call ends at the bound with ``StoreTimeoutError``, its
request cancelled on fsspec's event loop (nothing left running), and the checkpoint and logger calls above it say which
URL and what they were doing. The same against a real S3 server that is paused or cut off: ``test_stalled_stores.py``."""

from __future__ import annotations

import time

import pytest

from fabric._core import urls
from fabric._core.urls import StoreTimeoutError, filesystem

pytestmark = pytest.mark.usefixtures("clean_fabric_env")

pytest.importorskip("fsspec")


@pytest.fixture
def stalled() -> type:
    from support.stalled_fs import StalledFileSystem, register

    register()
    StalledFileSystem.started = StalledFileSystem.cancelled = 0
    return StalledFileSystem


def all_cancelled(stalled: type) -> bool:
    deadline = time.monotonic() + 5
    while stalled.cancelled < stalled.started and time.monotonic() < deadline:
        time.sleep(0.01)
    return stalled.cancelled == stalled.started > 0


@pytest.mark.parametrize("value", ["abc", "0", "-3", "nan", "inf"])
def test_a_bad_store_timeout_is_refused_by_name(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FABRIC_STORE_TIMEOUT", value)
    with pytest.raises(ValueError, match=rf"FABRIC_STORE_TIMEOUT='{value}' is not valid; accepted: a number of seconds > 0"):
        filesystem("memory://fabric-bounds/x.pt")


def test_the_bound_is_the_variable_else_the_module_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert urls.store_timeout() == urls.STORE_TIMEOUT_S == 60
    monkeypatch.setattr(urls, "STORE_TIMEOUT_S", 7.5)
    assert urls.store_timeout() == 7.5
    monkeypatch.setenv("FABRIC_STORE_TIMEOUT", "2")
    assert urls.store_timeout() == 2


@pytest.mark.timing
@pytest.mark.timeout(60)
def test_every_call_to_a_store_that_never_answers_ends_at_the_bound_and_leaves_nothing_running(
    stalled: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(urls, "STORE_TIMEOUT_S", 0.5)
    fs, path = filesystem("stalled://bucket/run/ckpt.pt")
    calls = {
        "cat_file": lambda: fs.cat_file(path),
        "pipe_file": lambda: fs.pipe_file(path, b"x"),
        "ls": lambda: fs.ls("bucket/run"),
        "info": lambda: fs.info(path),
        "rm_file": lambda: fs.rm_file(path),
    }
    for name, call in calls.items():
        started = time.monotonic()
        with pytest.raises(StoreTimeoutError, match=r"no answer from the store within 0.5 s \(FABRIC_STORE_TIMEOUT sets the bound\)"):
            call()
        assert time.monotonic() - started < 2.5, name
    assert all_cancelled(stalled), (stalled.started, stalled.cancelled)


@pytest.mark.timing
@pytest.mark.timeout(60)
def test_loads_saves_and_listings_on_a_store_that_never_answers_name_the_url_and_what_was_done(
    stalled: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fabric.loggers import CSVLogger
    from fabric.plugins.io import TorchCheckpointIO, safe_load

    monkeypatch.setenv("FABRIC_STORE_TIMEOUT", "0.5")
    url = "stalled://user:secret-token-123@bucket/run/ckpt.pt"  # a password in the URL: never shown
    shown = "stalled://user:***@bucket/run/ckpt.pt"
    calls = [
        (lambda: safe_load(url), f"Could not read the checkpoint '{shown}'"),
        (lambda: TorchCheckpointIO().save_checkpoint({"v": 1}, url), f"Could not save the checkpoint '{shown}'"),
        (lambda: TorchCheckpointIO().remove_checkpoint(url), f"Could not remove the checkpoint '{shown}'"),
        (lambda: CSVLogger("stalled://bucket/logs").version, "Could not list the log folder 'stalled://bucket/logs/fabric_logs'"),
    ]
    for call, named in calls:
        started = time.monotonic()
        with pytest.raises(TimeoutError) as raised:
            call()
        assert time.monotonic() - started < 2.5, named
        assert str(raised.value).startswith(named) and "no answer from the store within 0.5 s" in str(raised.value)
        assert "secret-token" not in str(raised.value)
    assert all_cancelled(stalled), (stalled.started, stalled.cancelled)
