"""Attribute access for the packages that import their contents on first use.

``fabric.utilities.types`` or ``fabric.strategies.fsdp`` reached as an attribute (``import fabric.utilities``
alone, then the attribute) must give the submodule, as in a package that imports its submodules eagerly
(Lightning Fabric's do): the lazy packages' ``__getattr__`` ends here.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

__all__ = ["submodule"]


def submodule(package: str, name: str) -> ModuleType:
    """``package.name`` imported, if ``package`` has such a submodule; AttributeError naming both otherwise."""
    if not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
        return importlib.import_module(f"{package}.{name}")
    raise AttributeError(f"module {package!r} has no attribute {name!r}")
