"""Data parallelism that keeps training when a replica group dies, on torchft.

The job is made of replica groups. Each group is an ordinary DDP job (its own ranks, process group, store,
supervisor and restarts: one ``fabric-torch run --replica-group G``); the groups find each other through
torchft's lighthouse (``fabric-torch lighthouse``). Per step, the groups that answer form a quorum; gradients
are averaged inside the group by DDP and then across the quorum's groups by the torchft ``Manager``, and the
optimizer steps only if the step commits. A group that dies is left out of the next quorum and the others go
on without it; when it comes back, it copies model, optimizer, random state and the data positions from a
live peer before its first batch (healing), then steps with the others.

What is ours: the comm hook (a failed cross-group all-reduce ends as a dropped step, never as an exception out
of ``backward``), the step protocol (quorum before the step's first batch, commit before ``optimizer.step()``),
what healing carries, and the data position of every group (:class:`GroupPositions`). torchft provides the
lighthouse, the quorum, the reconfigurable process group and the transfer of state between groups.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from fabric._core.env import LIGHTHOUSE_ENV, NUM_REPLICA_GROUPS_ENV, REPLICA_GROUP_ENV
from fabric.checkpoint.per_rank import state_of_rank
from fabric.checkpoint.resume.random_state import capture_random_state, restore_random_state
from fabric.strategies.ddp import DDPStrategy

__all__ = ["FaultTolerantStrategy", "GroupPositions", "replica_group_from_environment"]

_HEALING_KEY = "fabric"
#: the strategy's own entry in a checkpoint written by ``fabric.save``
CHECKPOINT_KEY = "ddp_ft"


def import_torchft() -> Any:
    """torchft, or an error that names the extra to install."""
    try:
        import torchft.manager
        import torchft.process_group
    except ImportError as err:
        raise ModuleNotFoundError(
            f"strategy 'ddp_ft' needs torchft, which is not installed ({err}): pip install 'fabric-torch[ft]'"
        ) from None
    return torchft


def replica_group_from_environment(env: dict[str, str] | None = None) -> tuple[int, int, str]:
    """(this replica group, the number of groups, the lighthouse address), as ``fabric-torch run`` exports them."""
    env = dict(os.environ) if env is None else env
    missing = [name for name in (REPLICA_GROUP_ENV, NUM_REPLICA_GROUPS_ENV, LIGHTHOUSE_ENV) if not env.get(name)]
    if missing:
        raise RuntimeError(
            f"strategy 'ddp_ft' needs {', '.join(missing)} in the environment; start each replica group with"
            " `fabric-torch run --replica-group G --num-replica-groups R --lighthouse HOST:PORT ...`"
        )
    try:
        group, groups = int(env[REPLICA_GROUP_ENV]), int(env[NUM_REPLICA_GROUPS_ENV])
    except ValueError:
        raise RuntimeError(
            f"{REPLICA_GROUP_ENV}={env[REPLICA_GROUP_ENV]!r} and {NUM_REPLICA_GROUPS_ENV}={env[NUM_REPLICA_GROUPS_ENV]!r}"
            " must be integers"
        ) from None
    if groups < 1 or not 0 <= group < groups:
        raise RuntimeError(
            f"{REPLICA_GROUP_ENV}={group} with {NUM_REPLICA_GROUPS_ENV}={groups} is not valid; accepted: 0 <= group < groups"
        )
    lighthouse = env[LIGHTHOUSE_ENV]
    if "://" not in lighthouse:
        lighthouse = f"http://{lighthouse}"
    return group, groups, lighthouse


class GroupPositions:
    """Where every replica group's rank stands in each set-up dataloader, as this rank last heard.

    Each step, the ranks of one group rank across the quorum's groups add their own row to a table
    (a sum over the quorum: a row is non-zero only where its group took part). A group that died keeps the
    row its peers last heard, so when it comes back it continues its own shard of the data where it stood.
    A row holds ``(epoch + 1, batches consumed)`` per loader; zeros mean "not heard of".
    """

    def __init__(self, group: int, groups: int) -> None:
        self.group = group
        self.groups = groups
        self.loaders: list[Any] = []  # the FabricDataLoaders, in the order they were set up
        self.table = torch.zeros(groups, 0, 2, dtype=torch.int64)

    def add(self, loader: Any) -> None:
        self.loaders.append(loader)
        self.table = torch.cat([self.table, torch.zeros(self.groups, 1, 2, dtype=torch.int64)], dim=1)

    def own_row(self) -> torch.Tensor:
        row = torch.zeros(len(self.loaders), 2, dtype=torch.int64)
        for index, loader in enumerate(self.loaders):
            position = loader.data_position()
            if position is not None:  # None: a loader with a state of its own, which it keeps itself
                row[index, 0], row[index, 1] = position[0] + 1, position[1]
        return row

    def contribution(self) -> torch.Tensor:
        """This rank's share of the step's sum: its own row in its group's place, zeros elsewhere."""
        mine = torch.zeros_like(self.table)
        mine[self.group] = self.own_row()
        return mine

    def take(self, summed: torch.Tensor) -> None:
        """Keep the rows the sum carries (the quorum's groups); the others stay as last heard."""
        present = summed[:, :, 0] > 0
        self.table[present] = summed[present]
        self.table[self.group] = self.own_row()

    def restore(self, table: torch.Tensor) -> None:
        """A checkpoint's table: every loader continues at this group's row (a cold start of the whole job)."""
        self._check_shape(table)
        own = self.own_row()
        for index, loader in enumerate(self.loaders):
            epoch, consumed = table[self.group, index].tolist()
            if epoch > 0 and [epoch, consumed] != own[index].tolist():  # the file's loader entry is another group's
                loader.continue_at(int(epoch) - 1, int(consumed))
        self.table = table.clone()

    def _check_shape(self, table: torch.Tensor) -> None:
        if table.shape != self.table.shape:
            raise RuntimeError(
                f"the table of data positions covers {table.shape[0]} group(s) and {table.shape[1]} dataloader(s); this"
                f" job has {self.table.shape[0]} and {self.table.shape[1]}: every replica group must run the same script"
            )

    def adopt(self, table: torch.Tensor) -> None:
        """A live peer's table (healing): its rows for the other groups, and for this group where it is ahead."""
        self._check_shape(table)
        own = self.own_row()
        heard = table[self.group]
        for index, loader in enumerate(self.loaders):
            if heard[index, 0] > 0 and tuple(heard[index].tolist()) > tuple(own[index].tolist()):
                loader.continue_at(int(heard[index, 0]) - 1, int(heard[index, 1]))
        self.table = table.clone()
        self.table[self.group] = self.own_row()


