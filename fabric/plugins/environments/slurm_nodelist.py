"""Slurm's compact host lists (``"node[001-003,007],gpu5"``), expanded locally without ``scontrol``."""

from __future__ import annotations

import re
from collections.abc import Iterator
from itertools import product

__all__ = ["parse_slurm_nodelist"]

# One bracket group of a Slurm hostlist item: a list of (low, high) digit strings.
_Ranges = list[tuple[str, str]]
_RANGE_PATTERN = re.compile(r"([0-9]+)(?:-([0-9]+))?")


def _parse_brackets(body: str, nodelist: str) -> _Ranges:
    ranges: _Ranges = []
    for part in body.split(","):
        match = _RANGE_PATTERN.fullmatch(part.strip())
        if match is None:
            raise ValueError(f"Malformed range {part!r} in Slurm nodelist {nodelist!r}.")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ValueError(f"Descending range {part!r} in Slurm nodelist {nodelist!r}.")
        ranges.append((low, high))
    return ranges


def _parse_item(item: str, nodelist: str) -> list[str | _Ranges]:
    """Split one top-level hostlist item into literal text and bracket groups."""
    segments: list[str | _Ranges] = []
    pos = 0
    while pos < len(item):
        open_at = item.find("[", pos)
        close_at = item.find("]", pos)
        if open_at == -1:
            if close_at != -1:
                raise ValueError(f"Unbalanced ']' in Slurm nodelist {nodelist!r}.")
            segments.append(item[pos:])
            break
        if close_at != -1 and close_at < open_at:
            raise ValueError(f"Unbalanced ']' in Slurm nodelist {nodelist!r}.")
        if open_at > pos:
            segments.append(item[pos:open_at])
        close_at = item.find("]", open_at)
        if close_at == -1:
            raise ValueError(f"Unbalanced '[' in Slurm nodelist {nodelist!r}.")
        body = item[open_at + 1 : close_at]
        if "[" in body:
            raise ValueError(f"Nested brackets in Slurm nodelist {nodelist!r}.")
        segments.append(_parse_brackets(body, nodelist))
        pos = close_at + 1
    return segments


def _split_top_level(nodelist: str) -> list[str]:
    """Split on commas and whitespace that are outside brackets."""
    items: list[str] = []
    depth = 0
    current: list[str] = []
    for char in nodelist:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if depth == 0 and (char == "," or char.isspace()):
            items.append("".join(current))
            current = []
        else:
            current.append(char)
    items.append("".join(current))
    return [item for item in items if item]


def _expand_ranges(ranges: _Ranges) -> Iterator[str]:
    for low, high in ranges:
        width = len(low)  # Slurm keeps the zero padding of the lower bound: [08-10] -> 08, 09, 10
        for number in range(int(low), int(high) + 1):
            yield str(number).zfill(width)


def _expand_item(segments: list[str | _Ranges]) -> Iterator[str]:
    choices = [[seg] if isinstance(seg, str) else list(_expand_ranges(seg)) for seg in segments]
    for parts in product(*choices):
        yield "".join(parts)


def parse_slurm_nodelist(nodelist: str) -> Iterator[str]:
    """Expand a compact Slurm nodelist (``"node[001-003,007],gpu5"``) into host names, in order.

    The whole string is checked for syntax immediately (``ValueError`` if malformed);
    the host names themselves are produced lazily, so taking only the first one of a
    huge allocation stays cheap. Several bracket groups in one item expand as a
    product, leftmost group varying slowest.
    """
    if not isinstance(nodelist, str):
        raise TypeError(f"nodelist must be a string, got {type(nodelist).__name__}.")
    if nodelist.count("[") != nodelist.count("]"):
        raise ValueError(f"Unbalanced brackets in Slurm nodelist {nodelist!r}.")
    items = _split_top_level(nodelist)
    if not items:
        raise ValueError(f"Slurm nodelist {nodelist!r} names no hosts.")
    parsed = [_parse_item(item, nodelist) for item in items]

    def generate() -> Iterator[str]:
        for segments in parsed:
            yield from _expand_item(segments)

    return generate()
