"""The syntax of ``devices=``, shared by ``fabric run --devices`` and the GPU accelerators.

What the user may write, and what it means (checking it against the machine is the caller's part):

* ``"auto"``, ``-1`` or ``"-1"``: every device there is;
* a positive int, or a string of one (``2``, ``"2"``): that many devices, the first ones;
* device indices: a comma-separated string (``"0,1"``; ``"1,"`` is device 1, not one device), the same
  in brackets (``"[0, 1]"``), or a list or tuple of ints (``[0, 1]``).
"""

from __future__ import annotations

from typing import Any, Literal

__all__ = ["DevicesSyntaxError", "parse_devices"]


class DevicesSyntaxError(ValueError):
    """``devices=`` is not written in any of the accepted forms (the caller names the forms it accepts)."""


def parse_devices(devices: Any) -> Literal["all"] | int | list[int]:
    """``"all"``, a count of devices, or a list of device indices.

    Raises :class:`DevicesSyntaxError` when ``devices`` fits none of the forms, and ``ValueError`` when
    it names a device more than once.
    """
    if isinstance(devices, bool) or devices is None:
        raise DevicesSyntaxError(devices)
    if devices == "auto" or devices == -1:
        return "all"
    if isinstance(devices, int):
        if devices <= 0:
            raise DevicesSyntaxError(devices)
        return devices
    if isinstance(devices, str):
        indices = _parse_text(devices)
    elif isinstance(devices, (list, tuple)):
        if not devices or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in devices):
            raise DevicesSyntaxError(devices)
        indices = list(devices)
    else:
        raise DevicesSyntaxError(devices)
    if isinstance(indices, list) and len(set(indices)) != len(indices):
        raise ValueError(f"devices={devices!r} names a device more than once")
    return indices


def _parse_text(devices: str) -> Literal["all"] | int | list[int]:
    text = devices.strip()
    if text in ("auto", "-1"):
        return "all"
    listed = text.startswith("[") and text.endswith("]")
    inner = text[1:-1] if listed else text
    if not listed and "," not in inner:
        if inner.isdigit() and int(inner) > 0:
            return int(inner)
        raise DevicesSyntaxError(devices)
    parts = [part.strip() for part in inner.split(",") if part.strip()]
    if not parts or not all(part.isdigit() for part in parts):
        raise DevicesSyntaxError(devices)
    return [int(part) for part in parts]