class FaultTolerantStrategy(DDPStrategy):
    """DDP inside each replica group, torchft across the groups: the job trains on while a group is down.

    Start a lighthouse (``fabric-torch lighthouse --min-replicas 1``) and each group with ``fabric-torch run
    --replica-group G --num-replica-groups R --lighthouse HOST:PORT [--max-restarts K]``. The training loop
    stays as it is. ``optimizer.step()`` steps only when the quorum commits the step (a step during which a
    group died is dropped: weights and optimizer stay as they were). Collectives of the ``Fabric`` API
    (``all_reduce``, ``barrier``, ...) and ``global_rank``/``world_size`` are those of the group; the
    distributed sampler shards the data over (replica group, rank in the group).

    Args:
        min_replica_size: the fewest replica groups a step may commit with.
        quorum_timeout: how long a step waits for the quorum.
        replica_timeout: how long a collective across groups, a commit or a healing transfer may take.
        replica_process_group: the torchft process group across groups (by default ``ProcessGroupGloo``, or
            ``ProcessGroupNCCL`` on CUDA devices).
        **kwargs: as for :class:`~fabric.strategies.ddp.DDPStrategy` (not a comm hook: this strategy installs its own).
    """

    def __init__(
        self,
        *args: Any,
        min_replica_size: int = 1,
        quorum_timeout: timedelta = timedelta(seconds=60),
        replica_timeout: timedelta = timedelta(seconds=60),
        replica_process_group: Any = None,
        **kwargs: Any,
    ) -> None:
        for name in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period"):
            if kwargs.get(name) is not None:
                raise ValueError(f"{name} cannot be given to the 'ddp_ft' strategy: it installs its own comm hook")
        if kwargs.setdefault("start_method", "popen") != "popen":
            raise ValueError(f"start_method={kwargs['start_method']!r} is not supported by 'ddp_ft'; accepted: 'popen'")
        if isinstance(min_replica_size, bool) or not isinstance(min_replica_size, int) or min_replica_size < 1:
            raise ValueError(f"min_replica_size={min_replica_size!r} is not valid; accepted: an int >= 1")
        # DDP must never rebuild its buckets: a group that joins late would lay its buckets out differently
        # from its peers', and the per-bucket all-reduce across groups would add unlike gradients
        kwargs["find_unused_parameters"] = True
        super().__init__(*args, **kwargs)
        self._min_replica_size = min_replica_size
        self._quorum_timeout = quorum_timeout
        self._replica_timeout = replica_timeout
        self._replica_process_group = replica_process_group
        self._manager: Any = None
        self._positions: GroupPositions | None = None
        self._modules: list[Module] = []
        self._optimizers: list[Optimizer] = []
        self._quorum_open = False  # a quorum was started for the step under way
        self._decision: bool | None = None  # the step's commit decision, once taken

    # ---- the job's shape --------------------------------------------------------------------------

    @property
    def manager(self) -> Any:
        """torchft's ``Manager`` of this group (after ``launch()``)."""
        if self._manager is None:
            raise RuntimeError("the 'ddp_ft' strategy has no torchft Manager yet: call fabric.launch() first")
        return self._manager

    @property
    def committed_steps(self) -> int:
        """Optimizer steps the quorum committed (restored by healing and by loading a checkpoint)."""
        return int(self.manager.current_step())

    @property
    def participants(self) -> int:
        """How many replica groups take part in the current (or last) quorum."""
        return int(self.manager.num_participants())

    @property
    def replica_group(self) -> int:
        return replica_group_from_environment()[0]

    @property
    def num_replica_groups(self) -> int:
        return replica_group_from_environment()[1]

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        group, groups, _ = replica_group_from_environment()
        return {"num_replicas": self.world_size * groups, "rank": group * self.world_size + self.global_rank}

    # ---- life cycle -------------------------------------------------------------------------------

    @override
    def setup_environment(self) -> None:
        group, groups, lighthouse = replica_group_from_environment()  # before any process group: fail early
        torchft = import_torchft()
        super().setup_environment()
        if self._manager is not None:
            return
        pg = self._replica_process_group
        if pg is None:
            make = torchft.process_group.ProcessGroupNCCL if self.root_device.type == "cuda" else torchft.process_group.ProcessGroupGloo
            pg = make(timeout=self._replica_timeout)
        env = self.cluster_environment
        self._positions = GroupPositions(group, groups)
        self._manager = torchft.manager.Manager(
            pg=pg,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=self._min_replica_size,
            # healing must happen before the step's first batch is drawn, so that a group that comes back
            # continues its data where it stood: the quorum is waited for when the step starts
            use_async_quorum=False,
            timeout=self._replica_timeout,
            quorum_timeout=self._quorum_timeout,
            connect_timeout=self._replica_timeout,
            rank=self.global_rank,
            world_size=self.world_size,
            store_addr=env.main_address,
            store_port=env.main_port,
            lighthouse_addr=lighthouse,
            replica_id=f"fabric_group_{group}",
        )
        self._manager.register_state_dict_fn(_HEALING_KEY, self._load_healing_state, self._healing_state)
        atexit.register(self._shut_manager_down)

    @override
    def teardown(self) -> None:
        self._shut_manager_down()
        self._modules.clear()
        self._optimizers.clear()
        super().teardown()

    def _shut_manager_down(self) -> None:
        manager, self._manager = self._manager, None
        if manager is not None:
            manager.shutdown(wait=False)

    # ---- modules, optimizers, loaders ----------------------------------------------------------------

    @override
    def setup_module(self, module: Module) -> DistributedDataParallel:
        ddp = super().setup_module(module)
        ddp.register_comm_hook(state=self, hook=_average_across_groups)
        ddp.register_forward_pre_hook(lambda _module, _inputs: self.start_step())
        self._modules.append(ddp)
        return ddp

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        self._optimizers.append(optimizer)
        return super().setup_optimizer(optimizer)

    @override
    def watch_dataloader(self, loader: Any) -> Callable[[], None] | None:
        """Keep ``loader``'s position for healing; the step's quorum starts before its next batch is drawn."""
        if self._positions is None:
            raise RuntimeError("set up dataloaders after fabric.launch() with the 'ddp_ft' strategy")
        self._positions.add(loader)
        return self.start_step

    # ---- the step -------------------------------------------------------------------------------------

    def start_step(self) -> None:
        """Join the quorum of the step under way, once per step (healing from a peer happens here)."""
        if self._quorum_open:
            return
        self._quorum_open = True
        self._decision = None
        self.manager.start_quorum(timeout=self._quorum_timeout)

    @override
    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """Step only if the quorum commits the step; the decision is taken once per step, for every optimizer."""
        if self._decision is None:
            self.start_step()  # a step whose forward did not run through a set-up module
            self._share_positions()
            self._decision = bool(self.manager.should_commit(timeout=self._replica_timeout))
            self._quorum_open = False
        if not self._decision:
            return None
        return super().optimizer_step(optimizer, **kwargs)

    def _share_positions(self) -> None:
        positions = self._positions
        if positions is None or not positions.loaders:
            return
        manager = self.manager
        summed = positions.contribution()
        manager.allreduce(summed, reduce_op=dist.ReduceOp.SUM).wait()
        if manager.errored() is None:
            positions.take(summed)

    # ---- checkpoints -------------------------------------------------------------------------------------

    @override
    def save_checkpoint(
        self, path: str | Path, state: dict[str, Any], storage_options: Any | None = None, filter: Any | None = None, async_save: bool = False
    ) -> None:
        """As DDP's, with the committed step count and every group's data position under ``"ddp_ft"``."""
        state = {**state, CHECKPOINT_KEY: _ReplicaGroupState(self)}
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter, async_save=async_save)

    @override
    def load_checkpoint(
        self, path: str | Path, state: Module | Optimizer | dict[str, Any] | None = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """As DDP's; then this group takes the committed step count and its own data position from the file.

        The loaders' entries hold the positions of the group that wrote the file; this group's own row of the
        positions table overrides them, so every group of a cold-started job continues its own shard.
        """
        remainder = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        saved = remainder.pop(CHECKPOINT_KEY, None) if isinstance(remainder, dict) else None
        if saved is not None:
            _ReplicaGroupState(self).load_state_dict(saved)
        return remainder

    # ---- healing ----------------------------------------------------------------------------------------

    def _healing_state(self) -> dict[str, Any]:
        """What a group that comes back copies from this one (torchft adds the committed step count)."""
        return {
            "modules": [_unwrap(module).state_dict() for module in self._modules],
            "optimizers": [optimizer.state_dict() for optimizer in self._optimizers],
            "random_state": capture_random_state(),
            "positions": self._positions.table.clone() if self._positions is not None else None,
        }

    def _load_healing_state(self, state: dict[str, Any]) -> None:
        if len(state["modules"]) != len(self._modules) or len(state["optimizers"]) != len(self._optimizers):
            raise RuntimeError(
                f"the peer group set up {len(state['modules'])} module(s) and {len(state['optimizers'])} optimizer(s),"
                f" this group {len(self._modules)} and {len(self._optimizers)}: every replica group must run the same script"
            )
        for module, module_state in zip(self._modules, state["modules"]):
            _unwrap(module).load_state_dict(module_state)
        for optimizer, optimizer_state in zip(self._optimizers, state["optimizers"]):
            optimizer.load_state_dict(optimizer_state)
        restore_random_state(state["random_state"])
        if self._positions is not None and state["positions"] is not None:
            self._positions.adopt(state["positions"])

    def __repr__(self) -> str:
        return f"FaultTolerantStrategy(min_replica_size={self._min_replica_size})"


class _ReplicaGroupState:
    """The strategy's entry in a checkpoint: per rank, the committed step count and the positions table."""

    per_rank_state = True

    def __init__(self, strategy: FaultTolerantStrategy) -> None:
        self._strategy = strategy

    def state_dict(self) -> dict[str, Any]:
        manager_state = self._strategy.manager.state_dict()
        positions = self._strategy._positions
        return {
            "committed_steps": int(manager_state["step"]),
            "batches_committed": int(manager_state["batches_committed"]),
            "positions": positions.table.clone() if positions is not None else None,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        strategy = self._strategy
        state = state_of_rank(state_dict, strategy.global_rank, strategy.world_size, "'ddp_ft' replica group state")
        positions = strategy._positions
        if positions is not None and state["positions"] is not None:
            positions.restore(state["positions"])
        strategy.manager.load_state_dict({"step": state["committed_steps"], "batches_committed": state["batches_committed"]})


def _average_across_groups(strategy, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations
    """DDP's comm hook: the mean inside the group, then the mean over the quorum's groups.

    A failure across groups (a peer died mid-step) is recorded by the Manager, which then drops the step at
    commit; the hook returns normally so that ``backward`` never raises for a peer's death. A failure inside
    the group is this group's own failure and raises.
    """
    buffer = bucket.buffer()
    if strategy.world_size > 1:
        dist.all_reduce(buffer)
        buffer.div_(strategy.world_size)
    strategy.manager.allreduce(buffer).wait()
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(buffer)
    return done


def _unwrap(module: Module) -> Module:
    return module.module if isinstance(module, DistributedDataParallel) else module
