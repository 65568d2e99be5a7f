"""How a replica group that comes back copies its state from a live peer: HTTP on the job's address, behind its secret.

torchft's ``Manager`` takes the transfer as a :class:`~torchft.checkpointing.CheckpointTransport`. Its own HTTP
transport listens on every interface and serves the model's weights and optimizer state to whoever asks. This
one is handed to the ``Manager`` in its place:

* it listens on one address, the job's (loopback when every group runs on this machine), never on every interface;
* it answers only a request that carries the job's secret (:data:`SECRET_HEADER`, compared in constant time); any
  other request gets 403 and nothing else. The secret never appears in a URL: the address a healing rank asks
  for (torchft passes it between groups through its managers, and logs it) is the bare ``http://HOST:PORT/...``;
* a request for a step waits (up to the transfer's timeout) until the state of that step is staged, and the
  trainer does not change the state while a transfer reads it (:meth:`disallow_checkpoint` waits for readers).

The state travels as ``torch.save`` writes it and is read back with ``weights_only=True``: the healing state is
tensors, numbers and lists only.
"""

from __future__ import annotations

import hmac
import io
import socket
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from torch.utils._pytree import tree_map
from torchft.checkpointing.transport import CheckpointTransport

__all__ = ["SECRET_HEADER", "HealingTransferError", "HealingTransport"]

#: The request header that carries the job's secret.
SECRET_HEADER = "X-Fabric-Job-Secret"
_PATH = "/fabric/healing/"


class HealingTransferError(RuntimeError):
    """A healing transfer failed: refused (another job's secret), timed out, or the peer went away."""


class HealingTransport(CheckpointTransport[Any]):
    """Serves this rank's healing state to the same rank of a group that comes back, and fetches a peer's.

    Args:
        host: the address to listen on (an IP address of this machine: the job's address).
        secret: the job's secret; requests without it are refused.
        timeout: how long a request, a wait for a staged step, or a transfer may take.
    """

    def __init__(self, host: str, secret: str, timeout: timedelta) -> None:
        if not secret:
            raise ValueError("the healing transfer needs the job's secret; got an empty one")
        self._secret = secret.encode()
        self._timeout = timeout.total_seconds()
        self._changed = threading.Condition()
        self._step: int | None = None  # the staged step, None while the trainer may change the state
        self._state: Any = None
        self._readers = 0
        self._server = _Server(host, self)
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.1,), name="fabric-healing-server", daemon=True)
        self._thread.start()

    # ---- the serving side ----------------------------------------------------------------------------

    def metadata(self) -> str:
        """Where a healing peer fetches this rank's state (the step is appended): no secret in it."""
        host, port = str(self._server.server_address[0]), int(self._server.server_address[1])
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}{_PATH}"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        """Stage ``state_dict`` (on the CPU) as the state of ``step``; requests for it are served from now on."""
        staged = tree_map(lambda value: value.detach().cpu() if isinstance(value, torch.Tensor) else value, state_dict)
        with self._changed:
            self._state, self._step = staged, step
            self._changed.notify_all()

    def disallow_checkpoint(self) -> None:
        """The trainer is about to change the state: no new transfer starts, and the ones under way finish first."""
        deadline = time.monotonic() + self._timeout
        with self._changed:
            self._step = None
            while self._readers and self._changed.wait(max(deadline - time.monotonic(), 0.0)):
                pass
            self._state = None

    def _serve(self, handler: BaseHTTPRequestHandler) -> None:
        if not hmac.compare_digest(handler.headers.get(SECRET_HEADER, "").encode(), self._secret):
            handler.send_error(403, "this server answers only requests of its own job")
            return
        step_text = handler.path[len(_PATH):] if handler.path.startswith(_PATH) else ""
        if not step_text.isdigit():
            handler.send_error(404)
            return
        step = int(step_text)
        deadline = time.monotonic() + self._timeout
        with self._changed:
            while self._step != step:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    handler.send_error(409, f"step {step} is not staged here (serving {self._step})")
                    return
                self._changed.wait(remaining)
            state = self._state
            self._readers += 1
        try:
            handler.send_response(200)
            handler.send_header("Content-Type", "application/octet-stream")
            handler.end_headers()
            torch.save(state, handler.wfile)  # type: ignore[arg-type]  # a binary stream, written in order
        finally:
            with self._changed:
                self._readers -= 1
                self._changed.notify_all()

    # ---- the fetching side -----------------------------------------------------------------------------

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        """The state of ``step`` from the peer at ``metadata`` (its :meth:`metadata`), with the job's secret."""
        request = urllib.request.Request(f"{metadata}{step}", headers={SECRET_HEADER: self._secret.decode()})
        try:
            with urllib.request.urlopen(request, timeout=timeout.total_seconds()) as response:
                data = io.BytesIO(response.read())
        except urllib.error.HTTPError as err:
            raise HealingTransferError(
                f"the peer at {metadata} refused the healing transfer of step {step} ({err.code} {err.reason})"
            ) from None
        except (OSError, TimeoutError) as err:
            raise HealingTransferError(f"the healing transfer of step {step} from {metadata} failed: {err}") from None
        return torch.load(data, weights_only=True, map_location="cpu")

    def shutdown(self, wait: bool = True) -> None:
        """Stop listening (``wait``: and return once the server's thread has ended)."""
        self._server.shutdown()  # returns within the serving loop's poll interval (0.1 s)
        self._server.server_close()
        if wait:
            self._thread.join()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, transport: HealingTransport) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        transport_ref = transport

        class Handler(BaseHTTPRequestHandler):
            timeout = transport._timeout  # a request that stalls ends, never a thread for ever

            def do_GET(self) -> None:
                transport_ref._serve(self)

            def log_message(self, format: str, *args: Any) -> None:  # one line per request on stderr: not ours to print
                pass

        super().__init__((host, 0), Handler)
