"""Asynchronous saves: the training loop waits only while the state is copied to CPU memory.

At most one save is pending per process, waited for by the next save or load, the strategy's teardown and the end
of the program. A failure in the background is printed at once, raised by the next save/load/teardown, or reported
at exit with exit status 1: it is never lost. The publication is the write function's own, as in a synchronous save,
so a crash during a background write leaves the previous checkpoint whole. Background collectives use a gloo group
of their own, so they never interleave with the training loop's collectives on the default group.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

_pending: _BackgroundSave | None = None
_group: Any = None  # (the default group it was made beside, the background group)
_exit_hook_registered = False


class SaveHandle:
    """A save that may still be running: ``wait()`` returns when it is published, raising its error if any."""

    def wait(self) -> None:
        pass

    def done(self) -> bool:
        return True


def finished() -> SaveHandle:
    return SaveHandle()


class _BackgroundSave(SaveHandle):
    def __init__(self, write: Callable[[], None], description: str) -> None:
        self._write = write
        self._description = description
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="fabric-async-save", daemon=False)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._write()
        except BaseException as err:  # kept for the next save/exit; also shown now
            self._error = err
            print(f"[fabric] background save of {self._description} failed: {err}", file=sys.stderr, flush=True)

    def wait(self) -> None:
        self._thread.join()
        error, self._error = self._error, None  # raised once
        if error is not None:
            raise RuntimeError(f"The background save of {self._description} failed") from error

    def done(self) -> bool:
        return not self._thread.is_alive()


def background_group() -> Any:
    """The process group background saves talk over (created once, by every rank: a collective), or None."""
    global _group
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    if _group is None or _group[0] is not dist.group.WORLD:  # none yet, or made for a job that ended
        _group = (dist.group.WORLD, dist.new_group(backend="gloo"))
    return _group[1]


def start_background_save(write: Callable[[], None], description: str) -> SaveHandle:
    """Run ``write`` in a background thread as the one pending save of this process."""
    global _pending, _exit_hook_registered
    wait_for_pending_save()
    if not _exit_hook_registered:
        atexit.register(_wait_at_exit)
        _exit_hook_registered = True
    _pending = _BackgroundSave(write, description)
    return _pending


def save_in_background(checkpoint_io: Any, checkpoint: dict[str, Any], path: Any, shown: str, storage_options: Any = None) -> SaveHandle:
    """A single-file save through ``checkpoint_io`` of a CPU copy of ``checkpoint``'s tensors (and their containers;
    other values as they are at the call), in the background. ``shown``: the checkpoint's name without credentials."""
    from lightning_utilities.core.apply_func import apply_to_collection
    from torch import Tensor

    staged = apply_to_collection(checkpoint, Tensor, lambda tensor: tensor.detach().to("cpu", copy=True))
    return start_background_save(
        lambda: checkpoint_io.save_checkpoint(staged, path, storage_options=storage_options),
        repr(shown),  # printed and raised: never a URL's credentials
    )


def wait_for_pending_save() -> None:
    """Block until this process's pending background save is published; raise its error if it failed."""
    global _pending
    handle, _pending = _pending, None
    if handle is not None:
        handle.wait()


def _wait_at_exit() -> None:
    try:
        wait_for_pending_save()
    except RuntimeError as err:
        print(f"[fabric] {err}: {err.__cause__}", file=sys.stderr, flush=True)
        os._exit(1)
