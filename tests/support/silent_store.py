"""A store that never answers: a TCP server on 127.0.0.1 that accepts every connection and then says nothing.

A job pointed at it (``AWS_ENDPOINT_URL``, dummy credentials) hangs in its first request to ``s3://...``: the
upload that stops answering, which a rank must survive being told to stop (a second SIGTERM) and must not
outlive its launcher in. The server runs on daemon threads of the test process, for one ``with`` block.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: what a job needs to reach the server: dummy credentials, and a bound on store calls (where fabric has one)
#: far beyond any test's wait, so the request hangs for as long as the test looks at the job
_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                "FABRIC_STORE_TIMEOUT": "3600"}  # fmt: skip


@contextmanager
def silent_store() -> Iterator[dict[str, str]]:
    """Run the server while the block runs; yields the environment variables a job needs to use it."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    lock = threading.Lock()

    def accept() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:  # closed: the block is over
                return
            with lock:
                held.append(connection)  # kept open, never answered

    threading.Thread(target=accept, name="silent-store", daemon=True).start()
    try:
        yield {**_CREDENTIALS, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{listener.getsockname()[1]}"}
    finally:
        try:
            listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        listener.close()
        with lock:
            for connection in held:
                connection.close()
