"""One error module: every refused load is a ``CheckpointLoadError``, on the local disk and on a store alike.

``fabric.checkpoint.errors`` holds every class raised while loading a checkpoint, and the one a save to a URL raises
when another writer of it won (``ConcurrentSaveError``). Each load error derives from ``CheckpointLoadError`` and keeps
the bases code written for Lightning Fabric catches; the old modules still give the same classes. The same damage (a
file truncated, grown or bit-flipped) is refused with the same class, ``CorruptCheckpointError``, whether the
checkpoint lies on disk or on fsspec's in-memory store (``memory://``; on a real S3 server:
``storage/test_same_damage.py``).
"""

from __future__ import annotations

import ast
import inspect
import json
import pickle
import secrets
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from fabric import Fabric
from fabric.checkpoint import errors
from fabric.checkpoint.errors import (
    CheckpointLoadError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointPathError,
    CommitRecordError,
    ConcurrentSaveError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from support.models import stepped_pair

pytestmark = pytest.mark.usefixtures("clean_fabric_env")

ERROR_CLASSES = [
    value
    for value in vars(errors).values()
    if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == errors.__name__
]
SAVE_ERRORS = [ConcurrentSaveError]  # a save's, not a load's: an OSError, as every failed save to a store
LOAD_ERRORS = [cls for cls in ERROR_CLASSES if cls not in SAVE_ERRORS]


# ---- the classes --------------------------------------------------------------------------------


def test_the_module_exports_every_class_it_defines() -> None:
    assert sorted(cls.__name__ for cls in ERROR_CLASSES) == sorted(errors.__all__)


@pytest.mark.parametrize("cls", LOAD_ERRORS, ids=lambda cls: cls.__name__)
def test_every_load_error_is_a_checkpoint_load_error(cls: type[BaseException]) -> None:
    assert issubclass(cls, CheckpointLoadError)
    assert issubclass(cls, RuntimeError)
    assert cls.__doc__ and "\n" not in cls.__doc__.strip()  # a one-line docstring


def test_the_save_error_is_an_os_error_and_no_load_error() -> None:
    assert issubclass(ConcurrentSaveError, OSError) and not issubclass(ConcurrentSaveError, CheckpointLoadError)
    assert ConcurrentSaveError.__doc__ and "\n" not in ConcurrentSaveError.__doc__.strip()


def test_the_lightning_compatible_bases_hold() -> None:
    assert issubclass(UnsafeCheckpointError, pickle.UnpicklingError)  # what torch.load(weights_only=True) raises
    for base in (KeyError, ValueError, TypeError, RuntimeError):  # what Lightning (or older fabric) raised for a misfit
        assert issubclass(CheckpointMismatchError, base)
    assert issubclass(CorruptCheckpointError, CheckpointLoadError) and issubclass(CommitRecordError, CheckpointLoadError)
    assert issubclass(CheckpointNotFoundError, FileNotFoundError)  # what Lightning Fabric raises for a missing path
    assert issubclass(CheckpointPathError, ValueError)  # what a FIFO or a device at the path raised before


def test_a_mismatch_reads_as_written_though_it_is_a_key_error() -> None:
    message = "state['model']: the checkpoint has no key 'bias'"
    err = CheckpointMismatchError(message)
    assert str(err) == message  # KeyError alone would quote it
    assert str(CheckpointMismatchError()) == ""
    with pytest.raises(KeyError, match=r"^state\['model'\]"):
        raise err


def test_the_old_homes_give_the_same_classes() -> None:
    import fabric.checkpoint
    from fabric.checkpoint import fit, integrity
    from fabric.checkpoint.formats import file
    from fabric.checkpoint.storage import objects as object_store
    from fabric.plugins import io
    from fabric.utilities import exceptions

    assert file.CheckpointLoadError is io.CheckpointLoadError is CheckpointLoadError
    assert file.UnsafeCheckpointError is io.UnsafeCheckpointError is UnsafeCheckpointError
    assert integrity.CorruptCheckpointError is CorruptCheckpointError
    assert object_store.CommitRecordError is CommitRecordError
    assert object_store.ConcurrentSaveError is ConcurrentSaveError  # (tests and code of the store imported it there)
    assert exceptions.CheckpointMismatchError is fit.CheckpointMismatchError is CheckpointMismatchError
    for name in errors.__all__:
        assert getattr(fabric.checkpoint, name) is getattr(errors, name)


def test_the_error_module_imports_only_the_standard_library() -> None:
    """Every layer that raises or catches a checkpoint error imports it, the lowest of the wing: it must pull in nothing."""
    tree = ast.parse(Path(errors.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert {name.partition(".")[0] for name in imported} <= set(sys.stdlib_module_names) | {"__future__"}


# ---- the same damage, the same error on disk and on a store -------------------------------------


@pytest.fixture
def memory_url() -> str:
    """A fresh folder on fsspec's process-wide in-memory store, removed afterwards."""
    fsspec = pytest.importorskip("fsspec")
    folder = f"fabric-tests-{secrets.token_hex(4)}"
    yield f"memory://{folder}"
    fs = fsspec.filesystem("memory")
    if fs.exists(folder):
        fs.rm(folder, recursive=True)


@pytest.fixture
def staging(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Staging folders of a load from a store go under this test's temporary folder."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path_factory.mktemp("staging")))


def damaged(data: bytes, damage: str) -> bytes:
    if damage == "truncated":
        return data[:-100]
    if damage == "grown":
        return data + bytes(100)
    flipped = bytearray(data)
    flipped[len(flipped) // 2] ^= 0x10
    return bytes(flipped)


def on_the_store(url: str, name: str) -> tuple[Any, str]:
    """(filesystem, path) of the object ``name`` of the checkpoint at ``url``, as its commit record names it."""
    from fabric._core.urls import filesystem
    from fabric.checkpoint.storage import objects as storage

    fs, path = filesystem(url)
    record = json.loads(fs.cat_file(path))
    return fs, f"{storage.generation_prefix(path, record['generation'])}/{name}"


def damage_on_the_store(url: str, name: str, damage: str) -> None:
    fs, path = on_the_store(url, name)
    fs.pipe_file(path, damaged(fs.cat_file(path), damage))


def damage_on_disk(path: Path, damage: str) -> None:
    path.write_bytes(damaged(path.read_bytes(), damage))


def refusal(load: Callable[[], object]) -> CheckpointLoadError:
    """The error of ``load``, caught by ``except CheckpointLoadError`` as a user's code would."""
    try:
        load()
    except CheckpointLoadError as err:
        return err
    pytest.fail("the damaged checkpoint loaded")


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


@pytest.mark.parametrize("damage", ["truncated", "grown", "flipped"])
def test_a_damaged_single_file_is_a_checkpoint_load_error_on_disk_and_on_a_store(
    tmp_path: Path, memory_url: str, damage: str
) -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    net, _ = stepped_pair(seed=1)
    path, url = tmp_path / "ckpt.pt", f"{memory_url}/ckpt.pt"
    for where in (path, url):
        fabric.save(where, {"model": net, "step": 1})
    damage_on_disk(path, damage)
    damage_on_the_store(url, "checkpoint.pt", damage)

    refused = []
    for where in (path, url):
        fresh, _ = stepped_pair(seed=2)
        before = {key: value.clone() for key, value in fresh.state_dict().items()}
        state = {"model": fresh, "step": 0}
        refused.append(refusal(lambda where=where, state=state: fabric.load(where, state)))
        assert same(fresh.state_dict(), before) and state["step"] == 0  # nothing changed
    on_disk, on_store = refused
    assert type(on_disk) is type(on_store) is CorruptCheckpointError  # one class per damage, wherever it lies
    assert str(path) in str(on_disk) and url in str(on_store)


@pytest.mark.usefixtures("staging")
@pytest.mark.parametrize("damage", ["truncated", "grown"])
def test_a_sharded_data_file_of_another_size_is_a_checkpoint_load_error_on_disk_and_on_a_store(
    tmp_path: Path, memory_url: str, damage: str
) -> None:
    from fabric.checkpoint.formats import load_sharded
    from fabric.checkpoint.formats.sharded import save_sharded

    net, _ = stepped_pair(seed=1)
    folder, url = tmp_path / "sharded", f"{memory_url}/sharded"
    for where in (folder, url):
        save_sharded(where, {"model": net, "step": 1})
    damage_on_disk(folder / "__0_0.distcp", damage)
    damage_on_the_store(url, "__0_0.distcp", damage)

    for where in (folder, url):
        fresh, _ = stepped_pair(seed=2)
        before = {key: value.clone() for key, value in fresh.state_dict().items()}
        err = refusal(lambda where=where, fresh=fresh: load_sharded(where, {"model": fresh}))
        assert type(err) is CorruptCheckpointError
        assert "__0_0.distcp" in str(err)
        assert same(fresh.state_dict(), before)
