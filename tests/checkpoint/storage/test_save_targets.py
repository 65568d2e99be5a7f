"""Where a checkpoint may be written, and what the user sees when the disk refuses the write.

A save replaces only a regular file: a device node, a FIFO or a socket at the target is refused
before anything is written (a rename would silently swap /dev/full for a regular file). A real write
error (file too large through RLIMIT_FSIZE, disk full on a tiny tmpfs) names the checkpoint path,
never the hidden temporary file, and leaves the previous checkpoint as it was.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch

from fabric import Fabric
from fabric.plugins.io import atomic_save, safe_load

pytestmark = pytest.mark.usefixtures("clean_fabric_env")


def _no_temp_files(folder: Path) -> bool:
    return not list(folder.glob(".fabric-tmp-*"))


def test_a_fifo_is_refused_and_left_alone(tmp_path: Path) -> None:
    fifo = tmp_path / "ckpt.pt"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=r"ckpt\.pt'.*a FIFO.*accepted: a regular file"):
        atomic_save({"step": 1}, fifo)
    assert fifo.is_fifo()
    assert _no_temp_files(tmp_path)


def test_a_socket_is_refused(tmp_path: Path) -> None:
    # AF_UNIX paths are short: a socket in a short folder of its own
    path = Path("/tmp") / f"fabric-sock-{uuid.uuid4().hex[:8]}"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
        try:
            with pytest.raises(ValueError, match="is a socket"):
                atomic_save({"step": 1}, path)
            assert path.is_socket()
        finally:
            path.unlink()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_device_node_is_refused_through_fabric_save(tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    with pytest.raises(ValueError, match=r"'/dev/full'.*a character device"):
        fabric.save("/dev/full", {"w": torch.ones(2)})
    assert Path("/dev/full").is_char_device()


def test_a_symlink_to_a_device_is_refused(tmp_path: Path) -> None:
    link = tmp_path / "ckpt.pt"
    link.symlink_to("/dev/null")
    with pytest.raises(ValueError, match="a character device"):
        atomic_save({"step": 1}, link)
    assert link.is_symlink()


def test_a_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(IsADirectoryError, match="it is a folder"):
        atomic_save({"step": 1}, tmp_path)


_TOO_LARGE = textwrap.dedent(
    """
    import resource, signal, sys, torch
    from fabric.plugins.io import atomic_save
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    try:
        atomic_save({"w": torch.zeros(1 << 20)}, sys.argv[1])  # 4 MB > the 1 MB limit
    except OSError as err:
        print(f"{type(err).__name__}|{err.errno}|{err}")
    """
)


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_file_too_large_names_the_target_and_keeps_the_old_checkpoint(tmp_path: Path, subprocess_env) -> None:
    path = tmp_path / "ckpt.pt"
    atomic_save({"version": 1}, path)
    result = subprocess.run([sys.executable, "-c", _TOO_LARGE, str(path)], env=subprocess_env, capture_output=True,
                            text=True, timeout=50)
    assert result.returncode == 0, result.stderr
    _, code, message = result.stdout.strip().split("|", 2)
    assert int(code) == errno.EFBIG, result.stdout
    assert str(path) in message and ".fabric-tmp" not in message, message
    assert safe_load(path) == {"version": 1}
    assert _no_temp_files(tmp_path)


@pytest.fixture
def tiny_tmpfs(tmp_path: Path):
    """A 1 MB tmpfs (mounting needs root; elsewhere the file-too-large test covers the write error path)."""
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)], capture_output=True,
                            text=True, timeout=30)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (not root?): {result.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], capture_output=True, timeout=30)


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_disk_full_names_the_target_and_keeps_the_old_checkpoint(tiny_tmpfs: Path) -> None:
    path = tiny_tmpfs / "ckpt.pt"
    atomic_save({"version": 1, "w": torch.ones(16)}, path)
    before = path.read_bytes()
    fabric = Fabric(accelerator="cpu", devices=1)
    with pytest.raises(OSError, match=r"ckpt\.pt'.*No space left on device") as caught:
        fabric.save(path, {"w": torch.zeros(1 << 20)})  # 4 MB on a 1 MB disk
    assert caught.value.errno == errno.ENOSPC
    assert ".fabric-tmp" not in str(caught.value)
    assert path.read_bytes() == before
    assert _no_temp_files(tiny_tmpfs)
