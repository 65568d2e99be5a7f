"""The CRC check that rides along the load (``fabric/checkpoint/integrity.py``, and its use for shard items in
``safe_reader.py``): every byte read once, checked while it passes, a damaged one refused before anything
changes, through both of its paths (small archives read whole into memory, larger ones streamed straight
into the tensors' storage).
"""

from __future__ import annotations

import io
import os
import random
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from fabric import Fabric
from fabric.checkpoint import integrity
from fabric.checkpoint.errors import CorruptCheckpointError
from fabric.checkpoint.formats import load_sharded
from fabric.checkpoint.formats.shard_reader import SafeFileSystemReader, read_index
from fabric.checkpoint.formats.sharded import save_sharded
from fabric.checkpoint.integrity import CheckedArchive, load_checked
from fabric.plugins.io import CheckpointLoadError, safe_load
from support.archives import archive_bytes, data_range, flipped


def load_from(path: Path, start: int = 0, length: int | None = None) -> object:
    with open(path, "rb", buffering=0) as file:
        size = os.fstat(file.fileno()).st_size if length is None else length
        return load_checked(lambda archive: torch.load(archive, weights_only=True), file.fileno(), start, size, repr(str(path)))


STATE = {"big": torch.randn(300, 257), "small": torch.arange(5), "empty": torch.empty(0), "nested": {"x": torch.ones(2, 3)}, "note": "text"}


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[key], b[key]) for key in a)
    return a == b


# ---- the archive's directory -------------------------------------------------------------------------


def records_of(data: bytes) -> list[tuple[str, int, int, int]]:
    records, _, _ = integrity._read_directory(lambda offset, count: data[offset : offset + count], len(data), "test")
    return [(record.name, record.header, record.size, record.crc) for record in records]


def zipfile_records(data: bytes) -> list[tuple[str, int, int, int]]:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        infos = sorted(archive.infolist(), key=lambda info: info.header_offset)
    return [(info.filename, info.header_offset, info.compress_size, info.CRC) for info in infos]


@pytest.mark.parametrize("obj", [STATE, torch.tensor(3.0), {f"t{i}": torch.randn(i + 1) for i in range(40)}])
def test_the_directory_reads_as_zipfile_reads_it(obj):
    data = archive_bytes(obj)
    assert records_of(data) == zipfile_records(data)


def test_zip64_directories_and_a_comment_read_as_zipfile_reads_them(monkeypatch):
    """torch writes 64-bit sizes and offsets past 4 GiB; a lowered limit makes zipfile write them for small records."""
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 100)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED) as archive:
        for index in range(5):
            archive.writestr(f"archive/data/{index}", os.urandom(50 + 97 * index))
        archive.comment = b"a comment at the very end"
    data = buffer.getvalue()
    assert b"PK\x06\x06" in data  # a zip64 end record was written
    assert records_of(data) == zipfile_records(data)
    assert any(size > 100 for _, _, size, _ in records_of(data))


def test_a_compressed_record_is_refused():
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("archive/data.pkl", b"x" * 1000)
    with pytest.raises(CorruptCheckpointError, match="compressed"):
        records_of(buffer.getvalue())


# ---- one pass: each byte read once, checked on the way -------------------------------------------------


@pytest.fixture
def counted_reads(monkeypatch):
    """Bytes read through integrity's file reads, in total."""
    total = {"bytes": 0}
    pread, preadv = os.pread, os.preadv

    def counting_pread(fd, count, offset):
        data = pread(fd, count, offset)
        total["bytes"] += len(data)
        return data

    def counting_preadv(fd, buffers, offset):
        count = preadv(fd, buffers, offset)
        total["bytes"] += count
        return count

    monkeypatch.setattr(integrity.os, "pread", counting_pread)
    monkeypatch.setattr(integrity.os, "preadv", counting_preadv)
    return total


def test_a_large_archive_is_read_once_and_every_record_checked_on_the_way(tmp_path, counted_reads):
    path = tmp_path / "big.pt"
    path.write_bytes(archive_bytes(STATE))
    size = path.stat().st_size
    with open(path, "rb", buffering=0) as file:
        archive = CheckedArchive(file.fileno(), 0, size, "big")
        loaded = torch.load(archive, weights_only=True)  # type: ignore[arg-type]
        unchecked = [record.name for record in archive._records if not record.verified and record.size]
        archive.finish()
    assert same(loaded, STATE)
    assert unchecked == []  # nothing left for ``finish`` to read again
    assert counted_reads["bytes"] < size + 3 * 4096  # the data once; the directory, head and tail twice at most


def test_a_small_archive_is_read_whole_once(tmp_path, counted_reads):
    path = tmp_path / "small.pt"
    path.write_bytes(archive_bytes({"step": torch.tensor(7.0)}))
    assert same(load_from(path), {"step": torch.tensor(7.0)})
    assert counted_reads["bytes"] == path.stat().st_size


