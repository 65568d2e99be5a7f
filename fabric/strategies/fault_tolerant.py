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
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
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
from fabric._core.extras import install_hint
from fabric._core.job_secret import job_secret
from fabric._core.listening import lighthouse_on_loopback, replica_job_address
from fabric.checkpoint.errors import CheckpointMismatchError
from fabric.checkpoint.per_rank import state_of_rank
from fabric.checkpoint.resume.random_state import capture_random_state, restore_random_state
from fabric.strategies.ddp import DDPStrategy
from fabric.strategies.fsdp import FSDPStrategy
from fabric.supervision.step_watch import GROUP_STEP_ENV, StepWatch, supervisor_job_dir

__all__ = [
    "DEFAULT_STEP_TIMEOUT",
    "TIMEOUT_MARGIN",
    "FaultTolerantStrategy",
    "GroupPositions",
    "HSDPFaultTolerantStrategy",
    "ReplicaGroups",
    "replica_group_from_environment",
]

_HEALING_KEY = "fabric"
#: the strategy's own entry in a checkpoint written by ``fabric.save``
CHECKPOINT_KEY = "ddp_ft"
#: How long a step may make no progress before its rank is ended (``step_timeout``): real steps take seconds;
#: a first step that compiles is not counted (the bound is armed after it), nor are waits on other groups or storage.
DEFAULT_STEP_TIMEOUT = timedelta(minutes=3)
#: How much longer than ``step_timeout`` the waits on other groups must be, so that they outlast a hung peer's end
#: (the supervisor's look, the stack dump, the kill, and the lighthouse's heartbeat timeout).
TIMEOUT_MARGIN = timedelta(seconds=30)
#: What the quorum and replica timeouts default to beyond ``step_timeout``.
_DEFAULT_WAIT_BEYOND_STEP = timedelta(seconds=60)

Seconds = float | int | timedelta


