"""Paths and arguments a checkpoint call refuses before it opens or writes anything, with an error that
names the checkpoint and the reason (never a raw OSError naming our temporary file, never a hang).

The read-only and full file systems are real: small tmpfs mounts, made only where the tests run as root
(and removed after); elsewhere those two tests are skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from fabric import Fabric
from fabric.accelerators.cpu import MAX_CPU_PROCESSES, parse_cpu_cores
from fabric.checkpoint.formats import load_sharded
from fabric.checkpoint.formats.file import CheckpointLoadError
from fabric.checkpoint.formats.sharded import save_sharded

if not sys.platform.startswith("linux"):
    pytest.skip("FIFOs, symlink loops and tmpfs mounts as Linux makes them", allow_module_level=True)


@pytest.fixture
def fabric() -> Fabric:
    return Fabric(accelerator="cpu", devices=1)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(8, 4)


@pytest.mark.timeout(30)
def test_loading_a_fifo_is_refused_before_it_is_opened(fabric: Fabric, tmp_path: Path) -> None:
    fifo = tmp_path / "ckpt.pt"
    os.mkfifo(fifo)  # no writer: open() would block forever
    with pytest.raises(ValueError, match=r"ckpt.pt.*a FIFO \(named pipe\); accepted: a checkpoint file or a sharded"):
        fabric.load(fifo, {"model": _model()})
    with pytest.raises(ValueError, match="a FIFO"):
        fabric.load(fifo)
    with pytest.raises(ValueError, match="a FIFO"):
        fabric.load_raw(fifo, _model())


@pytest.mark.timeout(30)
def test_a_symlink_loop_is_refused_by_save_and_load_and_stays_a_link(fabric: Fabric, tmp_path: Path) -> None:
    loop = tmp_path / "ckpt.pt"
    loop.symlink_to(loop)
    with pytest.raises(ValueError, match=r"ckpt\.pt.*a symbolic link that loops"):
        fabric.save(loop, {"model": _model()})
    assert loop.is_symlink() and os.readlink(loop) == str(loop)
    with pytest.raises(ValueError, match="a symbolic link that loops"):
        fabric.load(loop, {"model": _model()})


@pytest.mark.timeout(30)
def test_names_too_long_and_nul_bytes_name_the_checkpoint(fabric: Fabric, tmp_path: Path) -> None:
    almost = tmp_path / ("a" * 250)  # fits, but the temporary file's name does not
    with pytest.raises(OSError, match=r"Cannot save the checkpoint '.*/a+': its file name is too long \(250") as info:
        fabric.save(almost, {"model": _model()})
    assert ".fabric-tmp" not in str(info.value)
    with pytest.raises(ValueError, match="longer than the file system allows"):
        fabric.save(tmp_path / ("a" * 300), {"model": _model()})
    with pytest.raises(ValueError, match="NUL byte"):
        fabric.save(str(tmp_path / "a\0b"), {"model": _model()})
    with pytest.raises(ValueError, match="NUL byte"):
        fabric.load(str(tmp_path / "a\0b"), {"model": _model()})
    assert list(tmp_path.iterdir()) == []


def test_a_path_that_is_no_path_and_a_weights_only_that_is_no_bool(fabric: Fabric, tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"save a checkpoint at path=None .*accepted: a str or a pathlib.Path"):
        fabric.save(None, {"model": _model()})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"load a checkpoint at path=None"):
        fabric.load(None, {"model": _model()})  # type: ignore[arg-type]
    fabric.save(tmp_path / "ok.pt", {"model": _model()})
    with pytest.raises(TypeError, match=r"weights_only='yes'.*True, False and None"):
        fabric.load(tmp_path / "ok.pt", {"model": _model()}, weights_only="yes")  # type: ignore[arg-type]
    fabric.load(tmp_path / "ok.pt", {"model": _model()}, weights_only=True)


def test_cpu_process_counts_beyond_the_limit_are_refused_naming_the_range() -> None:
    assert parse_cpu_cores(MAX_CPU_PROCESSES) == MAX_CPU_PROCESSES
    for devices in (10**8, 10**9, MAX_CPU_PROCESSES + 1):
        with pytest.raises(ValueError, match=rf"devices={devices} .*accepted: 1 to {MAX_CPU_PROCESSES}"):
            Fabric(accelerator="cpu", devices=devices)


@pytest.mark.timeout(60)
def test_a_shard_file_or_index_that_is_a_symlink_loop_is_named(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    save_sharded(folder, {"model": _model()})
    shard = next(folder.glob("*.distcp"))
    shard.unlink()
    shard.symlink_to(shard)
    with pytest.raises(CheckpointLoadError, match=rf"data file '{shard.name}' cannot be read: Too many levels of symbolic links"):
        load_sharded(folder, {"model": _model()})
    index = folder / ".metadata"
    index.unlink()
    index.symlink_to(index)
    with pytest.raises(CheckpointLoadError, match=r"whose \.metadata is a symbolic link that loops"):
        Fabric(accelerator="cpu", devices=1).load(folder, {"model": _model()})


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs (root only), unmounted after the test."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "mnt"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_a_save_on_a_read_only_file_system_names_the_checkpoint(fabric: Fabric, small_tmpfs: Path) -> None:
    target = small_tmpfs / "ckpt.pt"
    fabric.save(target, {"model": _model()})
    before = target.read_bytes()
    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    with pytest.raises(OSError, match=r"Could not save the checkpoint '.*ckpt.pt': Read-only file system") as info:
        fabric.save(target, {"model": nn.Linear(8, 4)})
    assert ".fabric-tmp" not in str(info.value)
    assert target.read_bytes() == before


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_a_disk_that_fills_during_the_shard_write_says_so(small_tmpfs: Path) -> None:
    big = nn.Linear(1024, 1024)  # 4 MiB of weights on a 1 MiB file system
    with pytest.raises(RuntimeError, match=r"ckpt.*failed; the previous one is kept\. No space left on device"):
        save_sharded(small_tmpfs / "ckpt", {"model": big})
    assert not (small_tmpfs / "ckpt").exists()
