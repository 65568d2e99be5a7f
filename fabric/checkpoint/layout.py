"""How a checkpoint's state dict is laid out, independent of how many processes wrote it.

Modules and optimizers go through ``torch.distributed.checkpoint.state_dict``, whose fully-qualified parameter names
(no ``module.`` prefix from DDP, DTensors under ``fully_shard``) fit any parallel layout. A sharded checkpoint stores
each tensor under a flat key (``"model/layer.weight"``) and the rest as a *skeleton*: the nested state with tensors
replaced by ``None``, plus each flat key's path into it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Mapping
from functools import reduce
from operator import getitem
from typing import Any

from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from fabric.checkpoint.errors import CheckpointMismatchError

MODULE = "module"
OPTIMIZER = "optimizer"
OTHER = "other"

Path_ = tuple[Any, ...]


def kind_of(obj: Any) -> str:
    if isinstance(obj, Module):
        return MODULE
    if isinstance(obj, Optimizer):
        return OPTIMIZER
    return OTHER


def kind_saved_in(entry: Any) -> str:
    """What an entry of a checkpoint file was saved from, as far as its value shows (a file keeps no kinds): the form
    of every optimizer state dict (torch's and the distributed API's), a non-empty dict of tensors by name (as a plain
    dict of tensors also looks), or ``OTHER``."""
    if not isinstance(entry, Mapping) or not entry:
        return OTHER
    groups = entry.get("param_groups")
    if (
        set(entry) == {"state", "param_groups"}
        and isinstance(entry["state"], Mapping)
        and isinstance(groups, list)
        and all(isinstance(group, Mapping) and "params" in group for group in groups)
    ):
        return OPTIMIZER
    if all(isinstance(name, str) and isinstance(value, Tensor) for name, value in entry.items()):
        return MODULE
    return OTHER


def parameters_and_buffers(objects: Iterable[Any]) -> Iterator[Tensor]:
    """The parameters and buffers of the modules, and the parameters of the optimizers, among ``objects``."""
    for obj in objects:
        if isinstance(obj, Module):
            yield from obj.parameters()
            yield from obj.buffers()
        elif isinstance(obj, Optimizer):
            yield from (param for group in obj.param_groups for param in group["params"])


def module_of(optimizer: Optimizer, modules: Iterable[Module], refusal: str, error: type[ValueError] = ValueError) -> Module:
    """The module that names ``optimizer``'s parameters, from among ``modules``: the first that holds every one of them,
    else those that hold some, seen as one (:func:`as_one_module`: an optimizer over several modules of this rank, as
    the stages of one model in a pipeline). The one rule of every path that hands an optimizer to torch's state-dict
    API; ``error(refusal)`` where some parameter belongs to none of them (or two of them name different ones alike)."""
    wanted = {id(param) for group in optimizer.param_groups for param in group["params"]}
    holding: list[Module] = []
    covered: set[int] = set()
    for module in dict.fromkeys(modules):  # (each once, in order)
        own = {id(param) for param in module.parameters()}
        if wanted <= own:
            return module
        if wanted & own:
            holding.append(module)
            covered |= own
    if not holding or not wanted <= covered:
        raise error(refusal)
    try:
        return as_one_module(holding)
    except ValueError as err:
        raise error(f"{refusal} ({err})") from None


def module_in_state(optimizer: Optimizer, state: dict[str, Any], key: str, error: type[ValueError] = ValueError) -> Module:
    """:func:`module_of` among the modules of ``state``, in which ``state[key]`` is ``optimizer``."""
    refusal = (
        f"state[{key!r}] is an optimizer whose parameters belong to no single module in the state, nor to several of"
        f" them together (keys: {sorted(state)}): put the model it trains in the same state dict, e.g."
        " {'model': model, 'optimizer': optimizer}"
    )
    return module_of(optimizer, (obj for obj in state.values() if isinstance(obj, Module)), refusal, error)


class _Joined(Module):
    """A module of :func:`as_one_module` that stands for the same place in several of the modules joined."""


def as_one_module(modules: Iterable[Module]) -> Module:
    """``modules`` as one module whose parameters keep the names each gives them (stages cut from one model keep the
    model's names): plain modules where two of them have a submodule of the same name, theirs everywhere else, no
    tensor copied. For naming an optimizer's parameters; ValueError where two of them name different parameters alike."""
    root = _Joined()
    for module in modules:
        join_into(root, module)
    return root


def join_into(into: Module, module: Module) -> None:
    """Register ``module``'s parameters, buffers and children on ``into`` under the names ``module`` gives them (DDP's
    and ``torch.compile``'s wrappers left out), changing neither: where ``into`` already holds another child of one
    name, a plain module holds both. ValueError where the two name different tensors alike."""
    _join(into, _unwrapped(module), "")


def _unwrapped(module: Module) -> Module:
    """``module`` without DDP's or ``torch.compile``'s wrapper, whose prefixes torch's state-dict API leaves out."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(module, DistributedDataParallel):
            module = module.module
        else:
            inner = getattr(module, "_orig_mod", None)  # torch.compile's OptimizedModule
            if not isinstance(inner, Module):
                return module
            module = inner


def _join(into: Module, module: Module, prefix: str) -> None:
    for name, param in module.named_parameters(recurse=False):
        held = into._parameters.get(name)
        if held is None:
            into.register_parameter(name, param)
        elif held is not param:
            raise ValueError(f"two of its modules name different parameters {prefix + name!r}")
    for name, buffer in module.named_buffers(recurse=False):
        kept = into._buffers.get(name)
        if kept is None:
            into.register_buffer(name, buffer, persistent=name not in module._non_persistent_buffers_set)
        elif kept is not buffer:
            raise ValueError(f"two of its modules name different buffers {prefix + name!r}")
    for name, child in module.named_children():
        existing = into._modules.get(name)
        if existing is None:
            into.add_module(name, child)
        elif existing is not child:
            if not isinstance(existing, _Joined):  # two modules at one place: a plain module holds both
                joined = _Joined()
                _join(joined, existing, f"{prefix}{name}.")
                into._modules[name] = existing = joined
            _join(existing, child, f"{prefix}{name}.")


def whole_model_keys(module: Module) -> frozenset[str] | None:
    """The state-dict keys of the whole model ``module`` holds a part of (this rank's pipeline stages declare them as
    ``whole_model_keys``), or None for a module that is a model of its own. A checkpoint of such a part holds the whole
    model, written by every rank its part: the keys are checked against the whole model's, the tensors against the
    part's, and a load takes the part's."""
    keys = getattr(module, "whole_model_keys", None)
    return keys if isinstance(keys, frozenset) else None


def optimizer_part(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """The entries of a name-keyed optimizer state ``saved`` (of a whole model) for the parameters ``current`` names
    (this rank's part of it): its state, and each group's parameters in the saved order."""
    names = {name for group in current["param_groups"] for name in group["params"]}
    return {
        **saved,
        "state": {name: value for name, value in saved.get("state", {}).items() if name in names},
        "param_groups": [{**group, "params": [name for name in group["params"] if name in names]} for group in saved.get("param_groups", [])],
    }


def merge_parts(parts: list[tuple[dict[str, Any], dict[str, Path_]]], kinds: dict[str, str]) -> tuple[dict[str, Any], dict[str, Path_]]:
    """One (skeleton, paths) from every rank's (each its part of the modules and optimizers: pipeline stages), in rank
    order: each module's names, each optimizer's state and group parameters, every tensor's path; the rest rank 0's."""
    skeleton: dict[str, Any] = {}
    paths: dict[str, Path_] = {}
    for part_skeleton, part_paths in parts:
        paths.update(part_paths)
        for key, entry in part_skeleton.items():
            held = skeleton.get(key)
            if held is None or kinds.get(key) == OTHER:
                skeleton.setdefault(key, entry)
            elif kinds[key] == MODULE:
                held.update(entry)
            else:  # an optimizer: its states by name, and each group's parameters (the groups alike on every rank)
                held.setdefault("state", {}).update(entry.get("state", {}))
                for group, more in zip(held.get("param_groups", []), entry.get("param_groups", [])):
                    group["params"] = list(dict.fromkeys([*group["params"], *more["params"]]))
    return skeleton, paths


class DistributedStateDicts:
    """What modules and optimizers of ``state`` become through torch's distributed state-dict API (a ``StateDictSource``
    for :func:`fabric.checkpoint.state.collect_states`); with ``full_state_dict`` options, whole tensors. ``error``: the
    class an optimizer without a module in ``state`` is refused with (a load's: ``CheckpointMismatchError``)."""

    def __init__(self, state: dict[str, Any], options: Any, error: type[ValueError] = ValueError) -> None:
        self._state = state
        self._options = options
        self._error = error

    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(module, options=self._options)

    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        key = next(key for key, value in self._state.items() if value is optimizer)
        return get_optimizer_state_dict(module_in_state(optimizer, self._state, key, self._error), optimizer, options=self._options)


def split_tensors(entries: dict[str, Any], kinds: dict[str, str]) -> tuple[dict[str, Any], dict[str, Tensor], dict[str, Path_]]:
    """(skeleton, flat key -> tensor, flat key -> path) for the module and optimizer entries; other entries stay
    whole in the skeleton (rank 0 writes them, as in a single-file checkpoint)."""
    tensors: dict[str, Tensor] = {}
    paths: dict[str, Path_] = {}

    def visit(value: Any, path: Path_) -> Any:
        if isinstance(value, Tensor):
            flat = "/".join(str(part) for part in path)
            if flat in tensors:
                raise ValueError(f"Two tensors of the checkpoint share the name {flat!r}; rename one of the keys")
            tensors[flat] = value
            paths[flat] = path
            return None
        if isinstance(value, dict):
            return {name: visit(item, (*path, name)) for name, item in value.items()}
        if isinstance(value, (list, tuple)) and any(_holds_tensor(item) for item in value):
            return [visit(item, (*path, index)) for index, item in enumerate(value)]
        return value

    skeleton = {key: visit(value, (key,)) if kinds[key] != OTHER else value for key, value in entries.items()}
    return skeleton, tensors, paths


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(item) for item in value)
    return False


def fill(skeleton_entry: Any, tensors: dict[str, Tensor], paths: dict[str, Path_], key: str) -> Any:
    """A copy of one skeleton entry with the given tensors put back; leaves that stay ``None`` are dropped
    from dicts (tensors not loaded), so a partial load does not hand ``None`` to ``load_state_dict``."""
    entry = copy.deepcopy(skeleton_entry)
    placed = set()
    for flat, path in paths.items():
        if path[0] == key and flat in tensors:
            reduce(getitem, path[1:-1], entry)[path[-1]] = tensors[flat]
            placed.add(path[1:])
    unplaced = [path[1:] for path in paths.values() if path[0] == key and path[1:] not in placed]
    for path in sorted(unplaced, key=len, reverse=True):
        container = reduce(getitem, path[:-1], entry)
        if isinstance(container, dict):
            del container[path[-1]]
    return entry


# ---- optimizer state: named by parameter (sharded form) or numbered (torch's own form) ---------------


def optimizer_numbered(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The parameter-name-keyed optimizer state in ``Optimizer.state_dict()``'s numbered form: a full checkpoint
    stores this form so that a plain ``optimizer.load_state_dict`` reads it."""
    numbers: dict[Any, int] = {}
    groups = []
    for group in state_dict["param_groups"]:
        groups.append({**group, "params": [numbers.setdefault(name, len(numbers)) for name in group["params"]]})
    state = {numbers[name]: value for name, value in state_dict["state"].items() if name in numbers}
    return {"state": state, "param_groups": groups}


def optimizer_named(state_dict: dict[str, Any], target: dict[str, Any], key: str) -> dict[str, Any]:
    """A numbered optimizer state renamed after ``target``'s parameter names (same order of parameters)."""
    groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if not isinstance(groups, list) or "state" not in state_dict:
        raise CheckpointMismatchError(f"state[{key!r}]: the checkpoint entry is not an optimizer state dict")
    if all(isinstance(name, str) for group in groups for name in group["params"]):
        return state_dict
    names = [name for group in target["param_groups"] for name in group["params"]]
    sizes = [len(group["params"]) for group in groups]
    target_sizes = [len(group["params"]) for group in target["param_groups"]]
    if sizes != target_sizes:
        raise CheckpointMismatchError(
            f"state[{key!r}]: the checkpoint's optimizer has parameter groups of sizes {sizes}, this one {target_sizes}"
        )
    number_to_name = dict(zip((number for group in groups for number in group["params"]), names))
    state = {number_to_name[number]: value for number, value in state_dict["state"].items() if number in number_to_name}
    renamed = [{**group, "params": list(target_group["params"])} for group, target_group in zip(groups, target["param_groups"])]
    if len(number_to_name) != len(names):
        raise CheckpointMismatchError(f"state[{key!r}]: the checkpoint's optimizer numbers its parameters inconsistently")
    return {"state": state, "param_groups": renamed}


def keep_saved_group_options(optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
    """Put back each param group's options as saved: torch's ``set_optimizer_state_dict`` may retype them (tuple betas to lists)."""
    for group, saved_group in zip(optimizer.param_groups, state_dict["param_groups"]):
        group.update({name: value for name, value in saved_group.items() if name != "params"})


def plain_copy(value: Tensor) -> Tensor:
    """A CPU copy of a tensor or of a DTensor's local shard (kept a DTensor with the same layout)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        local = value.to_local().detach().to("cpu", copy=True)
        return DTensor.from_local(
            local, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
        )
    return value.detach().to("cpu", copy=True)
