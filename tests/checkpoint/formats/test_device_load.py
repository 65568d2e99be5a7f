"""The staged load for objects on a GPU (``fabric/checkpoint/formats/device_load.py``), its logic on the CPU.

``RingReader`` is driven with an in-memory file and a ``Staging`` whose copies finish only when waited for,
so the tests see what a GPU's asynchronous copies would let go wrong: a buffer read into again while a copy
out of it is in flight, a byte not checked, a damaged record whose copies are still running when the error
is raised. ``load_staged`` and ``fabric.load`` are run with ``HostStaging`` (the same path, CPU memory as the
"device"), and once more on a real GPU where there is one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fabric import Fabric
from fabric.checkpoint.errors import CheckpointLoadError, CorruptCheckpointError
from fabric.checkpoint.formats import device_load
from fabric.checkpoint.formats import file as single_file
from fabric.checkpoint.formats.device_load import HostStaging, RingReader, load_staged
from fabric.checkpoint.integrity import CheckedArchive
from support.archives import data_range, flipped


def damaged(path: Path, suffix: str) -> None:
    """Flip a bit in the middle of the record whose name ends with ``suffix``."""
    data = path.read_bytes()
    start, size = data_range(data, suffix)
    path.write_bytes(flipped(data, start + size // 2))


# ---- RingReader: the scheduling -----------------------------------------------------------------------


class Copy:
    """An asynchronous copy: made only when completed (a wait, or ``complete_all``)."""

    def __init__(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        self.source, self.destination, self.done = source, destination, False
        self.start, self.end = source.data_ptr(), source.data_ptr() + source.numel()

    def complete(self) -> None:
        if not self.done:
            self.destination.copy_(self.source)
            self.done = True


class LateStaging(HostStaging):
    """Copies that finish only when waited for; every copy, wait and buffer write recorded."""

    def __init__(self, buffers: int, buffer_bytes: int) -> None:
        super().__init__(buffers, buffer_bytes)
        self.copies: list[Copy] = []
        self.waits = 0

    def copy(self, source: torch.Tensor, destination: torch.Tensor) -> Copy:
        handle = Copy(source, destination)
        self.copies.append(handle)
        return handle

    def wait(self, handle: Any) -> None:
        self.waits += 1
        handle.complete()

    def in_flight(self) -> list[Copy]:
        return [copy for copy in self.copies if not copy.done]


class File:
    """An in-memory file of records; ``read_at`` fails the test if it writes into memory a copy still reads."""

    def __init__(self, sizes: list[int], staging: LateStaging, short: int = 0) -> None:
        generator = torch.Generator().manual_seed(len(sizes))
        self.records = [bytes(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator).tolist()) for size in sizes]
        self.offsets = [sum(sizes[:index]) * 2 + 7 * index for index in range(len(sizes))]  # gaps between records
        self.data = bytearray(max((offset + len(record) for offset, record in zip(self.offsets, self.records)), default=0) - short)
        for offset, record in zip(self.offsets, self.records):
            self.data[offset : offset + len(record)] = record[: max(len(self.data) - offset, 0)]
        self.staging = staging
        self.reads: list[tuple[int, int]] = []

    def read_at(self, view: memoryview, offset: int) -> int:
        start = torch.frombuffer(view, dtype=torch.uint8).data_ptr() if len(view) else 0
        for copy in self.staging.in_flight():
            assert not (start < copy.end and copy.start < start + len(view)), "a buffer was read into while a copy out of it was in flight"
        count = max(min(len(view), len(self.data) - offset), 0)
        view[:count] = self.data[offset : offset + count]
        self.reads.append((offset, count))
        return count


def ring_of(staging: LateStaging, file: File, crc_chunk: int = 64, checked: list[bytes] | None = None) -> RingReader:
    def crc(data: Any, value: int) -> int:
        if checked is not None:
            checked.append(bytes(data))
        return zlib.crc32(data, value)

    return RingReader(file.read_at, staging, "'test.pt'", crc_chunk=crc_chunk, crc=crc)


SIZES = [0, 1, 100, 255, 256, 257, 1000, 3, 0, 64, 900]  # around a buffer of 256 bytes: zero, smaller, exactly, larger, several


@pytest.mark.parametrize(("buffers", "buffer_bytes"), [(1, 256), (2, 256), (4, 256), (3, 1000), (2, 1)])
def test_every_record_arrives_whole_every_byte_checked_and_no_buffer_reused_before_its_copy_finished(buffers, buffer_bytes):
    staging = LateStaging(buffers, buffer_bytes)
    file = File(SIZES, staging)
    checked: list[bytes] = []
    ring = ring_of(staging, file, checked=checked)
    destinations = [torch.zeros(size, dtype=torch.uint8) for size in SIZES]
    for index, size in enumerate(SIZES):
        ring.read(f"archive/data/{index}", file.offsets[index], size, zlib.crc32(file.records[index]), destinations[index])
    ring.drain()
    assert not staging.in_flight()
    for destination, record in zip(destinations, file.records):
        assert bytes(destination.tolist()) == record
    assert b"".join(checked) == b"".join(file.records)  # every byte, once, in file order
    assert [offset for offset, _ in file.reads] == sorted(offset for offset, _ in file.reads)
    assert all(copy.source.numel() <= buffer_bytes for copy in staging.copies)
    assert all(count <= 64 for _, count in file.reads)  # the CRC is taken per chunk read, while it is in the cache


def test_a_record_larger_than_a_buffer_goes_in_buffer_sized_parts_and_reading_overlaps_the_copies():
    staging = LateStaging(2, 256)
    file = File([1000], staging)
    destination = torch.zeros(1000, dtype=torch.uint8)
    ring = ring_of(staging, file, crc_chunk=1000)
    ring.read("archive/data/0", file.offsets[0], 1000, zlib.crc32(file.records[0]), destination)
    assert [copy.source.numel() for copy in staging.copies] == [256, 256, 256, 232]
    assert [copy.destination.data_ptr() - destination.data_ptr() for copy in staging.copies] == [0, 256, 512, 768]
    assert len(staging.in_flight()) == 2  # the last two parts' copies still run when read returns: nothing waited for them
    assert staging.waits == 2  # the first two, each just before its buffer was read into again
    ring.drain()
    assert bytes(destination.tolist()) == file.records[0]


def test_small_records_share_a_buffer():
    staging = LateStaging(2, 256)
    file = File([10] * 20, staging)
    ring = ring_of(staging, file)
    for index in range(20):
        ring.read(f"r{index}", file.offsets[index], 10, zlib.crc32(file.records[index]), torch.zeros(10, dtype=torch.uint8))
    assert staging.waits == 0  # 200 bytes fit in the first buffer: no buffer was needed twice
    assert {copy.source.data_ptr() - copy.source.untyped_storage().data_ptr() for copy in staging.copies} == {10 * index for index in range(20)}


def test_zero_size_records_read_and_copy_nothing_and_are_checked():
    staging = LateStaging(2, 256)
    file = File([0], staging)
    ring = ring_of(staging, file)
    ring.read("archive/data/0", 0, 0, 0, torch.zeros(0, dtype=torch.uint8))
    assert staging.copies == [] and file.reads == []
    with pytest.raises(CorruptCheckpointError, match=r"record 'archive/data/0' \(0 bytes\) do not match"):
        ring.read("archive/data/0", 0, 0, 1234, torch.zeros(0, dtype=torch.uint8))


@pytest.mark.parametrize("bad", [1, 3])
def test_a_damaged_record_in_the_middle_raises_naming_it_after_its_copies_finished(bad):
    sizes = [300, 700, 50, 600]
    staging = LateStaging(2, 256)
    file = File(sizes, staging)
    file.data[file.offsets[bad] + sizes[bad] // 2] ^= 0x10
    ring = ring_of(staging, file)
    destinations = [torch.zeros(size, dtype=torch.uint8) for size in sizes]

    def read_all() -> None:
        for index, size in enumerate(sizes):
            ring.read(f"archive/data/{index}", file.offsets[index], size, zlib.crc32(file.records[index]), destinations[index])

    with pytest.raises(CorruptCheckpointError, match=rf"'test.pt' is damaged: the bytes of record 'archive/data/{bad}' \({sizes[bad]} bytes\)"):
        read_all()
    assert not staging.in_flight()  # nothing still writes a staging the caller drops, nor reads a buffer
    assert all(not destination.any() for destination in destinations[bad + 1 :])  # the reading stopped there


def test_a_file_that_ends_inside_a_record_is_refused_naming_it():
    staging = LateStaging(2, 256)
    file = File([100, 500], staging, short=20)
    ring = ring_of(staging, file)
    ring.read("archive/data/0", file.offsets[0], 100, zlib.crc32(file.records[0]), torch.zeros(100, dtype=torch.uint8))
    with pytest.raises(CorruptCheckpointError, match=r"'test.pt' is truncated inside record 'archive/data/1'"):
        ring.read("archive/data/1", file.offsets[1], 500, zlib.crc32(file.records[1]), torch.zeros(500, dtype=torch.uint8))
    assert not staging.in_flight()


def test_a_destination_of_another_size_or_type_is_refused():
    staging = LateStaging(1, 16)
    ring = ring_of(staging, File([4], staging))
    with pytest.raises(ValueError, match="must be 4 uint8 elements"):
        ring.read("r", 0, 4, 0, torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="must be 4 uint8 elements"):
        ring.read("r", 0, 4, 0, torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="at least one non-empty"):
        RingReader(lambda view, offset: 0, HostStaging(0, 16), "x")


# ---- load_staged: torch.load through the ring -----------------------------------------------------------

_shared = torch.randn(2000)
STATE = {
    "big": torch.randn(300, 257),
    "small": torch.arange(5),
    "empty": torch.empty(0),
    "half": torch.randn(70, 70).half(),
    "view_a": _shared[:100],
    "view_b": _shared[50:],
    "nested": {"x": torch.ones(40000, dtype=torch.float64), "steps": [torch.tensor(3.0), 7]},
    "note": "text",
}


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[key], b[key]) for key in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


class CountingStaging(HostStaging):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.copied = self.new = self.moved = self.rings = 0

    def buffers(self) -> Any:
        self.rings += 1
        return super().buffers()

    def copy(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        self.copied += source.numel()
        super().copy(source, destination)

    def new_storage(self, nbytes: int) -> torch.UntypedStorage:
        self.new += 1
        return super().new_storage(nbytes)

    def to_device(self, storage: torch.UntypedStorage) -> torch.UntypedStorage:
        self.moved += 1
        return super().to_device(storage)


def staged(path: Path, staging: Any, load: Any = None) -> Any:
    load = load or (lambda file, where: torch.load(file, map_location=where, weights_only=True))
    with open(path, "rb", buffering=0) as file:
        return load_staged(load, file.fileno(), os.fstat(file.fileno()).st_size, repr(str(path)), staging)


def storage_bytes(state: Any) -> int:
    seen: dict[int, int] = {}

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            seen[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(state)
    return sum(seen.values())


@pytest.mark.parametrize(("buffers", "buffer_bytes"), [(2, 4096), (4, 2**20), (1, 1000)])
def test_a_staged_load_gives_what_torch_load_gives_every_storage_through_the_ring(tmp_path, buffers, buffer_bytes):
    path = tmp_path / "state.pt"
    torch.save(STATE, path)
    staging = CountingStaging(buffers, buffer_bytes)
    loaded = staged(path, staging)
    assert same(loaded, torch.load(path, weights_only=True))
    assert loaded["view_a"].untyped_storage().data_ptr() == loaded["view_b"].untyped_storage().data_ptr()  # one storage, as saved
    assert staging.rings == 1  # one ring of buffers for the whole load
    # every storage's bytes went through the ring but the few torch read while reading the archive's head
    assert staging.copied + 64 >= storage_bytes(loaded) - 4096 and staging.copied <= storage_bytes(loaded)


def test_storages_the_staging_does_not_take_are_read_into_cpu_storage_and_checked(tmp_path, monkeypatch):
    path = tmp_path / "state.pt"
    torch.save(STATE, path)
    staging = CountingStaging(2, 4096, takes=lambda location: False)
    verified = []
    finish = CheckedArchive.finish
    monkeypatch.setattr(CheckedArchive, "finish", lambda self: (verified.append(all(r.verified for r in self._records if r.size)), finish(self))[1])
    assert same(staged(path, staging), STATE)
    assert staging.copied == 0 and staging.new == 0 and staging.rings == 0  # no buffer was made (pinned, on a GPU)
    assert verified == [True]  # every record with bytes checked on the way, none left for finish to read again


@pytest.mark.parametrize("record", ["data/0", "data/1", "data/3", "data/5"])
def test_a_damaged_storage_record_is_refused_naming_it(tmp_path, record):
    path = tmp_path / "state.pt"
    torch.save(STATE, path)
    damaged(path, record)
    with pytest.raises(CorruptCheckpointError, match=rf"is damaged: the bytes of record 'state/{record}'"):
        staged(path, CountingStaging(2, 4096))


def test_a_load_torch_cannot_make_with_a_callable_map_location_falls_back_to_the_cpu_path(tmp_path):
    path = tmp_path / "state.pt"
    torch.save(STATE, path)
    wheres: list[Any] = []

    def load(file: Any, where: Any) -> Any:
        wheres.append(where)
        if callable(where):
            raise RuntimeError("Callable map_location not supported with _rebuild_wrapper_subclass")
        return torch.load(file, map_location=where, weights_only=True)

    assert same(staged(path, CountingStaging(2, 4096), load), STATE)
    assert callable(wheres[0]) and wheres[1:] == ["cpu"]


def test_a_storage_record_read_for_another_purpose_falls_back_to_the_cpu_path(tmp_path):
    path = tmp_path / "state.pt"
    torch.save({"big": torch.randn(5000)}, path)

    wheres: list[Any] = []

    def load(file: Any, where: Any) -> Any:
        wheres.append(where)
        if callable(where):  # a reader that reads the storage record, then something else before map_location
            record = next(r for r in file._records if r.name.endswith("data/0"))
            file.seek(record.data)
            file.readinto(bytearray(record.size))
            file.seek(0)
            file.read(4)
        return torch.load(file, map_location="cpu" if callable(where) else where, weights_only=True)

    assert same(staged(path, CountingStaging(2, 4096), load), {"big": torch.load(path, weights_only=True)["big"]})
    assert callable(wheres[0]) and wheres[1:] == ["cpu"]


def test_no_device_memory_for_the_staging_falls_back_to_the_cpu_path(tmp_path):
    path = tmp_path / "state.pt"
    torch.save(STATE, path)

    class Full(CountingStaging):
        def new_storage(self, nbytes: int) -> torch.UntypedStorage:
            if self.new >= 2:
                raise torch.OutOfMemoryError("CUDA out of memory (a test)")
            return super().new_storage(nbytes)

    staging = Full(2, 4096)
    loaded = staged(path, staging)
    assert same(loaded, STATE) and staging.new == 2


# ---- fabric.load into objects on the "device" ---------------------------------------------------------


def model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10), nn.LayerNorm(10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


@pytest.fixture
def host_staging(monkeypatch: pytest.MonkeyPatch) -> list[CountingStaging]:
    """Loads into CPU objects take the staged path, through ``HostStaging`` (CPU memory as the device)."""
    made: list[CountingStaging] = []

    def staging_for(device: Any) -> CountingStaging:
        made.append(CountingStaging(2, 4096))
        return made[-1]

    monkeypatch.setattr(single_file, "staging_device", lambda objects: torch.device("cpu"))
    monkeypatch.setattr(device_load, "staging_for", staging_for)
    return made


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    return {k: v.clone() for k, v in model.state_dict().items()}, {
        index: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()} for index, state in optimizer.state_dict()["state"].items()
    }


def test_fabric_load_through_the_staged_path_loads_every_value(tmp_path, host_staging):
    fabric = Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(0)
    model, optimizer = model_and_optimizer()
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": optimizer, "step": torch.tensor(11), "note": "x"})
    saved = snapshot(model, optimizer)
    torch.manual_seed(1)
    other, other_optimizer = model_and_optimizer()
    state = {"model": other, "optimizer": other_optimizer, "step": None}
    rest = fabric.load(tmp_path / "ckpt.pt", state)
    assert host_staging and host_staging[0].copied > 0
    loaded = snapshot(other, other_optimizer)
    assert same(loaded[0], saved[0]) and same(loaded[1], saved[1])
    assert torch.equal(state["step"], torch.tensor(11)) and rest == {"note": "x"}


@pytest.mark.parametrize("record", ["data/0", "data/3", "data/9"])
def test_a_damaged_record_on_the_staged_path_changes_nothing(tmp_path, host_staging, record):
    fabric = Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(0)
    model, optimizer = model_and_optimizer()
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": optimizer})
    path = tmp_path / "ckpt.pt"
    damaged(path, record)
    torch.manual_seed(1)
    other, other_optimizer = model_and_optimizer()
    before = snapshot(other, other_optimizer)
    with pytest.raises(CheckpointLoadError, match=rf"the bytes of record '[^']+/{record}'"):
        fabric.load(path, {"model": other, "optimizer": other_optimizer})
    assert host_staging
    after = snapshot(other, other_optimizer)
    assert same(after[0], before[0]) and same(after[1], before[1])


def test_the_staging_device_is_the_one_gpu_every_module_and_optimizer_tensor_is_on():
    model, optimizer = model_and_optimizer()
    assert single_file.staging_device([model, optimizer, 3, "x"]) is None  # on the CPU: the CPU path
    assert single_file.staging_device([]) is None
    assert single_file.staging_device([nn.Linear(2, 2, device="meta")]) is None
    assert device_load.staging_for(None) is None
    assert device_load.staging_for("cpu") is None
    assert device_load.staging_for(torch.device("meta")) is None


# ---- on a GPU -------------------------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_gpu
def test_fabric_load_into_a_gpu_model_reads_through_pinned_buffers_and_a_damaged_record_changes_nothing(tmp_path, monkeypatch):
    fabric = Fabric(accelerator="cuda", devices=1)

    def stepped(seed: int) -> tuple[Any, Any]:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10), nn.LayerNorm(10))
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=0.1))
        model(torch.randn(4, 64, device=fabric.device)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        return model, optimizer

    model, optimizer = stepped(0)
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": optimizer, "extra": torch.ones(3, device=fabric.device)})
    saved = snapshot(model, optimizer)
    made: list[Any] = []
    staging_for = device_load.staging_for
    monkeypatch.setattr(device_load, "staging_for", lambda device: made.append(staging_for(device)) or made[-1])
    other, other_optimizer = stepped(1)
    rest = fabric.load(tmp_path / "ckpt.pt", {"model": other, "optimizer": other_optimizer})
    assert isinstance(made[0], device_load.CudaStaging)
    loaded = snapshot(other, other_optimizer)
    assert same(loaded[0], saved[0]) and same(loaded[1], saved[1])
    assert rest["extra"].device.type == "cpu"  # what is not a module's or optimizer's comes back on the CPU, as before
    state_of_first = other_optimizer.state[next(iter(other.parameters()))]
    assert state_of_first["exp_avg"].is_cuda and not state_of_first["step"].is_cuda  # where AdamW keeps them
    other(torch.randn(4, 64, device=fabric.device)).sum().backward()
    other_optimizer.step()  # the loaded state works

    path = tmp_path / "ckpt.pt"
    damaged(path, "data/2")
    third, third_optimizer = stepped(2)
    before = snapshot(third, third_optimizer)
    with pytest.raises(CheckpointLoadError, match=r"the bytes of record '[^']+/data/2'"):
        fabric.load(path, {"model": third, "optimizer": third_optimizer})
    after = snapshot(third, third_optimizer)
    assert same(after[0], before[0]) and same(after[1], before[1])


@pytest.mark.procs
@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal without a CUDA device")
def test_the_gpu_load_benchmark_says_so_and_fails_without_a_cuda_device(tmp_path):
    script = Path(__file__).resolve().parents[3] / "benchmarks" / "checkpoint_load.py"
    command = [sys.executable, str(script), "--device", "cuda", "--json", str(tmp_path / "out.json")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "no CUDA device found" in result.stderr and "nothing was measured" in result.stderr
    assert not (tmp_path / "out.json").exists()