# ---- damage is refused on either path -----------------------------------------------------------------


@pytest.mark.parametrize("record", ["data/0", "data.pkl", "version", ".data/serialization_id"])
@pytest.mark.parametrize("size", ["small", "large"])
def test_a_flipped_bit_in_any_record_is_refused_naming_it(tmp_path, record, size):
    """Large archives: the big record streamed, the small ones at either end checked from memory."""
    obj = {"w": torch.randn(200, 100) if size == "large" else torch.randn(3)}
    data = archive_bytes(obj)
    assert (len(data) > integrity.SMALL_ARCHIVE) == (size == "large")
    start, length = data_range(data, record)
    path = tmp_path / "damaged.pt"
    path.write_bytes(flipped(data, start + length // 2))
    with pytest.raises(CorruptCheckpointError, match=rf"record '.*{record}' .* do not match the checksum"):
        load_from(path)


def test_the_damage_is_raised_from_inside_torch_load_before_it_returns(tmp_path):
    data = archive_bytes({"a": torch.randn(100, 100), "b": torch.randn(100, 100)})
    start, _ = data_range(data, "data/0")
    path = tmp_path / "damaged.pt"
    path.write_bytes(flipped(data, start + 10))
    returned = []
    with pytest.raises(CorruptCheckpointError), open(path, "rb", buffering=0) as file:
        load_checked(lambda archive: returned.append(torch.load(archive, weights_only=True)), file.fileno(), 0, len(data), "x")
    assert returned == []


@pytest.mark.parametrize("size", [200, 5000])
def test_an_item_inside_a_larger_file_is_read_within_its_bounds(tmp_path, size):
    """A shard file holds items back to back: each is checked and loaded from its own byte range."""
    items = [archive_bytes(torch.randn(size) * index) for index in range(3)]
    path = tmp_path / "shard.distcp"
    path.write_bytes(b"".join(items))
    offset = 0
    for index, item in enumerate(items):
        assert torch.equal(load_from(path, offset, len(item)), torch.load(io.BytesIO(item), weights_only=True)), index
        offset += len(item)
    damaged = flipped(b"".join(items), len(items[0]) + data_range(items[1], "data/0")[0] + 3)
    path.write_bytes(damaged)
    load_from(path, 0, len(items[0]))  # its neighbour's damage is not its own
    with pytest.raises(CorruptCheckpointError, match="do not match"):
        load_from(path, len(items[0]), len(items[1]))


def test_random_damage_is_refused_or_loads_exactly_the_saved_values(tmp_path):
    data = archive_bytes(STATE)
    path = tmp_path / "fuzz.pt"
    rng = random.Random(0)
    outcomes = {"refused": 0, "same": 0}
    for _ in range(300):
        damaged = bytearray(data)
        if rng.random() < 0.3:
            damaged = damaged[: rng.randrange(len(damaged))]
        else:
            for _ in range(rng.randint(1, 3)):
                damaged[rng.randrange(len(damaged))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(damaged))
        try:
            loaded = load_from(path)
        except CorruptCheckpointError:
            outcomes["refused"] += 1
            continue
        except (RuntimeError, ValueError, EOFError, KeyError, IndexError, TypeError, AttributeError):
            outcomes["refused"] += 1  # torch's own refusal of damaged structure (safe_load names the file)
            continue
        assert same(loaded, STATE), "damaged bytes loaded as other values"
        outcomes["same"] += 1  # a flip in bytes that hold no value (a header's time stamp)
    assert outcomes["refused"] > 250


def test_a_checked_record_read_again_out_of_order_is_checked_again(tmp_path):
    """If bytes of a record already checked are read again, not from the record's start (torch does not do
    this today), ``finish`` reads and checks the record once more instead of trusting the first pass."""
    data = archive_bytes({"w": torch.randn(300, 300)})
    start, length = data_range(data, "data/0")
    path = tmp_path / "ckpt.pt"
    path.write_bytes(data)
    with open(path, "rb", buffering=0) as file:
        archive = CheckedArchive(file.fileno(), 0, len(data), "x")
        torch.load(archive, weights_only=True)  # type: ignore[arg-type]
        path.write_bytes(flipped(data, start + length // 2))  # the file changes under the reader (same inode)
        archive.seek(start + length // 2 - 5)
        archive.read(10)
        with pytest.raises(CorruptCheckpointError, match="do not match"):
            archive.finish()


# ---- through fabric.load and load_sharded: refused, and the target unchanged -------------------------


def model_and_optimizer(seed: int, width: int = 192) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, width), nn.Linear(width, 4))  # 144 KiB weight: streamed; 4x192: in memory
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    return model, optimizer


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    values = {name: value.detach().clone() for name, value in model.state_dict().items()}
    for number, entry in enumerate(optimizer.state.values()):
        values.update({f"state{number}.{name}": value.clone() for name, value in entry.items()})
    return values


def saved_file(tmp_path):
    """A single-file checkpoint of one model (its bytes, the first record's range) and another model to load it into."""
    fabric = Fabric(accelerator="cpu", devices=1)
    model, optimizer = model_and_optimizer(0)
    path = tmp_path / "ckpt.pt"
    fabric.save(path, {"model": model, "optimizer": optimizer})
    data = path.read_bytes()
    target, target_optimizer = model_and_optimizer(1)
    return fabric, model, path, data, data_range(data, "data/0"), target, target_optimizer


def test_a_truncated_single_file_is_refused_and_the_target_unchanged(tmp_path):
    fabric, _, path, data, (start, length), target, target_optimizer = saved_file(tmp_path)
    before = snapshot(target, target_optimizer)
    for cut in (start + length // 2, len(data) - 10, len(data) // 3):
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointLoadError, match=str(path)):
            fabric.load(path, {"model": target, "optimizer": target_optimizer})
        assert same(before, snapshot(target, target_optimizer)), cut


def test_a_flipped_bit_in_a_large_single_file_record_is_refused_and_the_target_unchanged(tmp_path):
    fabric, model, path, data, (start, length), target, target_optimizer = saved_file(tmp_path)
    path.write_bytes(flipped(data, start + length - 1))
    before = snapshot(target, target_optimizer)
    with pytest.raises(CheckpointLoadError, match="checksum"):
        fabric.load(path, {"model": target, "optimizer": target_optimizer})
    assert same(before, snapshot(target, target_optimizer))
    path.write_bytes(data)
    assert same(safe_load(path)["model"], model.state_dict())


def test_a_flipped_bit_in_a_small_shard_item_is_refused_and_the_target_unchanged(tmp_path):
    """Items up to ``integrity.SMALL_ARCHIVE`` are read whole and checked in memory; a large item's flipped bit is
    tests/checkpoint/test_damaged_checkpoints.py's."""
    model, optimizer = model_and_optimizer(0)
    folder = tmp_path / "sharded"
    save_sharded(folder, {"model": model, "optimizer": optimizer})
    index = read_index(folder)
    key, info = min(index.storage_data.items(), key=lambda pair: pair[1].length)
    assert info.length <= integrity.SMALL_ARCHIVE
    shard = folder / info.relative_path
    data = shard.read_bytes()
    start, length = data_range(data[info.offset : info.offset + info.length], "data/0")
    shard.write_bytes(flipped(data, info.offset + start + length // 2))
    target, target_optimizer = model_and_optimizer(1)
    before = snapshot(target, target_optimizer)
    with pytest.raises(CheckpointLoadError, match="do not match the checksum") as caught:
        load_sharded(folder, {"model": target, "optimizer": target_optimizer})
    assert key.fqn in str(caught.value) and info.relative_path in str(caught.value)
    assert same(before, snapshot(target, target_optimizer))


def test_staging_tensors_are_read_into_or_take_the_loaded_storage_and_others_are_copied_into(tmp_path):
    """A large item laid out as its staging tensor is read straight into the staging memory; a small one (read
    whole, then ``torch.load``-ed) hands the staging tensor its loaded storage; a target that is not staging, or
    a staging tensor of another dtype or other strides, is copied into."""
    import torch.distributed.checkpoint as dcp

    saved = {"large": torch.randn(256, 256), "small": torch.randn(64, 64), "b": torch.randn(64, 64)}
    dcp.save(saved, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    large, small, target = torch.empty(256, 256), torch.empty(64, 64), torch.empty(64, 64)
    pointers = [tensor.untyped_storage().data_ptr() for tensor in (large, small, target)]
    reader = SafeFileSystemReader(tmp_path / "ckpt", staging=[large, small])
    dcp.load({"large": large, "small": small, "b": target}, storage_reader=reader, no_dist=True)
    assert torch.equal(large, saved["large"]) and torch.equal(small, saved["small"]) and torch.equal(target, saved["b"])
    assert large.untyped_storage().data_ptr() == pointers[0]  # read in place: no second storage
    assert small.untyped_storage().data_ptr() != pointers[1]  # handed the loaded storage: no copy
    assert target.untyped_storage().data_ptr() == pointers[2]  # not ours to replace: copied into
    # a staging tensor the chunk cannot stand in for as it is (another dtype, other strides) is copied into
    converted, transposed = torch.empty(256, 256, dtype=torch.float64), torch.empty(64, 64).t()
    pointers = [converted.untyped_storage().data_ptr(), transposed.untyped_storage().data_ptr()]
    reader = SafeFileSystemReader(tmp_path / "ckpt", staging=[converted, transposed])
    dcp.load({"large": converted, "b": transposed}, storage_reader=reader, no_dist=True)
    assert torch.equal(converted, saved["large"].double()) and torch.equal(transposed, saved["b"])
    assert [converted.untyped_storage().data_ptr(), transposed.untyped_storage().data_ptr()] == pointers
