"""``torch.save`` archives in memory, where their records' bytes lie, and damage made to them."""

from __future__ import annotations

import io
import zipfile

import torch


def archive_bytes(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def data_range(data: bytes, suffix: str) -> tuple[int, int]:
    """Where the bytes of the record whose name ends with ``suffix`` lie in the archive ``data``."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        info = next(info for info in archive.infolist() if info.filename.endswith(suffix))
    header = info.header_offset
    start = header + 30 + int.from_bytes(data[header + 26 : header + 28], "little") + int.from_bytes(data[header + 28 : header + 30], "little")
    return start, info.compress_size


def flipped(data: bytes, offset: int, bit: int = 2) -> bytes:
    changed = bytearray(data)
    changed[offset] ^= 1 << bit
    return bytes(changed)
