"""A real S3-compatible server for tests: moto's server mode on a free port of 127.0.0.1, reached by s3fs over HTTP.

Fixtures (registered for every test module by the root conftest; moto and s3fs are imported only when used):

- ``moto_s3``: the server, one per test module, with dummy credentials and ``AWS_ENDPOINT_URL`` in the
  environment while it runs (processes a test starts inherit them, so a job reaches the same server);
- ``s3_bucket``: a new, empty bucket on it, as ``s3://NAME``.

The server runs in the test process's threads: a job the test kills (SIGKILL) leaves the server and the
bucket as they were.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from typing import Any

import pytest

from support.environment import free_port

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
VARIABLES = [*CREDENTIALS, "AWS_ENDPOINT_URL"]


class MotoS3:
    """moto's S3 server on 127.0.0.1 (``start``/``stop``); ``endpoint`` is its URL."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self._server.stop()

    def environment(self) -> dict[str, str]:
        """What a client (this process or a job) needs to reach the server."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}

    def new_bucket(self) -> str:
        import s3fs

        name = f"fabric-{secrets.token_hex(4)}"
        s3fs.S3FileSystem(endpoint_url=self.endpoint).mkdir(name)
        return f"s3://{name}"


def forget_filesystems() -> None:
    """s3fs keeps one filesystem per set of options: a new endpoint must not meet an old instance."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="module")
def moto_s3() -> Iterator[MotoS3]:
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    saved = {name: os.environ.get(name) for name in VARIABLES}
    server = MotoS3()
    server.start()
    os.environ.update(server.environment())
    forget_filesystems()
    try:
        yield server
    finally:
        try:
            server.stop()
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            forget_filesystems()


@pytest.fixture
def s3_bucket(moto_s3: MotoS3, monkeypatch: pytest.MonkeyPatch) -> str:
    # a fixture that restores the environment after each test (clean_fabric_env) must find the variables set
    for name, value in moto_s3.environment().items():
        monkeypatch.setenv(name, value)
    return moto_s3.new_bucket()


def s3_objects(url: str) -> dict[str, Any]:
    """Every object under ``url`` (a bucket or a folder in it): path -> size, read from the server (no cache)."""
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    path = url[len("s3://") :]
    return {name: info["size"] for name, info in fs.find(path, detail=True).items()}
