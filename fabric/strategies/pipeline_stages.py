"""Pipeline parallelism inside ``ModelParallelStrategy``: a model split into stages, run by torch's own schedules.

The model is cut into stages, either by tracing it (``torch.distributed.pipelining.pipeline`` with the names of the
modules where a new stage begins) or by the user's function; each rank of the "pipeline_parallel" dimension of the
mesh keeps its stage(s), which the user's ``parallelize_fn`` then shards over the ("data_parallel",
"tensor_parallel") sub-mesh as it would a whole model. torch's schedules (``Schedule1F1B``,
``ScheduleInterleaved1F1B``, ``ScheduleZBVZeroBubble``, ...) run forward and backward over the microbatches.

What this module adds around them:

* :class:`PipelineModule`, the one module ``setup_module`` returns: until the model is split it holds the whole model,
  under its own names; afterwards the union of this rank's stages, still under the **whole model's names** (what an
  optimizer is built from, what a checkpoint is keyed by, so that one layout loads into another). A tracing split
  needs one microbatch, so it happens at the first :meth:`PipelineModule.step`; an optimizer built before it is
  re-pointed at this rank's stage parameters then (its state, if a checkpoint was loaded into it, goes along).
* the step's numbers: the schedules run with ``scale_grads=False`` and each microbatch's loss as the user's
  ``loss_fn`` gives it, so gradients are the **sum** over microbatches; they are divided by the number of
  microbatches since the last ``optimizer.step()`` just before it (or a clip), so that k steps before one
  ``optimizer.step()`` give exactly the gradients of one step with k times the microbatches. The loss a step
  returns is the mean over its microbatches and the data-parallel ranks, on every rank.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from fabric.checkpoint.layout import join_into

__all__ = [
    "SCHEDULES",
    "PipelineError",
    "PipelineModule",
    "divide_gradients",
    "schedule_class",
    "stage_layout",
]


class PipelineError(RuntimeError):
    """A pipeline-parallel model used or set up in a way the pipeline cannot run."""


#: torch's schedules by the names ``get_schedule_class`` takes (its two base classes left out: they run nothing).
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def schedule_class(name: str) -> type:
    """torch's schedule class called ``name`` (case-insensitive), or a ValueError listing the accepted names."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    by_lower = {short.lower(): short for short in SCHEDULES}
    if not isinstance(name, str) or name.lower() not in by_lower:
        closest = difflib.get_close_matches(str(name), list(SCHEDULES), n=1, cutoff=0.5)
        hint = f"; did you mean {closest[0]!r}?" if closest else ""
        raise ValueError(f"pipeline_schedule={name!r} is not valid; accepted: {list(SCHEDULES)}{hint}")
    return get_schedule_class(by_lower[name.lower()])