def import_torchft() -> Any:
    """torchft, or an error that names the extra to install."""
    try:
        import torchft.manager
        import torchft.process_group
    except ImportError as err:
        raise ModuleNotFoundError(
            f"strategy 'ddp_ft' needs torchft, which is not installed ({err}): {install_hint('ft')}"
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
        self.check_shape(table)
        own = self.own_row()
        for index, loader in enumerate(self.loaders):
            epoch, consumed = table[self.group, index].tolist()
            if epoch > 0 and [epoch, consumed] != own[index].tolist():  # the file's loader entry is another group's
                loader.continue_at(int(epoch) - 1, int(consumed))
        self.table = table.clone()

    def check_shape(self, table: torch.Tensor) -> None:
        """ValueError if ``table`` is not of this job's groups and dataloaders."""
        if not isinstance(table, torch.Tensor) or table.shape != self.table.shape:
            shape = tuple(table.shape) if isinstance(table, torch.Tensor) else type(table).__name__
            raise ValueError(
                f"the table of data positions has the shape {shape} (groups, dataloaders, 2); this job's is"
                f" {tuple(self.table.shape)}: every replica group must run the same script, with the same"
                " --num-replica-groups and set-up dataloaders"
            )

    def adopt(self, table: torch.Tensor) -> None:
        """A live peer's table (healing): its rows for the other groups, and for this group where it is ahead."""
        try:
            self.check_shape(table)
        except ValueError as err:
            raise RuntimeError(str(err)) from None
        own = self.own_row()
        heard = table[self.group]
        for index, loader in enumerate(self.loaders):
            if heard[index, 0] > 0 and tuple(heard[index].tolist()) > tuple(own[index].tolist()):
                loader.continue_at(int(heard[index, 0]) - 1, int(heard[index, 1]))
        self.table = table.clone()
        self.table[self.group] = self.own_row()


class ReplicaGroups:
    """What makes a process-group strategy fault tolerant across replica groups (mixed in before it).

    The step protocol, healing, data positions, the checkpoint entry, the bound on a stalled step and where the
    job listens; the strategy it is mixed into says how gradients cross groups (:meth:`_average_across_groups`,
    or a comm hook that does it in backward).
    """

    _strategy_name = "ddp_ft"

    def __init__(
        self,
        *args: Any,
        min_replica_size: int = 1,
        step_timeout: Seconds | None = DEFAULT_STEP_TIMEOUT,
        quorum_timeout: Seconds | None = None,
        replica_timeout: Seconds | None = None,
        replica_process_group: Any = None,
        **kwargs: Any,
    ) -> None:
        if isinstance(min_replica_size, bool) or not isinstance(min_replica_size, int) or min_replica_size < 1:
            raise ValueError(f"min_replica_size={min_replica_size!r} is not valid; accepted: an int >= 1")
        step = None if step_timeout is None else _as_timedelta("step_timeout", step_timeout)
        waits_beyond = (step or timedelta(0)) + _DEFAULT_WAIT_BEYOND_STEP
        self._step_timeout = step
        self._quorum_timeout = _as_timedelta("quorum_timeout", quorum_timeout) if quorum_timeout is not None else waits_beyond
        self._replica_timeout = _as_timedelta("replica_timeout", replica_timeout) if replica_timeout is not None else waits_beyond
        self._check_timeouts()
        super().__init__(*args, **kwargs)
        self._min_replica_size = min_replica_size
        self._replica_process_group = replica_process_group
        self._manager: Any = None
        self._positions: GroupPositions | None = None
        self._modules: list[Module] = []
        self._optimizers: list[Optimizer] = []
        self._watch: StepWatch | None = None
        self._quorum_open = False  # a quorum was started for the step under way
        self._positions_sent: tuple[Any, torch.Tensor] | None = None  # (the all-reduce under way, its tensor)
        self._decision: bool | None = None  # the step's commit decision, once taken

    def _check_timeouts(self) -> None:
        """The other groups wait for a hung group to be ended (``step_timeout``) in their quorum and in their
        all-reduce across groups: both waits must outlast it, or a hang would end the healthy groups too."""
        step = self._step_timeout
        if step is None:
            return
        needed = step + TIMEOUT_MARGIN
        for name, value in (("quorum_timeout", self._quorum_timeout), ("replica_timeout", self._replica_timeout)):
            if value < needed:
                raise ValueError(
                    f"{name}={value.total_seconds():g} s is shorter than step_timeout={step.total_seconds():g} s +"
                    f" {TIMEOUT_MARGIN.total_seconds():g} s: the other groups would give up waiting before a hung group"
                    f" is ended. Accepted: {name} >= {needed.total_seconds():g} s, a smaller step_timeout, or"
                    " step_timeout=None (no bound on a stalled step)"
                )

    # ---- the job's shape --------------------------------------------------------------------------

    @property
    def manager(self) -> Any:
        """torchft's ``Manager`` of this group (after ``launch()``)."""
        if self._manager is None:
            raise RuntimeError(f"the {self._strategy_name!r} strategy has no torchft Manager yet: call fabric.launch() first")
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
    def step_timeout(self) -> timedelta | None:
        """How long a step may make no progress before this rank is ended (None: no bound)."""
        return self._step_timeout

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        group, groups, _ = replica_group_from_environment()
        world_size, rank = self.world_size, self.global_rank  # type: ignore[attr-defined]
        return {"num_replicas": world_size * groups, "rank": group * world_size + rank}

    def _ranks_on_one_machine(self) -> bool:
        """The group's own store and gloo stay on loopback only when every group of the job runs on this machine."""
        return super()._ranks_on_one_machine() and lighthouse_on_loopback(replica_group_from_environment()[2])  # type: ignore[misc]

    # ---- life cycle -------------------------------------------------------------------------------

    def setup_environment(self) -> None:
        group, groups, lighthouse = replica_group_from_environment()  # before any process group: fail early
        torchft = import_torchft()
        strategy: Any = self
        host = self._job_address(lighthouse)
        secret = job_secret(lighthouse, on_loopback=host in ("127.0.0.1", "::1"))
        super().setup_environment()  # type: ignore[misc]
        if self._manager is not None:
            return
        from fabric.strategies.healing_transport import HealingTransport
        from fabric.strategies.replica_quorum import QuorumClient, quorum_retries, replica_id

        pg = self._replica_process_group
        if pg is None and strategy.root_device.type == "cuda":
            pg = torchft.process_group.ProcessGroupNCCL(timeout=self._replica_timeout)
        elif pg is None:
            from fabric.strategies.replica_process_group import ReplicaProcessGroupGloo

            pg = ReplicaProcessGroupGloo(host, timeout=self._replica_timeout)
        env = strategy.cluster_environment
        self._positions = GroupPositions(group, groups)
        with _manager_server_on(torchft, host):
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
                rank=strategy.global_rank,
                world_size=strategy.world_size,
                store_addr=env.main_address,
                store_port=env.main_port,
                lighthouse_addr=lighthouse,
                replica_id=replica_id(self._strategy_name, groups, strategy.world_size, group),
                hostname=host,
                checkpoint_transport=HealingTransport(host, secret, self._replica_timeout),
                quorum_retries=quorum_retries(self._quorum_timeout),
            )
        self._manager._client = QuorumClient(
            self._manager._client, strategy=self._strategy_name, groups=groups, ranks=strategy.world_size, group=group,
            lighthouse=lighthouse, quorum_timeout=self._quorum_timeout, steps_before=int(os.environ.get(GROUP_STEP_ENV, "0") or 0),
        )
        self._manager.register_state_dict_fn(_HEALING_KEY, self._load_healing_state, self._healing_state)
        if self._step_timeout is not None:
            self._watch = StepWatch(self._step_timeout.total_seconds(), supervisor_job_dir(), strategy.global_rank)
        atexit.register(self._shut_manager_down)

    def _job_address(self, lighthouse: str) -> str:
        """Where this rank listens for the other groups; a group whose store other machines cannot reach is refused."""
        try:
            host = replica_job_address(lighthouse)
        except OSError as err:
            raise ValueError(f"the lighthouse at {lighthouse} cannot be reached from this machine ({err}); accepted: the"
                             " address of a running `fabric-torch lighthouse` (--lighthouse HOST:PORT)") from None
        if host in ("127.0.0.1", "::1"):
            return host
        main_address = str(self.cluster_environment.main_address)  # type: ignore[attr-defined]
        if main_address.strip("[]") in ("127.0.0.1", "::1", "localhost"):
            raise ValueError(
                f"the lighthouse at {lighthouse} is on another machine, so the other replica groups must reach this"
                f" group's store at its main address, which is {main_address} (loopback); give --main-address as this"
                " machine's address on the network the groups share"
            )
        return host

    def teardown(self) -> None:
        self._shut_manager_down()
        self._modules.clear()
        self._optimizers.clear()
        super().teardown()  # type: ignore[misc]

    def _shut_manager_down(self) -> None:
        manager, self._manager = self._manager, None
        if manager is not None:
            manager.shutdown(wait=False)

    # ---- modules, optimizers, loaders ----------------------------------------------------------------

    def _track_module(self, module: Module) -> None:
        """Heal ``module`` with the others; its forward starts the step's quorum (a loop without set-up loaders)."""
        module.register_forward_pre_hook(lambda _module, _inputs: self.start_step())
        self._modules.append(module)

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        optimizer = super().setup_optimizer(optimizer)  # type: ignore[misc]
        self._optimizers.append(optimizer)
        return optimizer

    def watch_dataloader(self, loader: Any) -> Callable[[], None] | None:
        """Keep ``loader``'s position for healing; the step's quorum starts before its next batch is drawn."""
        if self._positions is None:
            raise RuntimeError(f"set up dataloaders after fabric.launch() with the {self._strategy_name!r} strategy")
        self._positions.add(loader)
        return self.start_step

    # ---- the step -------------------------------------------------------------------------------------

    def start_step(self) -> None:
        """Join the quorum of the step under way, once per step (healing from a peer happens here)."""
        self._beat()
        if self._quorum_open:
            return
        self._quorum_open = True
        self._decision = None
        with self._waiting_on_others():
            self._take_positions()  # the last step's, before a healing peer is sent them
            self.manager.start_quorum(timeout=self._quorum_timeout)

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """Step only if the quorum commits the step; the decision is taken once per step, for every optimizer."""
        if self._decision is None:
            self.start_step()  # a step whose forward did not run through a set-up module
            with self._waiting_on_others():
                self._average_across_groups()
                self._send_positions()  # under way while the commit is asked and until the next step starts
                self._decision = bool(self.manager.should_commit(timeout=self._replica_timeout))
            self._quorum_open = False
            if self._watch is not None:
                self._watch.beat(self.committed_steps)
                self._watch.arm()
        if not self._decision:
            return None
        return super().optimizer_step(optimizer, **kwargs)  # type: ignore[misc]

    def _beat(self) -> None:
        if self._watch is not None:
            self._watch.beat()

    def _waiting_on_others(self) -> AbstractContextManager:
        """A wait bounded by torchft's own timeouts (other groups, the lighthouse): not a stalled step."""
        return self._watch.waiting() if self._watch is not None else nullcontext()

    def _average_across_groups(self) -> None:
        """Average the gradients over the quorum's groups, if backward did not (a comm hook does it in DDP)."""

    def _send_positions(self) -> None:
        """Start the all-reduce of every group's data positions after this step's batches (a sum over the quorum's
        groups): it goes on while the commit is asked for and the next step begins, which waits for it."""
        positions = self._positions
        if positions is None or not positions.loaders:
            return
        # on the rank's device: the process group across groups is NCCL's on GPUs, which serves nothing else
        summed = positions.contribution().to(self.root_device)  # type: ignore[attr-defined]
        self._positions_sent = (self.manager.allreduce(summed, reduce_op=dist.ReduceOp.SUM), summed)

    def _take_positions(self) -> None:
        """Wait for the positions sent at the last step and keep what the quorum's groups said (not if it failed)."""
        sent, self._positions_sent = self._positions_sent, None
        if sent is None or self._manager is None:
            return
        work, summed = sent
        work.wait()
        if self._manager.errored() is None and self._positions is not None:
            self._positions.take(summed.cpu())

    # ---- checkpoints -------------------------------------------------------------------------------------

    def save_checkpoint(
        self, path: str | Path, state: dict[str, Any], storage_options: Any | None = None, filter: Any | None = None, async_save: bool = False
    ) -> None:
        """As the strategy's, with the committed step count and every group's data position under ``"ddp_ft"``."""
        state = {**state, CHECKPOINT_KEY: _ReplicaGroupState(self)}
        with self._waiting_on_others():  # storage has bounds of its own
            self._take_positions()
            super().save_checkpoint(path, state, storage_options=storage_options, filter=filter, async_save=async_save)  # type: ignore[misc]

    def load_checkpoint(
        self, path: str | Path, state: Module | Optimizer | dict[str, Any] | None = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """As the strategy's, with the ``"ddp_ft"`` entry (the committed step count, every group's data position)
        among the entries: checked with the others before anything changes, and loaded after the loaders.

        This group takes its own row of the positions table: the loaders' entries hold the positions of the group
        that wrote the file, so every group of a cold-started job continues its own shard. A load without a state
        dict changes nothing (the entry is returned with the rest).
        """
        if isinstance(state, dict) and state and CHECKPOINT_KEY not in state:
            state = {**state, CHECKPOINT_KEY: _ReplicaGroupState(self)}
        with self._waiting_on_others():
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)  # type: ignore[misc]

    # ---- healing ----------------------------------------------------------------------------------------

    def _healing_state(self) -> dict[str, Any]:
        """What a group that comes back copies from this one (torchft adds the committed step count).

        Tensors go as this rank's local part (a sharded parameter's shard): rank r of a group heals from rank r
        of its peer, whose shards are laid out alike.
        """
        return {
            "modules": [_local(_unwrap(module).state_dict()) for module in self._modules],
            "optimizers": [_local(optimizer.state_dict()) for optimizer in self._optimizers],
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
            _copy_into_module(_unwrap(module), module_state)
        for optimizer, optimizer_state in zip(self._optimizers, state["optimizers"]):
            optimizer.load_state_dict(_shaped_like_parameters(optimizer, optimizer_state))
        restore_random_state(state["random_state"])
        if self._positions is not None and state["positions"] is not None:
            self._positions.adopt(state["positions"])


class FaultTolerantStrategy(ReplicaGroups, DDPStrategy):
    """DDP inside each replica group, torchft across the groups: the job trains on while a group is down.

    Start a lighthouse (``fabric-torch lighthouse --min-replicas 1``) and each group with ``fabric-torch run
    --replica-group G --num-replica-groups R --lighthouse HOST:PORT [--max-restarts K]``. The training loop
    stays as it is. ``optimizer.step()`` steps only when the quorum commits the step (a step during which a
    group died is dropped: weights and optimizer stay as they were). Collectives of the ``Fabric`` API
    (``all_reduce``, ``barrier``, ...) and ``global_rank``/``world_size`` are those of the group; the
    distributed sampler shards the data over (replica group, rank in the group).

    Args (keyword only; timeouts in seconds or as a ``timedelta``):
        min_replica_size: the fewest replica groups a step may commit with.
        step_timeout: how long a step of this group may make no progress before its rank is ended, with a report of
            where it was, so that its launcher restarts the group and it heals (3 minutes; None: no bound). Waits on
            other groups and on storage are not counted, nor is the first step of a process.
        quorum_timeout: how long a step waits for the quorum, including a lighthouse that is away and comes back
            (default: ``step_timeout`` + 60 s; at least ``step_timeout`` + 30 s, to outlast a hung group's end).
        replica_timeout: how long a collective across groups, a commit or a healing transfer may take (default and
            lower bound as for ``quorum_timeout``).
        replica_process_group: the torchft process group across groups (by default gloo on the job's address, or
            torchft's ``ProcessGroupNCCL`` on CUDA devices).
        **kwargs: as for :class:`~fabric.strategies.ddp.DDPStrategy` (not a comm hook: this strategy installs its own).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for name in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period"):
            if kwargs.get(name) is not None:
                raise ValueError(f"{name} cannot be given to the 'ddp_ft' strategy: it installs its own comm hook")
        _check_popen(kwargs, "ddp_ft")
        # DDP must never rebuild its buckets: a group that joins late would lay its buckets out differently
        # from its peers', and the per-bucket all-reduce across groups would add unlike gradients
        kwargs["find_unused_parameters"] = True
        super().__init__(*args, **kwargs)

    @override
    def setup_module(self, module: Module) -> DistributedDataParallel:
        ddp = super().setup_module(module)
        ddp.register_comm_hook(state=self, hook=_ddp_average_across_groups)
        self._track_module(ddp)
        return ddp

    def __repr__(self) -> str:
        return f"FaultTolerantStrategy(min_replica_size={self._min_replica_size})"


class HSDPFaultTolerantStrategy(ReplicaGroups, FSDPStrategy):
    """FSDP2 inside each replica group, torchft across the groups (``"hsdp_ft"``): hybrid sharding that survives a group.

    Each group shards the model over its own ranks (``fully_shard``); after backward, rank r of every group
    averages its gradient shards with rank r of the other groups in the quorum (one all-reduce of the
    flattened shards), and the optimizer steps only if the step commits. Every group must have the same
    number of ranks (rank r heals from rank r's shards). Otherwise as :class:`FaultTolerantStrategy`.

    Args:
        min_replica_size, step_timeout, quorum_timeout, replica_timeout, replica_process_group: as for
            ``FaultTolerantStrategy``.
        **kwargs: as for :class:`~fabric.strategies.fsdp.FSDPStrategy` (sharding inside the group: "FULL_SHARD"
            or "SHARD_GRAD_OP").
    """

    _strategy_name = "hsdp_ft"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _check_popen(kwargs, "hsdp_ft")
        sharding = str(getattr(kwargs.get("sharding_strategy", "FULL_SHARD"), "name", kwargs.get("sharding_strategy", "FULL_SHARD"))).upper()
        if sharding not in ("FULL_SHARD", "SHARD_GRAD_OP"):
            raise ValueError(
                f"sharding_strategy={kwargs['sharding_strategy']!r} is not supported by 'hsdp_ft' (it shards inside a group and"
                " replicates across groups itself); accepted: 'FULL_SHARD', 'SHARD_GRAD_OP'"
            )
        super().__init__(*args, **kwargs)

    @override
    def setup_module(self, module: Module) -> Module:
        module = super().setup_module(module)
        self._track_module(module)
        return module

    @override
    def _average_across_groups(self) -> None:
        """One all-reduce over the quorum of this rank's gradient shards, flattened (the mean over the groups)."""
        grads = [_local_tensor(p.grad) for module in self._modules for p in module.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        if not flat.is_floating_point():
            return
        self.manager.allreduce(flat).wait()
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def __repr__(self) -> str:
        return f"HSDPFaultTolerantStrategy(min_replica_size={self._min_replica_size})"


def _as_timedelta(name: str, value: Any) -> timedelta:
    """A timeout given in seconds or as a ``timedelta``, checked."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(f"{name}={value!r} is not valid; accepted: seconds (a number > 0) or a datetime.timedelta")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{name}={value!r} is not valid; accepted: a finite time > 0 (seconds or a datetime.timedelta)")
    return timedelta(seconds=seconds)


@contextmanager
def _manager_server_on(torchft: Any, host: str) -> Iterator[None]:
    """While torchft's ``Manager`` is built: its manager server (group rank 0) listens on ``host`` only.

    torchft binds it to every interface (``[::]``) and takes only the address it advertises (``hostname``) as an
    argument; the bind is the one value it does not take, so the constructor it calls gets it here.
    """
    real = torchft.manager.ManagerServer
    bind = f"[{host}]:0" if ":" in host else f"{host}:0"

    def on_host(*args: Any, **kwargs: Any) -> Any:
        kwargs["bind"] = bind
        return real(*args, **kwargs)

    torchft.manager.ManagerServer = on_host
    try:
        yield
    finally:
        torchft.manager.ManagerServer = real


def _check_popen(kwargs: dict[str, Any], name: str) -> None:
    if kwargs.setdefault("start_method", "popen") != "popen":
        raise ValueError(f"start_method={kwargs['start_method']!r} is not supported by {name!r}; accepted: 'popen'")


def _local_tensor(value: Any) -> Any:
    """A DTensor's local part (a sharded parameter's shard on this rank); any other value as it is."""
    to_local = getattr(value, "to_local", None)
    return to_local() if callable(to_local) and isinstance(value, torch.Tensor) else value


def _local(tree: Any) -> Any:
    """``tree`` with every DTensor replaced by its local part: what rank r sends to rank r of a healing group."""
    if isinstance(tree, dict):
        return {key: _local(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_local(value) for value in tree)
    return _local_tensor(tree)


def _copy_into_module(module: Module, state: dict[str, Any]) -> None:
    """Copy a peer's local parts into ``module``'s parameters and buffers, in place (shards into shards)."""
    current = module.state_dict()
    missing = sorted(set(current) ^ set(state))
    if missing:
        raise RuntimeError(f"the peer group's model differs from this group's in {missing[:5]}: every replica group must run the same script")
    with torch.no_grad():
        for name, value in current.items():
            target = _local_tensor(value)
            if isinstance(target, torch.Tensor):
                target.copy_(state[name])


def _shaped_like_parameters(optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """A peer's optimizer state (local parts) as this optimizer loads it: per-parameter tensors of a sharded
    parameter become DTensors on that parameter's mesh again."""
    from torch.distributed.tensor import DTensor

    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, values in state_dict["state"].items():
        parameter = parameters[int(index)]
        if isinstance(parameter, DTensor):
            local = parameter.to_local()  # the transfer arrives in CPU memory: the shard goes where the parameter's is
            values = {
                key: DTensor.from_local(
                    value.to(local.device), parameter.device_mesh, parameter.placements, run_check=False, shape=parameter.shape,
                    stride=parameter.stride(),
                )
                if isinstance(value, torch.Tensor) and value.shape == local.shape
                else value
                for key, value in values.items()
            }
        state[index] = values
    return {**state_dict, "state": state}


class _ReplicaGroupState:
    """The strategy's entry in a checkpoint: per rank, the committed step count and the positions table.

    An entry of the load walk like any other: checked before anything changes (a table of another shape is refused
    with the model and optimizer untouched), and optional (a checkpoint of a plain DDP job has none).
    """

    per_rank_state = True
    optional_entry = True

    def __init__(self, strategy: Any) -> None:  # a ReplicaGroups strategy
        self._strategy = strategy

    def state_dict(self) -> dict[str, Any]:
        manager_state = self._strategy.manager.state_dict()
        positions = self._strategy._positions
        return {
            "committed_steps": int(manager_state["step"]),
            "batches_committed": int(manager_state["batches_committed"]),
            "positions": positions.table.clone() if positions is not None else None,
        }

    def check_state_dict(self, state_dict: Any) -> dict[str, Any]:
        """This rank's saved state, if it fits this job (ValueError naming what does not)."""
        strategy = self._strategy
        try:
            state = state_of_rank(state_dict, strategy.global_rank, strategy.world_size, "'ddp_ft' replica group state")
        except CheckpointMismatchError as err:
            raise ValueError(str(err)) from None
        if not isinstance(state, dict) or not {"committed_steps", "batches_committed", "positions"} <= set(state):
            raise ValueError(
                "the saved replica group state is not {'committed_steps', 'batches_committed', 'positions'}; was it"
                " written by fabric's ddp_ft or hsdp_ft strategy?"
            )
        positions = strategy._positions
        if positions is not None and state["positions"] is not None:
            positions.check_shape(state["positions"])
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = self.check_state_dict(state_dict)
        strategy = self._strategy
        positions = strategy._positions
        if positions is not None and state["positions"] is not None:
            positions.restore(state["positions"])
        strategy.manager.load_state_dict({"step": state["committed_steps"], "batches_committed": state["batches_committed"]})


def _ddp_average_across_groups(strategy, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations
    """DDP's comm hook: the mean inside the group, then the mean over the quorum's groups.

    A failure across groups (a peer died mid-step) is recorded by the Manager, which then drops the step at
    commit; the hook returns normally so that ``backward`` never raises for a peer's death. A failure inside
    the group is this group's own failure and raises.
    """
    buffer = bucket.buffer()
    if strategy.world_size > 1:
        dist.all_reduce(buffer)
        buffer.div_(strategy.world_size)
    with strategy._waiting_on_others():
        strategy.manager.allreduce(buffer).wait()
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(buffer)
    return done


def _unwrap(module: Module) -> Module:
    return module.module if isinstance(module, DistributedDataParallel) else module
