"""Tensor parallelism combined with fully sharded data parallelism, chosen by the user's own function, and
pipeline parallelism around both.

The ranks form a ``DeviceMesh``: (data parallel x tensor parallel), or with ``pipeline_parallel_size > 1``
(pipeline parallel x data parallel x tensor parallel). The user's ``parallelize_fn`` gets a module and the 2-D
("data_parallel", "tensor_parallel") mesh and applies ``torch.distributed.tensor.parallel`` plans and
``fully_shard`` as they see fit; under pipeline parallelism it gets each stage of this rank instead of the whole
model, with the same 2-D mesh, so a function written for one works for the other. The stages, their schedule and
the step live in ``pipeline_stages.py``; a step is ``fabric.pipeline_step(model, *inputs, target=, loss_fn=)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from fabric.strategies.pipeline_stages import (
    PipelineError,
    PipelineModule,
    divide_gradients,
    first_microbatch,
    forward_only_v_schedule,
    microbatch_count,
    schedule_class,
    stage_indices,
    stage_layout,
)
from fabric.strategies.sharding import (
    ShardedStrategy,
    broadcast_module_from_rank_zero,
    clip_grad_norm_over_shards,
    has_meta_tensors,
    move_plain_tensors,
)

MESH_DIMENSIONS = ("data_parallel", "tensor_parallel")
#: The mesh's dimensions under pipeline parallelism: the pipeline's ranks outermost.
PIPELINE_MESH_DIMENSIONS = ("pipeline_parallel", *MESH_DIMENSIONS)


class ModelParallelStrategy(ShardedStrategy):
    """2-D parallelism (Lightning Fabric's arguments): the user's ``parallelize_fn`` shards the model; and
    pipeline parallelism over a third dimension of the mesh.

    Args:
        parallelize_fn: ``fn(module, device_mesh) -> module`` applying tensor parallelism and/or
            ``fully_shard``; ``device_mesh`` has the dimensions "data_parallel" and "tensor_parallel".
        data_parallel_size: ranks that see different data; "auto" is the number of nodes (under pipeline
            parallelism: the ranks the pipeline and tensor parallelism leave).
        tensor_parallel_size: ranks that split each layer; "auto" is the number of processes per node (under
            pipeline parallelism: 1).
        save_distributed_checkpoint: save a folder of shards (True) or one full file (False).
        process_group_backend, timeout: as for DDP.
        start_method: "popen" (re-run the script), "spawn", "fork" or "forkserver".
        pipeline_parallel_size: ranks the model's stages are spread over (1: no pipeline, as before).
        pipeline_split: where the model is cut into stages: the names of the modules where a new stage begins
            (``["layers.4"]``, found by tracing the model with the first step's microbatch; parameter names are kept),
            or a function ``(module, stage_index, num_stages) -> stage module`` for models that do not trace.
        pipeline_schedule: torch's schedule by name: "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS",
            "InterleavedZeroBubble", "ZBVZeroBubble" or "DualPipeV".
        microbatches: how many microbatches a step's batch is split into (default: the number of stages).
    """

    def __init__(
        self,
        parallelize_fn: Callable[[Module, Any], Module],
        data_parallel_size: int | str = "auto",
        tensor_parallel_size: int | str = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = timedelta(seconds=1800),
        start_method: str = "popen",
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision: Any = None,
        *,
        pipeline_parallel_size: int = 1,
        pipeline_split: Sequence[str] | Callable[[Module, int, int], Module] | None = None,
        pipeline_schedule: str = "1F1B",
        microbatches: int | None = None,
    ) -> None:
        super().__init__(
            accelerator, parallel_devices, cluster_environment, checkpoint_io, precision, process_group_backend, timeout, start_method
        )
        if not callable(parallelize_fn):
            raise TypeError(f"parallelize_fn={parallelize_fn!r} must be a function (module, device_mesh) -> module")
        for name, size in (("data_parallel_size", data_parallel_size), ("tensor_parallel_size", tensor_parallel_size)):
            if size != "auto" and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
                raise ValueError(f"{name}={size!r} is not valid; accepted: 'auto' or an int >= 1")
        self._parallelize_fn = parallelize_fn
        self._data_parallel_size = data_parallel_size
        self._tensor_parallel_size = tensor_parallel_size
        self._save_distributed_checkpoint = save_distributed_checkpoint
        self._full_checkpoints = not save_distributed_checkpoint
        self._pipeline_size = _positive_int("pipeline_parallel_size", pipeline_parallel_size)
        self._schedule_class = schedule_class(pipeline_schedule)
        self._pipeline_split = _checked_split(pipeline_split, self._pipeline_size)
        # without a pipeline the split is not used (a script may keep it for another layout)
        names = None if self._pipeline_split is None or callable(self._pipeline_split) or not self._pipelined else len(self._pipeline_split)
        self._stages_per_rank, self._v_shaped = stage_layout(self._schedule_class, self._pipeline_size, names)
        if self._pipelined and not save_distributed_checkpoint:
            raise ValueError(
                f"save_distributed_checkpoint=False cannot be used with pipeline_parallel_size={self._pipeline_size}: no"
                " rank holds the whole model to write one file; save the sharded checkpoint (every rank its stages) and"
                " make one file of it with `fabric-torch consolidate CHECKPOINT FILE`"
            )
        self._microbatches = (
            self._stages_per_rank * self._pipeline_size if microbatches is None else _positive_int("microbatches", microbatches)
        )
        self._sequential_microbatches = 0  # without a pipeline: microbatches summed since the last optimizer step

    @property
    def pipeline_parallel_size(self) -> int:
        return self._pipeline_size

    @property
    def _pipelined(self) -> bool:
        return self._pipeline_size > 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Ranks of one tensor-parallel group (and every stage of a pipeline) read the same batches: shard data over
        the data-parallel dimension."""
        mesh = self.device_mesh["data_parallel"]
        return {"num_replicas": mesh.size(), "rank": mesh.get_local_rank()}

    @override
    def _build_device_mesh(self) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        from fabric.utilities.exceptions import MeshMismatchError

        pipeline = self._pipeline_size
        if self._pipelined:
            data, tensor = self._data_parallel_size, self._tensor_parallel_size
            rest = self.world_size // pipeline if self.world_size % pipeline == 0 else 0
            if tensor == "auto":
                tensor = 1 if data == "auto" else max(rest // int(data), 1)
            if data == "auto":
                data = max(rest // int(tensor), 1)
        else:
            data = self.num_nodes if self._data_parallel_size == "auto" else self._data_parallel_size
            tensor = self.num_processes if self._tensor_parallel_size == "auto" else self._tensor_parallel_size
            if self._data_parallel_size == "auto" and self._tensor_parallel_size != "auto":
                data = self.world_size // int(tensor)
            elif self._tensor_parallel_size == "auto" and self._data_parallel_size != "auto":
                tensor = self.world_size // int(data)
        if pipeline * int(data) * int(tensor) != self.world_size:
            made = f"{pipeline} x {data} x {tensor}" if self._pipelined else f"{data} x {tensor}"
            given = f"pipeline_parallel_size={pipeline}, " if self._pipelined else ""
            raise MeshMismatchError(
                f"{given}data_parallel_size={self._data_parallel_size!r} and tensor_parallel_size="
                f"{self._tensor_parallel_size!r} make a {made} mesh, but the job has {self.world_size} ranks; their product"
                " must equal it"
            )
        if self._pipelined:
            return init_device_mesh(self.root_device.type, (pipeline, int(data), int(tensor)), mesh_dim_names=PIPELINE_MESH_DIMENSIONS)
        return init_device_mesh(self.root_device.type, (int(data), int(tensor)), mesh_dim_names=MESH_DIMENSIONS)

    @override
    def _shard(self, module: Module) -> Module:
        result = self._parallelize_fn(module, self.device_mesh[MESH_DIMENSIONS] if self._pipelined else self.device_mesh)
        if not isinstance(result, Module):
            raise TypeError(f"parallelize_fn must return the nn.Module it parallelized, but returned {type(result).__name__}")
        return result

    # ---- pipeline parallelism: set-up ---------------------------------------------------------------------------

    @override
    def setup_module(self, module: Module) -> Module:
        """Without a pipeline, as for any sharded strategy. With one: the whole model, as rank 0 has it, in a
        :class:`PipelineModule` that this rank's stages replace at the split (now, for a split function; at the first
        ``pipeline_step`` for a split by names, which traces the model with its first microbatch)."""
        if not self._pipelined:
            return super().setup_module(module)
        if not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__}.setup_module() needs the process group: call Fabric.launch() first")
        if self._pipeline_split is None:
            raise ValueError(
                f"pipeline_parallel_size={self._pipeline_size} needs pipeline_split: the names of the modules where a new"
                " stage begins (e.g. ['layers.4']), or a function (module, stage_index, num_stages) -> stage module"
            )
        if has_meta_tensors(module):
            raise ValueError(
                "under pipeline parallelism the model is split before parallelize_fn shards it, so it must exist: create"
                " it without init_module(empty_init=True) (on the CPU), or load its weights after the first step"
            )
        broadcast_module_from_rank_zero(module, self.root_device)  # every stage starts from rank 0's weights
        if not callable(self._pipeline_split):
            _check_split_names(module, self._pipeline_split)
        pipeline = PipelineModule(module)
        if callable(self._pipeline_split):
            self._split(pipeline, None)
        self._set_up_modules.add(pipeline)
        return pipeline

    @override
    def setup_module_and_optimizers(self, module: Module, optimizers: list[Optimizer]) -> tuple[Module, list[Optimizer]]:
        if not self._pipelined:
            return super().setup_module_and_optimizers(module, optimizers)
        pipeline = self.setup_module(module)
        return pipeline, [self.setup_optimizer(optimizer) for optimizer in optimizers]

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Under a pipeline: the optimizer follows the model's split (this rank's stage parameters only), and its
        ``zero_grad()`` starts the count of microbatches whose gradients are summed again."""
        if self._pipelined:
            held = {id(p) for group in optimizer.param_groups for p in group["params"]}
            for pipeline in self._pipelines():
                if pipeline.holds_any(held):
                    pipeline.follow(optimizer)
        return super().setup_optimizer(optimizer)

    def _pipelines(self) -> list[PipelineModule]:
        return [module for module in self._set_up_modules if isinstance(module, PipelineModule)]

    def _split(self, pipeline: PipelineModule, example: tuple[Any, ...] | None) -> None:
        """Cut the whole model into stages, keep this rank's, parallelize each, and build torch's stages of them."""
        from torch.distributed.pipelining import PipelineStage, SplitPoint
        from torch.distributed.pipelining import pipeline as trace_pipeline

        pipeline_mesh = self.device_mesh["pipeline_parallel"]
        stages = self._stages_per_rank * self._pipeline_size
        indices = stage_indices(pipeline_mesh.get_local_rank(), self._pipeline_size, self._stages_per_rank, self._v_shaped)
        whole = pipeline.whole_model
        assert whole is not None
        split = self._pipeline_split
        if callable(split):
            modules = [_checked_stage(split(whole, index, stages), index) for index in indices]
        else:
            assert split is not None and example is not None
            device = next((t.device for t in whole.parameters()), self.root_device)
            traced = trace_pipeline(whole, mb_args=tuple(v.to(device) if isinstance(v, Tensor) else v for v in example),
                                    split_spec=dict.fromkeys(split, SplitPoint.BEGINNING))
            if traced.num_stages != stages:
                raise PipelineError(
                    f"tracing split the model into {traced.num_stages} stage(s) at {list(split)}, not the {stages} the"
                    " schedule needs: every name of pipeline_split must be a module the forward calls, in the order it calls them"
                )
            modules = [traced.get_stage_module(index) for index in indices]
            del traced
        submesh = self.device_mesh[MESH_DIMENSIONS]
        parallelized = []
        for module in modules:
            result = _checked_stage(self._parallelize_fn(module, submesh), None)
            move_plain_tensors(result, self.root_device)
            parallelized.append(result)
        group = pipeline_mesh.get_group()

        def make_stage(module: Module, index: int) -> Any:
            return PipelineStage(module, index, stages, self.root_device, group=group)

        # the rank holding the last stage (whose losses every rank gets), by its global rank
        holder = int(pipeline_mesh.mesh.reshape(-1)[0 if self._v_shaped else self._pipeline_size - 1])
        pipeline.split(parallelized, indices, make_stage, stages, groups=(holder, group, self.device_mesh["data_parallel"].get_group()))

    # ---- pipeline parallelism: the step ---------------------------------------------------------------------------

    @override
    def pipeline_step(
        self, module: Module, inputs: tuple[Any, ...], target: Any, loss_fn: Callable[[Any, Any], Tensor] | None, backward: bool
    ) -> Tensor:
        """Forward (and backward) over the step's microbatches; the mean loss over them and the data-parallel ranks."""
        if loss_fn is None or not callable(loss_fn):
            raise TypeError(f"pipeline_step needs loss_fn=fn(output, target) -> loss of one microbatch, got {loss_fn!r}")
        microbatches = self._microbatches
        microbatch_count(inputs, target, microbatches)
        if not self._pipelined:
            return self._sequential_step(module, inputs, target, loss_fn, backward)
        pipeline = module._forward_module if hasattr(module, "_forward_module") else module
        if not isinstance(pipeline, PipelineModule):
            raise TypeError(f"pipeline_step runs a model set up by fabric.setup(...) under {type(self).__name__}; got {type(module).__name__}")
        inputs = self.precision.convert_input(tuple(inputs))  # as a set-up module's forward does (bf16-true, say)
        if not pipeline.is_split:
            self._split(pipeline, first_microbatch(inputs, microbatches))
        if backward or not self._v_shaped:
            schedule = pipeline.schedule(loss_fn, lambda stages: self._build_schedule(stages, loss_fn))
        else:  # torch's V-shaped schedules cannot evaluate
            schedule = pipeline.schedule((loss_fn, "eval"), lambda stages: forward_only_v_schedule(stages, self._microbatches, loss_fn))
        first, last = pipeline.runs_first_stage, pipeline.runs_last_stage
        losses: list[Tensor] = []
        arguments = tuple(inputs) if first else ()
        with self.precision.forward_context():
            if backward:
                schedule.step(*arguments, target=target if last else None, losses=losses if last else None, return_outputs=False)
            else:
                with torch.no_grad():
                    schedule.eval(*arguments, target=target if last else None, losses=losses if last else None)
        if backward:
            pipeline.note_microbatches(microbatches)
        return pipeline.step_loss(losses, self.root_device)

    def _build_schedule(self, stages: list[Any], loss_fn: Callable[[Any, Any], Tensor]) -> Any:
        from torch.distributed.pipelining.schedules import PipelineScheduleMulti

        multi = issubclass(self._schedule_class, PipelineScheduleMulti)
        try:
            return self._schedule_class(stages if multi else stages[0], n_microbatches=self._microbatches, loss_fn=loss_fn, scale_grads=False)
        except ValueError as err:
            raise ValueError(
                f"pipeline_schedule={self._schedule_class.__name__[len('Schedule'):]!r} cannot run microbatches="
                f"{self._microbatches} with pipeline_parallel_size={self._pipeline_size}: {err}"
            ) from None

    def _sequential_step(self, module: Module, inputs: tuple[Any, ...], target: Any, loss_fn: Callable[[Any, Any], Tensor], backward: bool) -> Tensor:
        """Without a pipeline: the same microbatches one after the other, the same sums and the same mean loss."""
        microbatches = self._microbatches
        split_inputs = [value.tensor_split(microbatches) if isinstance(value, Tensor) and value.dim() > 0 else [value] * microbatches for value in inputs]
        split_targets = target.tensor_split(microbatches) if isinstance(target, Tensor) and target.dim() > 0 else [target] * microbatches
        if backward and all(p.grad is None for p in module.parameters()):
            self._sequential_microbatches = 0
        total = torch.zeros((), dtype=torch.float32, device=self.root_device)
        for index in range(microbatches):
            with torch.set_grad_enabled(backward):
                output = module(*(values[index] for values in split_inputs))
                loss = loss_fn(output, split_targets[index])
            if backward:
                self.backward(loss, module)
            total += loss.detach().float().reshape(())
        if backward:
            self._sequential_microbatches += microbatches
        mean = total / microbatches
        data = self.device_mesh["data_parallel"]
        if data.size() > 1:
            dist.all_reduce(mean, group=data.get_group())
            mean /= data.size()
        return mean

    def _average_gradients(self) -> None:
        for pipeline in self._pipelines():
            pipeline.average_gradients()
        count, self._sequential_microbatches = self._sequential_microbatches, 0
        if count > 1:
            divide_gradients([p for module in self._set_up_modules for p in module.parameters()], count)

    @override
    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        if self._pipelined:
            raise PipelineError(
                "fabric.backward() cannot run under pipeline parallelism: the schedule runs backward over the"
                " microbatches itself; use loss = fabric.pipeline_step(model, *inputs, target=target, loss_fn=loss_fn)"
            )
        super().backward(tensor, module, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        self._average_gradients()
        return super().optimizer_step(optimizer, **kwargs)

    @override
    def clip_gradients_norm(
        self, module: Module, optimizer: Optimizer, max_norm: float | int, norm_type: float | int = 2.0, error_if_nonfinite: bool = True
    ) -> Tensor:
        """The norm over the whole model: every shard on every rank, every stage of the pipeline."""
        self._average_gradients()
        if not self._pipelined:
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)
        self.precision.unscale_gradients(optimizer)
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        return clip_grad_norm_over_shards(parameters, max_norm, norm_type, error_if_nonfinite, across=self.device_mesh["pipeline_parallel"].get_group())

    def __repr__(self) -> str:
        pipeline = f", pipeline_parallel_size={self._pipeline_size}" if self._pipelined else ""
        return f"ModelParallelStrategy(data_parallel_size={self._data_parallel_size!r}, tensor_parallel_size={self._tensor_parallel_size!r}{pipeline})"


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is not valid; accepted: an int >= 1")
    return value


def _checked_split(split: Any, pipeline_size: int) -> Sequence[str] | Callable[[Module, int, int], Module] | None:
    if split is None or callable(split):
        return split
    if isinstance(split, str) or not isinstance(split, Sequence) or not all(isinstance(name, str) and name for name in split):
        raise TypeError(
            f"pipeline_split={split!r} is not valid; accepted: a list of module names where a new stage begins"
            " (['layers.4']), or a function (module, stage_index, num_stages) -> stage module"
        )
    if len(set(split)) != len(split):
        raise ValueError(f"pipeline_split={list(split)!r} names a module twice")
    return list(split)


def _check_split_names(module: Module, names: Sequence[str]) -> None:
    known = [name for name, _ in module.named_modules() if name]
    for name in names:
        if name not in known:
            import difflib

            closest = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {closest[0]!r}?" if closest else ""
            raise ValueError(f"pipeline_split names {name!r}, which is not a module of {type(module).__name__}{hint}")


def _checked_stage(module: Any, index: int | None) -> Module:
    if not isinstance(module, Module):
        what = f"pipeline_split({index})" if index is not None else "parallelize_fn"
        raise TypeError(f"{what} must return an nn.Module (a stage of the model), but returned {type(module).__name__}")
    return module


