"""When calling a module may skip nn.Module's call machinery: the one place that reads torch's private names for it.

``nn.Module.__call__`` runs hooks, a compiled replacement or a traced forward when there are any, and
otherwise only calls ``forward``. Deciding "there are none" needs torch's private hook registries, so a
future torch that renames or adds one must never make fabric skip a hook silently. This module names them
once, and :data:`SKIPPING_IS_SAFE` checks once, at import, that they exist and mean what the shortcut
assumes: public registration fills exactly these registries, and ``nn.Module``'s call reads them. If any
check fails, callers always take ``nn.Module.__call__`` (slower, never wrong).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn import Module
from torch.nn.modules import module as _torch_module

__all__ = ["GLOBAL_HOOKS", "INSTANCE_HOOKS", "JIT_TRACE", "SKIPPING_IS_SAFE", "calls_like_module", "skipping_is_safe"]

#: The registries of hooks that run for every module (torch fills them in place).
GLOBAL_HOOK_NAMES = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks", "_global_backward_hooks")
#: The instance-dict keys of one module's call hooks.
INSTANCE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
#: Where ``module.compile()`` puts its replacement of the call (an instance attribute; None on the class).
COMPILED_CALL = "_compiled_call_impl"
_CALL_METHODS = ("__call__", "_wrapped_call_impl", "_call_impl", "__getattribute__")

GLOBAL_HOOKS: tuple[Any, ...] = tuple(getattr(_torch_module, name, None) for name in GLOBAL_HOOK_NAMES)
#: torch.jit's tracing module: ``JIT_TRACE._trace_module_map`` is not None while a trace records module scopes
#: (what nn.Module's traced call, ``_slow_forward``, adds).
JIT_TRACE: Any = getattr(torch.jit, "_trace", None)


def calls_like_module(module_class: type) -> bool:
    """Whether calling an instance of ``module_class`` is nn.Module's call (hooks, then ``forward``), unchanged."""
    return all(getattr(module_class, name, None) is getattr(Module, name, None) for name in _CALL_METHODS)


def skipping_is_safe() -> bool:
    """Check that the private names above exist and mean what the shortcut assumes, for the installed torch."""
    try:
        if not all(isinstance(registry, dict) for registry in GLOBAL_HOOKS) or JIT_TRACE is None:
            return False
        if not hasattr(JIT_TRACE, "_trace_module_map"):
            return False
        # nn.Module's call reads exactly these registries (a new one would be a hook the shortcut misses)
        read = set(Module._call_impl.__code__.co_names) | set(Module._wrapped_call_impl.__code__.co_names)
        hook_names = {name for name in read if "hook" in name and not name.endswith(("_with_kwargs", "_always_called"))}
        if not hook_names <= {*GLOBAL_HOOK_NAMES, *INSTANCE_HOOKS} or COMPILED_CALL not in read:
            return False
        return _registration_fills_the_registries()
    except Exception:  # anything unexpected: take the safe path
        return False


def _registration_fills_the_registries() -> bool:
    """Public hook registration (on one module and globally) fills exactly the registries named above."""
    from torch.nn.modules.module import (
        register_module_forward_hook,
        register_module_forward_pre_hook,
        register_module_full_backward_hook,
        register_module_full_backward_pre_hook,
    )

    probe = Module()
    state = probe.__dict__
    if any(state.get(key) for key in INSTANCE_HOOKS) or state.get(COMPILED_CALL) is not None:
        return False
    local = [
        probe.register_forward_pre_hook(lambda *a: None),
        probe.register_forward_hook(lambda *a: None),
        probe.register_full_backward_pre_hook(lambda *a: None),
        probe.register_full_backward_hook(lambda *a: None),
    ]
    filled = all(state[key] for key in INSTANCE_HOOKS)
    for handle in local:
        handle.remove()
    registrations: tuple[Callable[..., Any], ...] = (
        register_module_forward_pre_hook,
        register_module_forward_hook,
        register_module_full_backward_pre_hook,
        register_module_full_backward_hook,
    )
    for register, registry in zip(registrations, GLOBAL_HOOKS):
        before = len(registry)
        handle = register(lambda *a: None)
        filled = filled and len(registry) == before + 1
        handle.remove()
    return filled and not any(state[key] for key in INSTANCE_HOOKS)


#: Checked once: whether ``FabricModule`` may skip nn.Module's call machinery when no hook is registered.
SKIPPING_IS_SAFE = skipping_is_safe()
