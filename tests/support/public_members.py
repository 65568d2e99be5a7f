"""Describe a class's public members as plain data, so two ``Fabric`` classes can be compared without importing both.

``scripts/lightning_signatures.py`` writes Lightning's description to a JSON file under its own interpreter;
``tests/test_dropin.py`` describes ours the same way and compares. Standard library only: it runs in both.
"""

from __future__ import annotations

import inspect
from typing import Any


def describe(cls: type) -> dict[str, dict[str, Any]]:
    """``{name: {"kind": ..., "parameters": [...]}}`` for every public member of ``cls`` and its constructor."""
    names = sorted(name for name in dir(cls) if not name.startswith("_"))
    return {name: describe_member(cls, name) for name in ["__init__", *names]}


def describe_member(cls: type, name: str) -> dict[str, Any]:
    raw = inspect.getattr_static(cls, name)
    if isinstance(raw, property):
        return {"kind": "property", "settable": raw.fset is not None}
    if isinstance(raw, staticmethod):
        kind = "staticmethod"
    elif isinstance(raw, classmethod):
        kind = "classmethod"
    elif inspect.isfunction(raw):
        kind = "method"
    else:
        return {"kind": "attribute", "type": type(raw).__name__}
    parameters = inspect.signature(getattr(cls, name)).parameters.values()
    return {"kind": kind, "parameters": [describe_parameter(p) for p in parameters]}


def describe_parameter(parameter: inspect.Parameter) -> dict[str, Any]:
    default = None if parameter.default is inspect.Parameter.empty else default_text(parameter.default)
    return {"name": parameter.name, "kind": parameter.kind.name, "default": default}


def default_text(value: Any) -> str:
    """``repr`` of a default; a function (a private "nothing given" sentinel) is only ``<function>``: its name and address are no API."""
    if inspect.isfunction(value):
        return "<function>"
    return repr(value)
