"""Modules compiled with ``torch.compile`` before ``Fabric.setup``: taken apart, wrapped, compiled again.

A strategy must wrap the user's module itself (DistributedDataParallel around the compiled module would
hide the parameters' hooks from the compiler), so ``setup`` wraps the module inside and compiles the
wrapper again, with the compiled module's own dynamo context: the same backend, mode and options.
"""

from __future__ import annotations

import sys
from typing import Any

from torch.nn import Module


def _optimized_module_class() -> type | None:
    if "torch._dynamo" not in sys.modules:
        return None  # nothing was compiled in this process (and importing the compiler costs a second)
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # a torch without the compiler
        return None
    return OptimizedModule


def is_compiled(module: Any) -> bool:
    cls = _optimized_module_class()
    return cls is not None and isinstance(module, cls)


def split_compiled(module: Any) -> tuple[Any, Any]:
    """``(inner module, compile context)`` of a compiled module; ``(module, None)`` for any other object."""
    if not is_compiled(module):
        return module, None
    return module._orig_mod, module.dynamo_ctx


def compile_again(module: Module, context: Any) -> Module:
    """``module`` compiled with the context (backend, options) taken from another compiled module."""
    from torch._dynamo.eval_frame import OptimizedModule

    return OptimizedModule(module, context)
