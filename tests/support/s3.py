"""A real S3-compatible server for tests: moto's server mode on a free port of 127.0.0.1, reached by s3fs over HTTP.

Fixtures (registered for every test module by the root conftest; moto and s3fs are imported only when used):

- ``moto_s3``: the server, one per test module, with dummy credentials and ``AWS_ENDPOINT_URL`` in the
  environment while it runs (processes a test starts inherit them, so a job reaches the same server);
- ``s3_bucket``: a new, empty bucket on it, as ``s3://NAME``.

The server runs in the test process's threads: a job the test kills (SIGKILL) leaves the server and the
bucket as they were.

For a store that stops answering, ``s3_process``: moto's server in a process of its own (one per test module), which
a test pauses (``pause``: SIGSTOP, ``resume``: SIGCONT) and reaches through a TCP proxy of its own (``proxy()``) that
it can cut (``TcpProxy.cut``: every connection reset and the port closed, as when a proxy process is killed).
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from support import PYTHON
from support.environment import clean_env, free_port

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


# ---- a server in a process of its own, paused or cut off ---------------------------------------------------------


class TcpProxy:
    """A TCP proxy on a free port of 127.0.0.1 in front of ``target_port``, run by daemon threads of the test process.
    ``sent``: the bytes passed on from clients to the server so far. ``cut()`` resets every connection and closes the
    port (a connect is refused from then on), as killing a proxy process does."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.sent = 0
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._cut = False
        threading.Thread(target=self._accept, name="s3-proxy-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # cut
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._cut:
                    client.close()
                    upstream.close()
                    return
                self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket, counted: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                target.sendall(data)
                if counted:
                    with self._lock:
                        self.sent += len(data)
        except OSError:
            pass
        finally:
            for sock in (source, target):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def wait_sent(self, nbytes: int, timeout: float) -> None:
        """Return once ``nbytes`` have been passed on to the server; fail the test after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while self.sent < nbytes:
            if time.monotonic() > deadline:
                raise AssertionError(f"the proxy passed on {self.sent} bytes within {timeout} s, not {nbytes}")
            time.sleep(0.005)

    def cut(self) -> None:
        with self._lock:
            self._cut = True
            sockets, self._sockets = self._sockets, []
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        except OSError:
            pass
        self._listener.close()
        for sock in sockets:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = reset
                sock.shutdown(socket.SHUT_RDWR)  # wakes the pumping threads
            except OSError:
                pass
            sock.close()


class S3Process:
    """moto's S3 server in a process of its own on 127.0.0.1 (``endpoint``), never a warm worker: a SIGSTOP must
    stop the server itself. ``proxy()``: a new :class:`TcpProxy` in front of it."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        env = clean_env(TEST_WARM_RANKS="0")
        self._process = subprocess.Popen(
            [PYTHON, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        self._proxies: list[TcpProxy] = []
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise AssertionError(f"moto's server did not start on port {self.port}") from None
                time.sleep(0.1)

    @property
    def pid(self) -> int:
        return self._process.pid

    def environment(self, endpoint: str | None = None) -> dict[str, str]:
        """What a client needs to reach the server (through ``endpoint``: a proxy's, else the server's own)."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint or self.endpoint}

    def proxy(self) -> TcpProxy:
        proxy = TcpProxy(self.port)
        self._proxies.append(proxy)
        return proxy

    def pause(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def new_bucket(self) -> str:
        import s3fs

        name = f"fabric-{secrets.token_hex(4)}"
        key, secret = CREDENTIALS["AWS_ACCESS_KEY_ID"], CREDENTIALS["AWS_SECRET_ACCESS_KEY"]
        s3fs.S3FileSystem(endpoint_url=self.endpoint, key=key, secret=secret, skip_instance_cache=True).mkdir(name)
        return f"s3://{name}"

    def stop(self) -> None:
        for proxy in self._proxies:
            proxy.cut()
        if self._process.poll() is None:
            self.resume()
            self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(10)


@pytest.fixture(scope="module")
def s3_process() -> Iterator[S3Process]:
    """moto's S3 server in a process of its own, one per test module (see the module docstring); resumed after each
    test that paused it by the test itself (``try``/``finally``)."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    server = S3Process()
    try:
        yield server
    finally:
        server.stop()
