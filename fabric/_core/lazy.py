"""Attribute access for the packages that import their contents on first use.

A lazy package's ``__getattr__`` is :func:`lazy_attributes`: the names it lists come from their modules when first
asked for, and ``fabric.utilities.types`` or ``fabric.strategies.fsdp`` reached as an attribute (``import
fabric.utilities`` alone, then the attribute) gives the submodule, as in a package that imports its submodules
eagerly (Lightning Fabric's do).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

__all__ = ["lazy_attributes", "submodule"]


def lazy_attributes(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package``: each name of ``homes`` (name -> the module it lives in) imported from
    its module on first use, any other a submodule (:func:`submodule`)."""

    def __getattr__(name: str) -> Any:
        if name in homes:
            return getattr(importlib.import_module(homes[name]), name)
        return submodule(package, name)

    return __getattr__


def submodule(package: str, name: str) -> ModuleType:
    """``package.name`` imported, if ``package`` has such a submodule; AttributeError naming both otherwise."""
    if not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
        return importlib.import_module(f"{package}.{name}")
    raise AttributeError(f"module {package!r} has no attribute {name!r}")
