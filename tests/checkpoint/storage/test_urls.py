"""A URL is never a local path: every entry point resolves it to its store, or stops with a clear error.

Also checkpoints on fsspec's in-memory store (``memory://``, no server needed): round trips through the
commit record, damaged objects refused, the previous checkpoint kept until the new record is written.
The same against a real S3 server: ``test_s3_storage.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from fabric import Fabric
from fabric._core.urls import filesystem, is_url, local_or_url, redact
from fabric.checkpoint.formats import choose
from fabric.checkpoint.formats.sharded import SHARDED
from fabric.checkpoint.storage import locate
from fabric.checkpoint.storage import objects as storage
from fabric.plugins.io import CheckpointLoadError, TorchCheckpointIO, atomic_save, safe_load
from support.models import stepped_pair

pytestmark = pytest.mark.usefixtures("clean_fabric_env")

fsspec = pytest.importorskip("fsspec")


@pytest.fixture
def empty_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The test runs in an empty folder, which must stay empty: a URL taken for a local path would show up here."""
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    assert sorted(os.listdir(tmp_path)) == []


@pytest.fixture
def memory_url() -> str:
    """A fresh folder on fsspec's process-wide in-memory store, removed afterwards."""
    import secrets

    folder = f"memory://fabric-tests-{secrets.token_hex(4)}"
    yield folder
    fs = fsspec.filesystem("memory")
    if fs.exists(folder[len("memory://") :]):
        fs.rm(folder[len("memory://") :], recursive=True)


def cpu_fabric() -> Fabric:
    return Fabric(accelerator="cpu", devices=1)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(8, 4)


# ---- the resolver ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "expected"),
    [("s3://b/k", True), ("memory://x", True), ("simplecache::s3://b/k", True), ("file:///tmp/x", False),
     ("/tmp/x", False), ("relative/x.pt", False), ("C:\\x.pt", False), (Path("s3://b/k"), False)],
)
def test_what_is_a_url(path: object, expected: bool) -> None:
    assert is_url(path) is expected


def test_file_url_is_the_local_path(tmp_path: Path) -> None:
    assert local_or_url(f"file://{tmp_path}/x.pt") == f"{tmp_path}/x.pt"


@pytest.mark.parametrize(
    ("url", "refused"),
    [
        ("memory://run/ckpt.pt?versionId=3", "'memory://run/ckpt.pt?***' has a query"),
        ("simplecache::memory://run/ckpt.pt#part", "'simplecache::memory://run/ckpt.pt#part' has a fragment"),
        ("memory://user:pa?ss#word@run/ckpt.pt", None),  # a password holding "?" and "#" is no query
    ],
)
def test_a_url_with_a_query_or_fragment_is_refused_before_its_store_is_used(url: str, refused: str | None) -> None:
    if refused is None:
        assert local_or_url(url) == url
        return
    with pytest.raises(ValueError, match=re.escape(refused)):
        locate(url)


def test_unknown_scheme_is_refused_naming_the_url_without_secrets() -> None:
    with pytest.raises(ValueError, match="unknown storage scheme 'nosuch://'") as info:
        local_or_url("nosuch://alice:s3cret@host/x.pt?token=abc")
    assert "s3cret" not in str(info.value) and "abc" not in str(info.value)
    assert "alice:***@host" in str(info.value)


def test_missing_library_names_the_extra() -> None:
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        pass
    else:  # pragma: no cover
        pytest.skip("gcsfs is installed here")
    with pytest.raises(ImportError, match=r"pip install 'fabric-torch\[gcs\]'"):
        local_or_url("gs://bucket/x.pt")


def test_missing_fsspec_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "fsspec", None)
    with pytest.raises(ImportError, match=r"needs fsspec.*pip install 'fabric-torch\[s3\]'"):
        filesystem("s3://bucket/x.pt")