def stage_layout(cls: type, pipeline_size: int, split_names: int | None) -> tuple[int, bool]:
    """(stages per rank, V-shaped) for schedule ``cls``; ``split_names``: how many split points the user gave.

    Single-stage schedules run one stage per rank; the V-shaped ones (ZBVZeroBubble, DualPipeV) two, the first and
    last stage on rank 0; the other multi-stage schedules (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble) as
    many as the split makes, a multiple of the pipeline size (two when a function splits the model).
    """
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    v_shaped = cls.__name__ in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
    if not issubclass(cls, PipelineScheduleMulti):
        per_rank = 1
    elif v_shaped or split_names is None:
        per_rank = 2
    else:
        stages = split_names + 1
        per_rank = max(1, stages // pipeline_size)
    if split_names is not None and split_names + 1 != per_rank * pipeline_size:
        wanted = per_rank * pipeline_size
        rule = "one stage per rank" if per_rank == 1 else ("two stages per rank" if v_shaped else "a whole number of stages per rank")
        raise ValueError(
            f"pipeline_split has {split_names} name(s), which make {split_names + 1} stage(s); pipeline_schedule="
            f"{cls.__name__[len('Schedule'):]!r} runs {rule}, so pipeline_parallel_size={pipeline_size} needs"
            f" {wanted} stage(s): {wanted - 1} name(s)"
        )
    return per_rank, v_shaped


def stage_indices(pipeline_rank: int, pipeline_size: int, per_rank: int, v_shaped: bool) -> list[int]:
    """The stages of pipeline rank ``pipeline_rank``: looped (r, r + p, ...), or V-shaped (r, 2p - 1 - r)."""
    if v_shaped:
        return [pipeline_rank, 2 * pipeline_size - 1 - pipeline_rank]
    return [pipeline_rank + k * pipeline_size for k in range(per_rank)]


class PipelineModule(Module):
    """This rank's stage(s) of a model split for pipeline parallelism, under the whole model's parameter names.

    Before the split it holds the whole model (its children, parameters and buffers, by the same names); the split
    replaces them by the union of this rank's stages. Calling it is refused: the pipeline's schedule runs the
    stages (``fabric.pipeline_step``).
    """

    def __init__(self, model: Module) -> None:
        super().__init__()
        _adopt(self, model)
        self.__dict__["_whole"] = model
        self.__dict__["_whole_names"] = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
        self.__dict__["_whole_keys"] = frozenset(model.state_dict().keys())
        self.__dict__["_stage_indices"] = []
        self.__dict__["_stages"] = []  # torch's PipelineStage objects
        self.__dict__["_optimizers"] = []  # optimizers to re-point at the split
        self.__dict__["_schedules"] = {}
        self.__dict__["_accumulated"] = 0  # microbatches whose gradients are summed since the last optimizer step

    @property
    def is_split(self) -> bool:
        return bool(self.__dict__["_stages"])

    @property
    def whole_model_keys(self) -> frozenset[str]:
        """Every state-dict key of the whole model: what a checkpoint of any layout holds."""
        return self.__dict__["_whole_keys"]

    @property
    def stage_indices(self) -> list[int]:
        """The indices of this rank's stages (empty before the split)."""
        return self.__dict__["_stage_indices"]

    @property
    def runs_first_stage(self) -> bool:
        return 0 in self.stage_indices

    @property
    def runs_last_stage(self) -> bool:
        return self.__dict__.get("_stage_count", 0) - 1 in self.stage_indices

    def step_loss(self, losses: list[Tensor], device: torch.device) -> Tensor:
        """The step's loss on every rank (see :func:`reduce_step_loss`), in the parameters' dtype (at least float32)."""
        holder, pipeline_group, data_group = self.__dict__["_loss_groups"]
        dtype = next((p.dtype for p in self.parameters() if p.is_floating_point()), torch.get_default_dtype())
        return reduce_step_loss(losses, holder, pipeline_group, data_group, device, torch.promote_types(dtype, torch.float32))


    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError(
            "This model is split into pipeline stages across ranks, so it cannot be called as a whole: run a step"
            " with loss = fabric.pipeline_step(model, *inputs, target=target, loss_fn=loss_fn) (backward=False to"
            " evaluate), which runs forward and backward over the microbatches"
        )

    def holds_any(self, ids: set[int]) -> bool:
        """Whether any of the parameters ``ids`` is the whole model's or one of this rank's stages'."""
        return any(id(p) in ids for p in self.parameters()) or not ids.isdisjoint(self.__dict__["_whole_names"])

    def follow(self, optimizer: Optimizer) -> None:
        """Re-point ``optimizer`` at this rank's stage parameters when the model is split (now, if it is); its
        ``zero_grad()`` starts the count of summed microbatches again (also one that keeps zeroed gradients)."""
        clear = optimizer.zero_grad
        counts = self.__dict__

        def zero_grad(set_to_none: bool = True) -> None:
            clear(set_to_none=set_to_none)
            counts["_accumulated"] = 0

        optimizer.zero_grad = zero_grad  # type: ignore[method-assign]
        if self.is_split:
            _keep_stage_parameters(optimizer, self.__dict__["_whole_names"], dict(self.named_parameters(remove_duplicate=False)))
        else:
            self.__dict__["_optimizers"].append(optimizer)

    # ---- the split ---------------------------------------------------------------------------------------------

    def split(
        self, stage_modules: Sequence[Module], indices: Sequence[int], make_stage: Callable[[Module, int], Any], stages: int,
        groups: tuple[int, Any, Any] | None = None,
    ) -> None:
        """Keep ``stage_modules`` (this rank's, already parallelized) as the model; ``make_stage(module, index)``
        builds torch's ``PipelineStage`` of each; ``stages``: how many the whole pipeline has. Optimizers that follow
        the model keep this rank's parameters. ``groups``: (the global rank holding the last stage, the pipeline's
        process group, the data-parallel one), for the step's loss."""
        whole = self.whole_model_keys
        for index, stage in zip(indices, stage_modules):
            names = (stage.module if isinstance(stage, DistributedDataParallel) else stage).state_dict().keys()
            foreign = sorted(set(names) - whole)
            if foreign:
                raise PipelineError(
                    f"stage {index} of the split names its tensors {foreign[:3]}, which are not names of the whole model"
                    f" (such as {sorted(whole)[:3]}): a stage must keep the whole model's names, so that optimizers and"
                    " checkpoints find its tensors under one name in any layout. A split function can deep-copy the"
                    " model and delete (or set to None) the modules the stage does not run"
                )
        for store in (self._modules, self._parameters, self._buffers):
            store.clear()
        self._non_persistent_buffers_set.clear()
        for stage in stage_modules:
            _adopt(self, stage)
        after = dict(self.named_parameters(remove_duplicate=False))
        for optimizer in self.__dict__["_optimizers"]:
            _keep_stage_parameters(optimizer, self.__dict__["_whole_names"], after)
        self.__dict__["_optimizers"] = []
        self.__dict__["_stage_indices"] = list(indices)
        self.__dict__["_stage_count"] = stages
        self.__dict__["_loss_groups"] = groups
        self.__dict__["_stages"] = [make_stage(module, index) for module, index in zip(stage_modules, indices)]
        self.__dict__["_whole"] = None  # the other stages' parameters go with it

    @property
    def whole_model(self) -> Module | None:
        """The whole model until the split (None after it)."""
        return self.__dict__["_whole"]

    # ---- the step ----------------------------------------------------------------------------------------------

    def schedule(self, key: Any, build: Callable[[list[Any]], Any]) -> Any:
        """The schedule for ``key`` (a loss function and a mode), built once from this rank's stages."""
        schedules = self.__dict__["_schedules"]
        if key not in schedules:
            schedules[key] = build(self.__dict__["_stages"])
        return schedules[key]

    def note_microbatches(self, count: int) -> None:
        """``count`` more microbatches' gradients were summed (a step after ``zero_grad()`` starts again from 0)."""
        if all(p.grad is None for p in self.parameters()):
            self.__dict__["_accumulated"] = 0
        self.__dict__["_accumulated"] += count

    def average_gradients(self) -> None:
        """Divide the summed gradients by the microbatches they came from (once, before a clip or a step)."""
        count = self.__dict__["_accumulated"]
        if count > 1:
            divide_gradients(self.parameters(), count)
        self.__dict__["_accumulated"] = 0


def divide_gradients(parameters: Any, count: int) -> None:
    """Divide every gradient among ``parameters`` by ``count`` (one foreach call per kind of tensor)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    plain = [grad for grad in grads if not isinstance(grad, DTensor)]
    with torch.no_grad():
        if plain:
            torch._foreach_div_(plain, count)
        for grad in grads:
            if isinstance(grad, DTensor):
                grad.div_(count)


def _adopt(into: Module, part: Module) -> None:
    """``part``'s parameters, buffers and children on ``into`` under the same names, changing neither (a plain module
    holds two stages' halves of one child, ``layers`` say)."""
    try:
        join_into(into, part)
    except ValueError as err:
        raise PipelineError(f"two pipeline stages of this rank name different tensors alike ({err}); a split must give each"
                            " tensor to one stage") from None


def _keep_stage_parameters(optimizer: Optimizer, names: dict[int, str], after: Mapping[str, Tensor]) -> None:
    """Point ``optimizer`` at the stage parameters of this rank (by the whole model's names: ``names`` maps a whole
    model parameter's id to its name) and drop the others; state it holds for a kept parameter goes with it (into the
    parameter's shards where the stage was sharded)."""
    for group in optimizer.param_groups:
        kept = []
        for parameter in group["params"]:
            name = names.get(id(parameter))
            if name is None:
                if any(parameter is stage_parameter for stage_parameter in after.values()):
                    kept.append(parameter)  # built from the split model already
                    continue
                raise PipelineError(
                    "an optimizer holds a parameter that is not the model's; create it from model.parameters() of the"
                    " module that setup_module() returned"
                )
            if name not in after:
                optimizer.state.pop(parameter, None)  # another rank's stage
                continue
            new = after[name]
            if new is not parameter and parameter in optimizer.state:
                optimizer.state[new] = {key: _like(value, new) for key, value in optimizer.state.pop(parameter).items()}
            kept.append(new)
        group["params"] = kept


def _like(value: Any, parameter: Tensor) -> Any:
    """An optimizer state tensor of a whole parameter, as the (maybe sharded) ``parameter`` holds it."""
    if not isinstance(value, Tensor) or value.shape != parameter.shape or value.dim() == 0:
        return value
    if isinstance(parameter, DTensor):
        return distribute_tensor(value.to(parameter.device), parameter.device_mesh, parameter.placements, src_data_rank=None)
    return value.to(parameter.device)


def microbatch_count(inputs: Sequence[Any], target: Any, microbatches: int) -> int:
    """The batch size of a step, checked to divide into ``microbatches`` equal microbatches (ValueError if not)."""
    tensors = [value for value in (*inputs, target) if isinstance(value, Tensor) and value.dim() > 0]
    if not tensors:
        raise ValueError("pipeline_step needs at least one tensor input (split into microbatches along its first dimension)")
    sizes = {tensor.shape[0] for tensor in tensors}
    if len(sizes) > 1:
        raise ValueError(f"pipeline_step's inputs and target have different batch sizes {sorted(sizes)}; they are split along their first dimension together")
    size = sizes.pop()
    if size % microbatches:
        raise ValueError(
            f"a batch of {size} does not divide into microbatches={microbatches}; accepted: batch sizes that are a"
            f" multiple of {microbatches} (or set ModelParallelStrategy(microbatches=...) to a divisor of {size})"
        )
    return size


def first_microbatch(values: Sequence[Any], microbatches: int) -> tuple[Any, ...]:
    """The first microbatch of ``values`` (tensors split along dimension 0), as the schedule will cut it."""
    return tuple(value.tensor_split(microbatches)[0] if isinstance(value, Tensor) and value.dim() > 0 else value for value in values)


def reduce_step_loss(
    losses: list[Tensor], holder: int, pipeline_group: Any, data_group: Any, device: torch.device, dtype: torch.dtype
) -> Tensor:
    """The step's loss on every rank, in ``dtype``: the mean of the last stage's microbatch losses (``holder``, a global
    rank, has them), broadcast over the pipeline ranks and averaged over the data-parallel ranks (in float64 meanwhile)."""
    if losses:
        value = torch.stack([loss.detach().to(torch.float64).reshape(()) for loss in losses]).mean().to(device)
    else:
        value = torch.zeros((), dtype=torch.float64, device=device)
    dist.broadcast(value, src=holder, group=pipeline_group)
    if data_group is not None and dist.get_world_size(data_group) > 1:
        dist.all_reduce(value, group=data_group)
        value /= dist.get_world_size(data_group)
    return value.to(dtype)


def forward_only_v_schedule(stages: list[Any], microbatches: int, loss_fn: Callable[[Any, Any], Tensor]) -> Any:
    """An evaluation schedule for stages placed in a V (ZBVZeroBubble, DualPipeV): torch's V-shaped schedules cannot
    run ``eval()`` (their steps steal backward inputs). Each rank runs every microbatch through its first stage,
    then its second, on torch's own schedule runtime, which adds the sends and receives (and the local hand-over
    between the two stages of the last rank)."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
    from torch.distributed.pipelining.schedules import (
        _Action,
        _add_send_recv,
        _add_unshard_reshard,
        _ComputationType,
        _PipelineScheduleRuntime,
    )

    class _ForwardOnlyV(_PipelineScheduleRuntime):
        def __init__(self) -> None:
            super().__init__(stages=stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
            mapping = generate_stage_to_rank_mapping(self.pp_group_size, self._num_stages, style="v")
            self.stage_index_to_group_rank = mapping
            for stage in self._stages:
                stage.stage_index_to_group_rank = mapping
            order: dict[int, list[_Action | None]] = {}
            for rank in range(self.pp_group_size):
                mine = sorted(index for index, holder in mapping.items() if holder == rank)
                order[rank] = [_Action(index, _ComputationType.FORWARD, micro) for index in mine for micro in range(microbatches)]
            self.pipeline_order = order
            # lowered as torch's _prepare_schedule_with_comms does, without its check that every microbatch has a
            # backward (an evaluation has none)
            self.pipeline_order_with_comms = _add_send_recv(
                {rank: _add_unshard_reshard(actions) for rank, actions in order.items()},
                stage_to_rank=lambda index: mapping[index],
                num_stages=self._num_stages,
            )

    return _ForwardOnlyV()
