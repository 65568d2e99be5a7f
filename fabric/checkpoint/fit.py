"""Does a saved entry fit the object it is loaded into? Every check of the checkpoint pipeline, in one place, each
raising :class:`CheckpointMismatchError` naming ``state[key]`` and what differs, before anything changes.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from fabric.checkpoint.errors import CheckpointMismatchError
from fabric.checkpoint.stateful import SAVED_RANKS_KEY, checks_state, is_optional_entry, is_stateful, keeps_saved_ranks

__all__ = [
    "CheckpointMismatchError",
    "check_entries_present",
    "check_entry",
    "check_kind",
    "check_module_fits",
    "check_optimizer_fits",
    "check_optimizer_state_fits",
    "check_optimizer_state_shapes",
    "check_plain_value",
    "check_saved_ranks",
    "check_state_dict_fits",
    "check_stateful_entry",
    "tensor_shapes",
]


def check_entries_present(path: str | os.PathLike, state: dict[str, Any], saved: Any, strict: bool) -> None:
    """KeyError if ``strict`` and some key of ``state`` has no entry among ``saved``'s keys (an ``OptionalStateful``
    entry may be missing)."""
    missing = [key for key in state if key not in saved and not is_optional_entry(state[key])]
    if missing and strict:
        raise CheckpointMismatchError(
            f"Checkpoint {str(path)!r} has no entry for {missing} (it holds {sorted(saved)});"
            " pass strict=False to load the entries it has"
        )


def check_stateful_entry(key: str, obj: Any, saved: Any) -> None:
    """Ask a ``CheckedStateful`` entry whether ``saved`` fits it (ValueError naming ``state[key]`` if not)."""
    if not checks_state(obj):
        return
    try:
        obj.check_state_dict(saved)
    except ValueError as err:
        raise CheckpointMismatchError(f"state[{key!r}]: {err}") from None


def check_saved_ranks(present: dict[str, Any], saved_entry: Callable[[str], Any], record: Any) -> dict[str, Any]:
    """For each ``SavedRanksStateful`` entry of ``present`` that ``record`` (the checkpoint's ``SAVED_RANKS_KEY``
    entry) holds, the state it loads on this rank; raise if none fits. ``saved_entry(key)``: the entry as written."""
    keys = [key for key, obj in present.items() if keeps_saved_ranks(obj)]
    if not keys:
        return {}
    states = record.get("states") if isinstance(record, dict) else None
    world_size = record.get("world_size") if isinstance(record, dict) else None
    if not isinstance(states, dict) or isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise CheckpointMismatchError(
            f"The checkpoint's record of the saving processes ({SAVED_RANKS_KEY!r}) is not"
            " {'world_size': int >= 1, 'states': {key: [one state per rank]}}; was it written by fabric?"
        )
    resolved = {}
    for key in keys:
        if key not in states:
            continue  # saved as something else (a plain value, a loader without a state of its own)
        saved = states[key]
        if not isinstance(saved, list) or len(saved) != world_size:
            count = len(saved) if isinstance(saved, list) else type(saved).__name__
            raise CheckpointMismatchError(
                f"state[{key!r}]: the checkpoint keeps {count} rank state(s) for it, but says {world_size} process(es) saved it"
            )
        try:
            resolved[key] = present[key].state_from_saved_ranks(saved_entry(key), saved)
        except ValueError as err:
            raise CheckpointMismatchError(f"state[{key!r}]: {err}") from None
    return resolved


def check_entry(key: str, obj: Any, saved: Any, strict: bool) -> None:
    """Raise (naming ``state[key]``) if ``saved`` cannot be loaded into ``obj``."""
    if not isinstance(obj, (Module, Optimizer)):
        check_stateful_entry(key, obj, saved)
        return
    try:
        if isinstance(obj, Module):
            check_state_dict_fits(obj, saved, strict=strict)
        else:
            check_optimizer_state_fits(obj, saved)
    except (KeyError, RuntimeError, ValueError, TypeError) as err:
        message = err.args[0] if err.args else str(err)
        raise CheckpointMismatchError(f"state[{key!r}]: {message}") from None


# (object, value) pairs the load walk has checked already, while it applies them through the strategy's hooks
_CHECKED: ContextVar[frozenset[tuple[int, int]]] = ContextVar("fabric_checked_entries", default=frozenset())


@contextmanager
def checked(pairs: Iterable[tuple[Any, Any]]) -> Iterator[None]:
    """Within this block the hooks' checks of these ``(object, value)`` pairs are skipped: the load walk checked
    them before anything changed (a strategy's ``load_module_state_dict`` called directly still checks)."""
    token = _CHECKED.set(frozenset((id(obj), id(value)) for obj, value in pairs))
    try:
        yield
    finally:
        _CHECKED.reset(token)


def check_state_dict_fits(module: Module, state_dict: Any, strict: bool = True) -> None:
    """Raise before loading if ``state_dict`` would not load into ``module`` whole: ``Module.load_state_dict``
    copies the matching tensors before it reports a shape mismatch, leaving the module half-loaded."""
    if (id(module), id(state_dict)) in _CHECKED.get():
        return
    if not isinstance(state_dict, dict):
        raise CheckpointMismatchError(f"Expected a state dict (a dict of tensors) for {type(module).__name__}, got {type(state_dict).__name__}")
    check_module_fits(type(module).__name__, module.state_dict(), tensor_shapes(state_dict), strict)


def check_optimizer_state_fits(optimizer: Optimizer, state_dict: Any) -> None:
    """Raise ValueError if ``state_dict`` is not an optimizer state with the same parameter group sizes."""
    if (id(optimizer), id(state_dict)) in _CHECKED.get():
        return
    if not isinstance(state_dict, dict) or "param_groups" not in state_dict:
        raise CheckpointMismatchError(f"Expected an optimizer state dict for {type(optimizer).__name__}, got {type(state_dict).__name__}")
    saved = [len(group["params"]) for group in state_dict["param_groups"]]
    current = [len(group["params"]) for group in optimizer.param_groups]
    if saved != current:
        raise CheckpointMismatchError(
            f"The optimizer state does not fit {type(optimizer).__name__}: parameter group sizes {saved} in the"
            f" checkpoint, {current} in the optimizer"
        )
    saved_state = state_dict.get("state")
    if not isinstance(saved_state, dict):
        return
    params = [param for group in optimizer.param_groups for param in group["params"]]
    numbers = [number for group in state_dict["param_groups"] for number in group["params"]]
    for number, param in zip(numbers, params):
        entry = saved_state.get(number)
        if isinstance(entry, dict):
            _check_state_tensors(f"parameter {number}", entry, optimizer.state.get(param), tuple(param.shape))


#: Optimizer states of torch's optimizers that hold one value per element of their parameter.
ELEMENTWISE_STATES = frozenset(
    {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "sum", "square_avg", "acc_delta", "ax", "prev",
     "step_size", "exp_inf", "grad_avg"}
)


def check_optimizer_state_shapes(key: str, saved_state: dict[Any, Any], current_state: dict[Any, Any]) -> None:
    """Every saved per-parameter state tensor has the shape of the one the optimizer holds now (by name)."""
    for name, entry in saved_state.items():
        current = current_state.get(name)
        if isinstance(entry, dict) and isinstance(current, dict):
            try:
                _check_state_tensors(f"parameter {name!r}", entry, current, None)
            except CheckpointMismatchError as err:
                raise CheckpointMismatchError(f"state[{key!r}]: {err}") from None


def _check_state_tensors(what: str, saved: dict[str, Any], current: Any, param_shape: tuple[int, ...] | None) -> None:
    """A saved state tensor must have the shape of the optimizer's own (if it has one yet), and an elementwise
    state (``exp_avg``, ``momentum_buffer``, ...) the parameter's: else it loads and fails only at ``step()``."""
    for name, value in saved.items():
        if not isinstance(value, Tensor) or value.dim() == 0:
            continue
        own = current.get(name) if isinstance(current, dict) else None
        if isinstance(own, Tensor) and own.dim() > 0:
            expected: tuple[int, ...] | None = tuple(own.shape)
        else:
            expected = param_shape if name in ELEMENTWISE_STATES else None
        if expected is not None and tuple(value.shape) != expected:
            raise CheckpointMismatchError(
                f"The optimizer state of {what} does not fit: {name!r} has shape {tuple(value.shape)} in the"
                f" checkpoint, but {expected} here"
            )


#: How many keys a message names before it says "and N more".
SHOWN_KEYS = 20


def check_module_fits(what: str, target: dict[str, Any], saved_shapes: dict[str, tuple[int, ...] | None], strict: bool) -> None:
    """Raise naming every problem (up to :data:`SHOWN_KEYS` keys of each kind) if a saved module entry cannot load
    into the state dict ``target``: the keys missing or unexpected (``strict``), and each tensor whose shape
    differs, with both shapes. From each saved name's global shape (None: not a tensor), so the check needs no
    saved data, only its index."""
    missing = [name for name in target if name not in saved_shapes]
    unexpected = [name for name in saved_shapes if name not in target]
    if not strict and target and saved_shapes and len(missing) == len(target):
        warnings.warn(
            f"load(strict=False): none of the checkpoint's keys for {what} matches the model's, so nothing is loaded"
            f" into it (checkpoint: {_some(saved_shapes)}; model: {_some(target)})",
            stacklevel=5,
        )
    problems = []
    if strict and (missing or unexpected):
        problems.append(
            f"missing keys {_listed(missing)}, unexpected keys {_listed(unexpected)};"
            " pass strict=False to load the keys that match"
        )
    reshaped = [
        (name, tuple(shape), tuple(value.shape))
        for name, shape in saved_shapes.items()
        if shape is not None and isinstance(value := target.get(name), Tensor) and tuple(value.shape) != tuple(shape)
    ]
    if len(reshaped) == 1:
        name, saved, current = reshaped[0]
        problems.append(f"{name!r} has shape {saved} in the checkpoint but {current} in the model")
    elif reshaped:
        lines = [f"\n  {name!r} has shape {saved} in the checkpoint but {current} in the model" for name, saved, current in reshaped]
        more = len(reshaped) - SHOWN_KEYS
        problems.append(
            f"{len(reshaped)} tensors have another shape in the model:{''.join(lines[:SHOWN_KEYS])}"
            + (f"\n  and {more} more" if more > 0 else "")
        )
    if problems:
        raise CheckpointMismatchError(f"The checkpoint does not fit {what}: " + "; ".join(problems))


def check_optimizer_fits(key: str, saved: dict[str, Any], target: dict[str, Any]) -> None:
    """ValueError if the saved (name-keyed) optimizer state was made for other parameters."""
    saved_groups = [list(group["params"]) for group in saved.get("param_groups", [])]
    target_groups = [list(group["params"]) for group in target["param_groups"]]
    if saved_groups != target_groups:
        raise CheckpointMismatchError(
            f"state[{key!r}]: the checkpoint's optimizer updates parameters {saved_groups}, this one {target_groups}"
        )


def _some(names: Any, shown: int = 5) -> str:
    names = list(names)
    return ", ".join(map(repr, names[:shown])) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _listed(names: list[str], shown: int = SHOWN_KEYS) -> str:
    """``['a', 'b']``, or the first ``shown`` of them and how many more."""
    return repr(names) if len(names) <= shown else f"{names[:shown]!r} and {len(names) - shown} more"


def tensor_shapes(entry: Any) -> dict[str, tuple[int, ...] | None]:
    return {name: tuple(value.shape) if isinstance(value, Tensor) else None for name, value in entry.items()}


def check_kind(key: str, kind: str, saved_kind: str) -> None:
    """A module, an optimizer or another object here must be the same kind of entry in the checkpoint."""
    if kind != saved_kind:
        here, saved = _KINDS.get(kind, kind), _KINDS.get(saved_kind, saved_kind)
        raise CheckpointMismatchError(f"state[{key!r}] is {here} here but the checkpoint holds {saved} under that key")


_KINDS = {"module": "a module", "optimizer": "an optimizer", "other": "a plain value or Stateful object"}

#: what a module's or an optimizer's entry loads into (by the kinds of ``layout``)
_LOADS_INTO = {"module": ("a module's", "torch.nn.Module"), "optimizer": ("an optimizer's", "torch.optim.Optimizer")}


def check_plain_value(key: str, obj: Any, saved_kind: str) -> None:
    """A plain value in ``state``, which loading replaces by the saved one, must not stand where the checkpoint holds
    a module's or an optimizer's state dict: a str or an int there is a mistake that replacing would hide. ``None``
    and a dict stand for the entry itself, as in Lightning Fabric (a file cannot tell a module's state dict from a
    plain dict of tensors); a sharded folder, which stores the two apart, refuses them in its own check."""
    if saved_kind not in _LOADS_INTO or obj is None or isinstance(obj, (Module, Optimizer, Mapping)) or is_stateful(obj):
        return
    whose, target = _LOADS_INTO[saved_kind]
    shown = repr(obj)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    raise CheckpointMismatchError(
        f"state[{key!r}] is a {type(obj).__name__} ({shown}), but the checkpoint holds {whose} state dict under that key,"
        f" which loads into a {target}: put that object in state[{key!r}], or leave the key out and load() returns the entry"
    )