def test_redact_keeps_what_names_the_object() -> None:
    assert redact("s3://bucket/run/ckpt.pt") == "s3://bucket/run/ckpt.pt"
    assert redact("https://user:pw@host/x?sig=1") == "https://user:***@host/x?***"


# ---- every entry point: an unusable URL creates nothing locally ----------------------------------

BAD_URLS = ["nosuch://bucket/run/ckpt.pt", "gs://bucket/run/ckpt.pt"]


@pytest.mark.parametrize("url", BAD_URLS)
def test_save_load_refuse_an_unusable_url(empty_cwd: Path, url: str) -> None:
    fabric = cpu_fabric()
    net = model()
    with pytest.raises((ValueError, ImportError)):
        fabric.save(url, {"model": net})
    with pytest.raises((ValueError, ImportError)):
        fabric.load(url, {"model": net})
    with pytest.raises((ValueError, ImportError)):
        fabric.load_raw(url, net)


@pytest.mark.parametrize("url", BAD_URLS)
def test_plugins_refuse_an_unusable_url(empty_cwd: Path, url: str) -> None:
    with pytest.raises((ValueError, ImportError)):
        TorchCheckpointIO().save_checkpoint({"a": 1}, url)
    with pytest.raises((ValueError, ImportError)):
        TorchCheckpointIO().load_checkpoint(url)
    with pytest.raises((ValueError, ImportError)):
        TorchCheckpointIO().remove_checkpoint(url)
    with pytest.raises((ValueError, ImportError)):
        atomic_save({"a": 1}, url)
    with pytest.raises((ValueError, ImportError)):
        safe_load(url)


@pytest.mark.parametrize("url", BAD_URLS)
def test_consolidate_refuses_an_unusable_url(empty_cwd: Path, url: str) -> None:
    from fabric.consolidate import main

    assert main([url, "out.pt"]) == 1
    assert main(["ckpt", url]) == 1


@pytest.mark.parametrize("url", BAD_URLS)
def test_loggers_refuse_an_unusable_url(empty_cwd: Path, url: str) -> None:
    from fabric.loggers import CSVLogger, TensorBoardLogger

    with pytest.raises((ValueError, ImportError)):
        CSVLogger(url)
    with pytest.raises((ValueError, ImportError)):
        TensorBoardLogger(url)


@pytest.mark.parametrize("url", BAD_URLS)
def test_is_shared_filesystem_refuses_an_unusable_url(empty_cwd: Path, url: str) -> None:
    from fabric.utilities.distributed import is_shared_filesystem

    with pytest.raises((ValueError, ImportError)):
        is_shared_filesystem(cpu_fabric().strategy, url)


def test_is_shared_filesystem_a_store_is_shared(empty_cwd: Path) -> None:
    from fabric.utilities.distributed import is_shared_filesystem

    assert is_shared_filesystem(cpu_fabric().strategy, "memory://shared")


# ---- checkpoints on memory:// -------------------------------------------------------------------


