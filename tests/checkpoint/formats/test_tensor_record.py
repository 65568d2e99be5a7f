"""Reading a one-tensor ``torch.save`` archive straight into a tensor's memory (``fabric/checkpoint/formats/tensor_record.py``):
the bytes land in place, once, checked; every other layout is left to ``torch.load`` with the destination
untouched; damage is refused naming the record; a pickle naming anything else runs nothing."""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from pathlib import Path

import pytest
import torch

from fabric.checkpoint import integrity
from fabric.checkpoint.errors import CorruptCheckpointError
from fabric.checkpoint.formats.tensor_record import read_into
from fabric.checkpoint.integrity import CheckedArchive
from support.archives import archive_bytes, data_range, flipped


def read_file_into(path: Path, destination: torch.Tensor) -> bool:
    with open(path, "rb", buffering=0) as file:
        archive = CheckedArchive(file.fileno(), 0, os.fstat(file.fileno()).st_size, repr(str(path)))
        return read_into(archive, destination)


def written(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "item.pt"
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16])
def test_a_tensor_laid_out_as_the_destination_is_read_into_its_memory_once(tmp_path, monkeypatch, dtype):
    saved = (torch.randn(300, 129) * 100).to(dtype)
    path = written(tmp_path, archive_bytes(saved))
    destination = torch.empty_like(saved)
    pointer = destination.data_ptr()
    read = {"bytes": 0}
    preadv = os.preadv

    def counting_preadv(fd, buffers, offset):
        count = preadv(fd, buffers, offset)
        read["bytes"] += count
        return count

    monkeypatch.setattr(integrity.os, "preadv", counting_preadv)
    assert read_file_into(path, destination)
    assert torch.equal(destination, saved) and destination.data_ptr() == pointer
    assert read["bytes"] == saved.numel() * saved.element_size()  # the data once, straight into place


def test_an_empty_tensor_is_read_with_nothing_to_copy(tmp_path):
    destination = torch.empty(0, 4)
    assert read_file_into(written(tmp_path, archive_bytes(torch.empty(0, 4))), destination)


def _layouts() -> dict[str, tuple[object, torch.Tensor]]:
    big = torch.randn(40, 30)
    return {
        "another dtype": (big, torch.empty(40, 30, dtype=torch.float64)),
        "another shape": (big, torch.empty(30, 40)),
        "a strided destination": (big, torch.empty(30, 40).t()),
        "saved transposed": (big.t(), torch.empty(30, 40)),
        "saved as a view of a larger storage": (big[10:20], torch.empty(10, 30)),
        "saved as a parameter": (torch.nn.Parameter(big), torch.empty(40, 30)),
        "saved with other objects": ({"w": big}, torch.empty(40, 30)),
        "two tensors": ([big, big + 1], torch.empty(40, 30)),
    }


@pytest.mark.parametrize("case", list(_layouts()))
def test_a_layout_that_differs_is_left_to_torch_load_and_the_destination_untouched(tmp_path, case):
    saved, destination = _layouts()[case]
    destination.fill_(7)
    assert not read_file_into(written(tmp_path, archive_bytes(saved)), destination)
    assert bool((destination == 7).all())


@pytest.mark.parametrize("record", ["data/0", "data.pkl", "byteorder", "version"])
def test_a_flipped_bit_in_any_record_is_refused_naming_it(tmp_path, record):
    data = archive_bytes(torch.randn(300, 100))
    start, length = data_range(data, record)
    path = written(tmp_path, flipped(data, start + length // 2))
    with pytest.raises(CorruptCheckpointError, match=rf"record '.*{record}' .* do not match the checksum"):
        read_file_into(path, torch.empty(300, 100))


def test_a_pickle_that_names_other_code_runs_nothing(tmp_path):
    """An archive whose pickle calls something else (CRCs right: planted, not rotted) is left to torch.load."""
    marker = tmp_path / "ran"

    class Planted:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", pickle.dumps(Planted(), protocol=2))
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/data/0", bytes(4 * 100))
        archive.writestr("archive/version", "3\n")
    destination = torch.full((100,), 7.0)
    assert not read_file_into(written(tmp_path, buffer.getvalue()), destination)
    assert not marker.exists() and bool((destination == 7).all())