def test_save_load_round_trip(empty_cwd: Path, memory_url: str) -> None:
    fabric = cpu_fabric()
    net, url = model(), f"{memory_url}/run/ckpt.pt"
    optimizer = torch.optim.AdamW(net.parameters())
    net(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    fabric.save(url, {"model": net, "optimizer": optimizer, "step": 7})
    fresh = nn.Linear(8, 4)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    rest = fabric.load(url, {"model": fresh, "optimizer": fresh_optimizer})
    assert rest == {"step": 7}
    assert torch.equal(fresh.weight, net.weight)
    assert torch.equal(fresh_optimizer.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    assert fabric.load(url)["step"] == 7


def test_load_raw_and_async_save(empty_cwd: Path, memory_url: str) -> None:
    fabric = cpu_fabric()
    net, url = model(), f"{memory_url}/raw.pt"
    TorchCheckpointIO().save_checkpoint(net.state_dict(), url)
    fresh = nn.Linear(8, 4)
    fabric.load_raw(url, fresh)
    assert torch.equal(fresh.weight, net.weight)
    with torch.no_grad():
        net.weight.add_(1)
    fabric.save(f"{memory_url}/async.pt", {"model": net}, async_save=True)
    fabric.load(f"{memory_url}/async.pt", {"model": fresh})  # waits for the background save
    assert torch.equal(fresh.weight, net.weight)


def store_of(url: str) -> tuple[object, str]:
    return filesystem(url)


def the_object(url: str) -> str:
    fs, path = store_of(url)
    record = json.loads(fs.cat_file(path))
    return f"{storage.generation_prefix(path, record['generation'])}/{storage.FILE_OBJECT}"


def test_a_new_save_replaces_the_generation(memory_url: str) -> None:
    url = f"{memory_url}/ckpt.pt"
    fs, path = store_of(url)
    atomic_save({"v": torch.zeros(3)}, url)
    first = the_object(url)
    atomic_save({"v": torch.ones(3)}, url)
    second = the_object(url)
    assert first != second and not fs.exists(first) and fs.exists(second)
    assert len(fs.ls(f"{path}{storage.DATA_SUFFIX}")) == 1
    assert torch.equal(safe_load(url)["v"], torch.ones(3))


@pytest.mark.parametrize("damage", ["flip", "truncate", "other_save", "missing"])
def test_damaged_object_refused_nothing_changed(empty_cwd: Path, memory_url: str, damage: str) -> None:
    fabric = cpu_fabric()
    url, other = f"{memory_url}/ckpt.pt", f"{memory_url}/other.pt"
    net = model()
    fabric.save(url, {"model": net})
    fs, _ = store_of(url)
    target = the_object(url)
    data = bytearray(fs.cat_file(target))
    if damage == "flip":
        data[len(data) // 2] ^= 0x10
        fs.pipe_file(target, bytes(data))
    elif damage == "truncate":
        fs.pipe_file(target, bytes(data[:-100]))
    elif damage == "other_save":
        bigger = nn.Linear(8, 4)
        fabric.save(other, {"model": bigger})
        fs.pipe_file(target, fs.cat_file(the_object(other)))
    else:
        fs.rm(target)
    fresh = nn.Linear(8, 4)
    before = fresh.weight.detach().clone()
    with pytest.raises(storage.CorruptCheckpointError, match=r"ckpt\.pt.*checkpoint\.pt"):  # (the disk's class for it)
        fabric.load(url, {"model": fresh})
    assert torch.equal(fresh.weight, before)


def test_a_store_answering_a_range_with_more_bytes_is_refused(empty_cwd: Path, memory_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes beyond the range asked for are no part of the object the record checks: the read is refused, nothing changed."""
    fabric = cpu_fabric()
    url = f"{memory_url}/ckpt.pt"
    fabric.save(url, {"model": model()})
    fs, _ = store_of(url)
    original = type(fs).cat_file

    def cat_file(self, path, start=None, end=None, **kwargs):  # type: ignore[no-untyped-def]
        data = original(self, path, start=start, end=end, **kwargs)
        return data + b"\0" * 8 if path.endswith(storage.FILE_OBJECT) else data

    monkeypatch.setattr(type(fs), "cat_file", cat_file)
    fresh = nn.Linear(8, 4)
    before = fresh.weight.detach().clone()
    with pytest.raises(storage.CommitRecordError, match=r"checkpoint\.pt.*answered bytes 0 to \d+ with \d+ bytes"):
        fabric.load(url, {"model": fresh})
    assert torch.equal(fresh.weight, before)


def test_checkpoint_without_commit_record_refused(memory_url: str) -> None:
    url = f"{memory_url}/ckpt.pt"
    fs, path = store_of(url)
    atomic_save({"v": torch.ones(2)}, url)
    fs.rm(path)
    with pytest.raises(FileNotFoundError, match="no commit record"):
        safe_load(url)
    torch.save({"v": torch.ones(2)}, fs.open(path, "wb"))  # a plain torch file where the record should be
    with pytest.raises(storage.CommitRecordError, match="has no commit record"):
        safe_load(url)


def test_failed_save_keeps_the_previous_checkpoint(memory_url: str) -> None:
    url = f"{memory_url}/ckpt.pt"
    fs, path = store_of(url)
    atomic_save({"v": torch.ones(2)}, url)

    class Unpicklable:
        def __reduce__(self) -> object:
            raise TypeError("cannot pickle this")

    with pytest.raises(TypeError):
        atomic_save({"v": torch.zeros(2), "bad": Unpicklable()}, url)
    assert torch.equal(safe_load(url)["v"], torch.ones(2))
    assert len(fs.ls(f"{path}{storage.DATA_SUFFIX}")) == 1  # the failed save's object is gone


def test_remove_checkpoint(memory_url: str) -> None:
    url = f"{memory_url}/ckpt.pt"
    fs, path = store_of(url)
    atomic_save({"v": 1}, url)
    TorchCheckpointIO().remove_checkpoint(url)
    assert not fs.exists(path) and not fs.exists(f"{path}{storage.DATA_SUFFIX}")


def test_not_found(memory_url: str) -> None:
    with pytest.raises(FileNotFoundError, match="Checkpoint not found"):
        cpu_fabric().load(f"{memory_url}/nothing.pt")


def test_corrupt_record_in_archive_is_caught_by_the_crc_check(memory_url: str) -> None:
    """Bytes that match the commit record but not the archive's own CRCs (a damaged save) are still refused."""
    url = f"{memory_url}/ckpt.pt"
    fs, path = store_of(url)
    atomic_save({"v": torch.arange(100000, dtype=torch.float32)}, url)
    target = the_object(url)
    data = bytearray(fs.cat_file(target))
    data[len(data) // 2] ^= 0x01
    fs.pipe_file(target, bytes(data))
    from fabric.checkpoint.integrity import crc32

    record = json.loads(fs.cat_file(path))
    record["objects"][storage.FILE_OBJECT]["crc32"] = crc32(bytes(data))
    fs.pipe_file(path, json.dumps(record).encode())
    with pytest.raises(CheckpointLoadError, match="do not match the checksum"):
        safe_load(url)


def test_full_checkpoint_of_sharded_objects_to_a_url(empty_cwd: Path, memory_url: str) -> None:
    from fabric.checkpoint.formats.full import save_full

    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    url = f"{memory_url}/full.pt"
    save_full(url, {"model": net, "optimizer": optimizer, "step": 7})
    fresh = nn.Linear(8, 4)
    assert cpu_fabric().load(url, {"model": fresh, "optimizer": torch.optim.SGD(fresh.parameters(), lr=0.1)}) == {"step": 7}
    assert torch.equal(fresh.weight, net.weight)


# ---- sharded checkpoints on a URL (one process here; 2-process FSDP jobs on S3: test_s3_storage.py) -----------


class ShardedHost:
    """What ``pipeline`` needs of a strategy whose format is "sharded", in one process."""

    checkpoint_format = "sharded"
    world_size = 1
    global_rank = 0
    root_device = torch.device("cpu")


def sharded_pair(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model whose first weight is over 64 KiB (read straight into its tensor) and whose other tensors are
    small (read through torch.load), with a stepped AdamW."""
    return stepped_pair(seed, (64, 512, 4), torch.optim.AdamW)


def copies(state: dict) -> dict:
    return {key: value.clone() for key, value in state.items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


@pytest.fixture
def staging(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The temporary folder of this test (TMPDIR as tempfile read it): every staging folder goes there, and is gone after."""
    import tempfile

    folder = tmp_path_factory.mktemp("staging")
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    yield folder
    left = [name for name in os.listdir(folder) if name.startswith(storage.STAGING_PREFIX)]  # (torch keeps caches there)
    assert left == [], "a staging folder was left behind"


def generation_objects(url: str) -> tuple[object, str, list[str]]:
    fs, path = store_of(url)
    record = json.loads(fs.cat_file(path))
    return fs, storage.generation_prefix(path, record["generation"]), sorted(record["objects"])


def test_sharded_checkpoint_round_trip_on_a_url(empty_cwd: Path, staging: Path, memory_url: str) -> None:
    from fabric.checkpoint import pipeline

    net, optimizer = sharded_pair(seed=1)
    url = f"{memory_url}/run/sharded"
    pipeline.save(ShardedHost(), url, {"model": net, "optimizer": optimizer, "step": 7})  # type: ignore[arg-type]
    fs, prefix, names = generation_objects(url)
    assert names == [".metadata", "__0_0.distcp", "fabric-objects.pt"]
    # every object the record lists, and the copy of the record the generation keeps (concurrent writers)
    assert sorted(entry.rsplit("/", 1)[-1] for entry in fs.ls(prefix, detail=False)) == sorted([*names, storage.RECORD_COPY])
    assert choose(locate(url).detect(), locate(url)) is SHARDED and locate(url).exists()

    fabric = cpu_fabric()  # any strategy loads a sharded checkpoint
    fresh, fresh_optimizer = sharded_pair(seed=2)
    state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
    assert fabric.load(url, state) == {}
    assert state["step"] == 7
    assert same(fresh.state_dict(), net.state_dict())
    assert same(fresh_optimizer.state_dict()["state"][0], optimizer.state_dict()["state"][0])
    whole = fabric.load(url)  # no state: everything, full tensors
    assert whole["step"] == 7 and same(whole["model"], net.state_dict())
    assert torch.equal(whole["optimizer"]["state"][2]["exp_avg"], optimizer.state_dict()["state"][2]["exp_avg"])
    with pytest.raises(TypeError, match="is a sharded checkpoint folder"):
        fabric.load_raw(url, nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 4)))


def test_async_sharded_save_to_a_url_and_a_second_save_replaces_the_generation(empty_cwd: Path, staging: Path, memory_url: str) -> None:
    from fabric.checkpoint.formats import load_sharded
    from fabric.checkpoint.formats.sharded import save_sharded

    net, _ = sharded_pair(seed=1)
    url = f"{memory_url}/sharded"
    handle = save_sharded(url, {"model": net, "step": 1}, async_save=True)
    snapshot = copies(net.state_dict())
    with torch.no_grad():
        for param in net.parameters():
            param.add_(1.0)  # changed after the call: not what is saved
    handle.wait()
    fs, first, _ = generation_objects(url)
    fresh, _ = sharded_pair(seed=2)
    load_sharded(url, {"model": fresh})
    assert same(fresh.state_dict(), snapshot)
    save_sharded(url, {"model": net, "step": 2})
    _, second, _ = generation_objects(url)
    assert second != first and not fs.exists(first)
    state = {"model": fresh, "step": 0}
    load_sharded(url, state)
    assert state["step"] == 2 and same(fresh.state_dict(), net.state_dict())


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        ("flip", "__0_0.distcp"),
        ("truncate", "__0_0.distcp"),
        ("other_save", "__0_0.distcp"),
        ("missing", "__0_0.distcp"),
        ("index", ".metadata"),
        ("objects", "fabric-objects.pt"),
    ],
)
def test_damaged_sharded_object_refused_naming_it_nothing_changed(staging: Path, memory_url: str, damage: str, named: str) -> None:
    from fabric.checkpoint.formats import load_sharded
    from fabric.checkpoint.formats.sharded import save_sharded

    net, optimizer = sharded_pair(seed=1)
    url, other = f"{memory_url}/sharded", f"{memory_url}/other"
    save_sharded(url, {"model": net, "optimizer": optimizer, "step": 1})
    fs, prefix, _ = generation_objects(url)
    target = f"{prefix}/{named}"
    data = bytearray(fs.cat_file(target))
    if damage in ("flip", "index", "objects"):
        data[len(data) // 3] ^= 0x10
        fs.pipe_file(target, bytes(data))
    elif damage == "truncate":
        fs.pipe_file(target, bytes(data[: len(data) - 100]))
    elif damage == "missing":
        fs.rm(target)
    else:  # the same file of a save of another model of the same shapes: same name and size, other bytes
        other_net, other_optimizer = sharded_pair(seed=3)
        save_sharded(other, {"model": other_net, "optimizer": other_optimizer, "step": 1})
        _, other_prefix, _ = generation_objects(other)
        replacement = fs.cat_file(f"{other_prefix}/{named}")
        assert len(replacement) == len(data)
        fs.pipe_file(target, replacement)
    fresh, fresh_optimizer = sharded_pair(seed=2)
    before, optimizer_before = copies(fresh.state_dict()), copies(fresh_optimizer.state_dict()["state"][0])
    state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
    with pytest.raises(RuntimeError, match=rf"{memory_url}/sharded.*{re.escape(named)}") as info:
        load_sharded(url, state)
    assert "staging" not in str(info.value)  # the URL is named, not the local folder it was fetched into
    assert same(fresh.state_dict(), before) and same(fresh_optimizer.state_dict()["state"][0], optimizer_before)
    assert state["step"] == 0
    with pytest.raises(RuntimeError, match=re.escape(named)):
        load_sharded(url)  # the whole read too


def test_a_part_written_as_several_files_uploads_and_fetches_them_at_once(
    staging: Path, memory_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A big part is written as up to 4 data files, each uploaded as it is written, fetched in parallel on load;
    one damaged file among them is still refused naming it, nothing changed."""
    from fabric.checkpoint.formats import load_sharded
    from fabric.checkpoint.formats.sharded import save_sharded
    from fabric.checkpoint.storage import sharded_store

    monkeypatch.setattr(sharded_store, "_BYTES_PER_FILE", 32 << 10)
    net, optimizer = sharded_pair(seed=1)
    url = f"{memory_url}/sharded"
    save_sharded(url, {"model": net, "optimizer": optimizer, "step": 3})
    fs, prefix, names = generation_objects(url)
    assert names == [".metadata", "__0_0.distcp", "__0_1.distcp", "__0_2.distcp", "__0_3.distcp", "fabric-objects.pt"]
    fresh, fresh_optimizer = sharded_pair(seed=2)
    state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
    load_sharded(url, state)
    assert state["step"] == 3 and same(fresh.state_dict(), net.state_dict())
    assert same(fresh_optimizer.state_dict()["state"][2], optimizer.state_dict()["state"][2])
    data = bytearray(fs.cat_file(f"{prefix}/__0_2.distcp"))
    data[len(data) // 2] ^= 0x01
    fs.pipe_file(f"{prefix}/__0_2.distcp", bytes(data))
    other, other_optimizer = sharded_pair(seed=4)
    before = copies(other.state_dict())
    with pytest.raises(RuntimeError, match=r"__0_2\.distcp.*do not match the CRC-32"):
        load_sharded(url, {"model": other, "optimizer": other_optimizer})
    assert same(other.state_dict(), before)


def test_sharded_checkpoint_without_its_commit_record_is_not_found(staging: Path, memory_url: str) -> None:
    from fabric.checkpoint.formats.sharded import save_sharded

    net, _ = sharded_pair(seed=1)
    url = f"{memory_url}/sharded"
    save_sharded(url, {"model": net})
    fs, path = store_of(url)
    fs.rm(path)
    fresh, _ = sharded_pair(seed=2)
    before = copies(fresh.state_dict())
    with pytest.raises(FileNotFoundError, match="no commit record"):
        cpu_fabric().load(url, {"model": fresh})
    assert same(fresh.state_dict(), before)


def test_a_sharded_save_whose_record_is_never_written_keeps_the_previous(
    staging: Path, memory_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fabric.checkpoint.formats import load_sharded
    from fabric.checkpoint.formats.sharded import save_sharded

    net, optimizer = sharded_pair(seed=1)
    url = f"{memory_url}/sharded"
    save_sharded(url, {"model": net, "optimizer": optimizer, "step": 1})
    fs, first, _ = generation_objects(url)
    saved = copies(net.state_dict())

    def no_record(*args: object) -> None:
        raise OSError("the store went away")

    monkeypatch.setattr(storage, "write_record", no_record)
    with torch.no_grad():
        for param in net.parameters():
            param.mul_(2.0)
    with pytest.raises(RuntimeError, match=r"Saving the sharded checkpoint .* failed; the previous one is kept.*went away"):
        save_sharded(url, {"model": net, "optimizer": optimizer, "step": 2})
    monkeypatch.undo()
    _, path = store_of(url)
    assert fs.ls(f"{path}{storage.DATA_SUFFIX}", detail=False) == [first]  # the new generation's objects are gone
    fresh, _ = sharded_pair(seed=2)
    state = {"model": fresh, "step": 0}
    load_sharded(url, state)
    assert state["step"] == 1 and same(fresh.state_dict(), saved)


def test_sharded_checkpoint_on_a_url_is_found_and_removed(staging: Path, memory_url: str) -> None:
    from fabric.checkpoint.formats.sharded import save_sharded
    from fabric.checkpoint.storage.object_store import ObjectStore

    url = f"{memory_url}/sharded"
    assert locate(url).detect().kind == "missing" and not locate(url).exists()
    save_sharded(url, {"model": sharded_pair(seed=1)[0]})
    atomic_save({"v": torch.ones(2)}, f"{memory_url}/file.pt")
    assert choose(locate(url).detect(), locate(url)) is SHARDED and locate(f"{memory_url}/file.pt").detect().kind == "file"
    assert isinstance(locate(url), ObjectStore)  # never looked up as a local path
    TorchCheckpointIO().remove_checkpoint(url)
    fs, path = store_of(url)
    assert locate(url).detect().kind == "missing" and not fs.exists(path) and not fs.exists(f"{path}{storage.DATA_SUFFIX}")


def test_a_load_from_a_store_reads_the_commit_record_once(staging: Path, memory_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The format is detected from the commit record, and the load reads the checkpoint that record names: one GET of
    the record per load, for a single file, for ``load_raw`` and for a sharded checkpoint."""
    from fabric.checkpoint.formats.sharded import save_sharded

    fs, _ = store_of(memory_url)
    reads: list[str] = []
    original = type(fs).cat_file

    def cat_file(self, path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if "fabric-tests-" in str(path) and ".fabric/" not in str(path):  # a record, not an object of a generation
            reads.append(str(path))
        return original(self, path, *args, **kwargs)

    monkeypatch.setattr(type(fs), "cat_file", cat_file)
    fabric, net = cpu_fabric(), model()
    fabric.save(f"{memory_url}/file.pt", {"model": net})
    atomic_save(net.state_dict(), f"{memory_url}/raw.pt")
    save_sharded(f"{memory_url}/sharded", {"model": sharded_pair(seed=1)[0]})
    reads.clear()
    fabric.load(f"{memory_url}/file.pt", {"model": model()})
    assert len(reads) == 1
    fabric.load_raw(f"{memory_url}/raw.pt", model())
    assert len(reads) == 2
    fabric.load(f"{memory_url}/sharded", {"model": sharded_pair(seed=2)[0]})
    assert len(reads) == 3


def test_a_growing_upload_sends_what_is_written_as_it_is_written_and_gives_up_cleanly(tmp_path: Path, memory_url: str) -> None:
    """The upload of a staging file while torch writes it: the object gets every byte (digest of the bytes sent),
    a write that fails discards the object, and an upload that fails is reported when the write is done."""
    from fabric.checkpoint.integrity import crc32

    fs, root = store_of(memory_url)
    local = tmp_path / "part"
    data = os.urandom(9 << 20)  # more than one 8 MiB piece
    with open(local, "wb", buffering=0) as file:
        upload = storage.GrowingUpload(fs, local, f"{root}/part", memory_url)
        for start in range(0, len(data), 3 << 20):
            file.write(data[start : start + (3 << 20)])
            upload.grew(min(len(data), start + (3 << 20)))
        digest = upload.finish(len(data))
    assert digest == {"size": len(data), "crc32": crc32(data)}
    assert fs.cat_file(f"{root}/part") == data

    with open(local, "wb", buffering=0) as file:
        upload = storage.GrowingUpload(fs, local, f"{root}/cut", memory_url)
        file.write(data[: 1 << 20])
        upload.grew(1 << 20)
        upload.abort()  # the write failed: nothing of it stays on the store
    assert not fs.exists(f"{root}/cut")

    upload = storage.GrowingUpload(fs, tmp_path / "no-such-file", f"{root}/gone", memory_url)
    with pytest.raises(FileNotFoundError):
        upload.finish(10)
    assert not fs.exists(f"{root}/gone")


def test_sharded_url_errors_never_show_credentials(staging: Path, memory_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from fabric.checkpoint.formats import load_sharded
    from fabric.checkpoint.formats.sharded import save_sharded

    url = f"memory://user:secret-token@{memory_url[len('memory://'):]}/sharded"
    save_sharded(url, {"model": sharded_pair(seed=1)[0]})
    fs, prefix, _ = generation_objects(url)
    fs.rm(f"{prefix}/__0_0.distcp")
    with pytest.raises(RuntimeError) as info:
        load_sharded(url, {"model": sharded_pair(seed=2)[0]})
    assert "secret" not in str(info.value) and "user:***@" in str(info.value)

    def refused(fs: object, path: str, record: object) -> None:
        raise OSError(f"the store refused {url}")  # a library that repeats the URL it was given

    monkeypatch.setattr(storage, "write_record", refused)
    with pytest.raises(RuntimeError, match="previous one is kept") as info:
        save_sharded(url, {"model": sharded_pair(seed=1)[0]})
    assert "secret" not in str(info.value) and "user:***@" in str(info.value)


def test_run_refuses_a_url_script(empty_cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fabric.cli import main

    with pytest.raises(SystemExit) as info:
        main(["run", "s3://bucket/train.py"])
    assert info.value.code == 2
    assert "is a URL" in capsys.readouterr().err


@pytest.mark.procs
def test_the_first_staging_folder_of_a_process_removes_those_of_dead_processes(staging: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank killed mid-save leaves its staging folder (its part of the model) in TMPDIR; a later process removes it."""
    import socket
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    host = storage._host_tag()
    other_host = f"{(int(host, 16) + 1) % (1 << 32):08x}"
    folders = {
        f"{storage.STAGING_PREFIX}save-{dead.pid}-{host}-abc123": False,  # killed here: goes
        f"{storage.STAGING_PREFIX}load-{dead.pid}-{host}-def456": False,
        f"{storage.STAGING_PREFIX}save-{os.getpid()}-{host}-ghi789": True,  # a live process's: stays
        f"{storage.STAGING_PREFIX}save-{dead.pid}-{other_host}-jkl012": True,  # another host's: stays
        f"{storage.STAGING_PREFIX}save-mno345": True,  # no pid in its name: stays
    }
    for name in folders:
        (staging / name).mkdir()
        (staging / name / "__0_0.distcp").write_bytes(b"shard")
    monkeypatch.setattr(storage, "_swept_staging", set())  # a new process
    mine = storage.new_staging("save")
    assert mine.name.startswith(f"{storage.STAGING_PREFIX}save-{os.getpid()}-{host}-") and socket.gethostname()
    for name, stays in folders.items():
        assert (staging / name).exists() is stays, name
    for name in [*folders, mine.name]:
        shutil.rmtree(staging / name, ignore_errors=True)
