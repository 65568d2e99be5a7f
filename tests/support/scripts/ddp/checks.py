"""Checks that run inside every rank of a real 2-process job.

The popen script (``popen_job.py``) and the spawn functions below call the same checks, so both start
methods are held to the same behaviour. A check records what its rank saw (tensors, flags, lists) and
returns it instead of asserting: the test then asserts on both ranks' values side by side, and a
failing rank never leaves its peer waiting in a collective.
"""

from __future__ import annotations

import copy
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, Sampler, TensorDataset

from fabric.strategies.ddp import DDPStrategy

REDUCE_OPS = ("sum", "mean", "max", "min")
PRINT_MARKER = "FABRIC-PRINT-MARKER"


# ---- helpers --------------------------------------------------------------------------------------


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def flat(tensors: Any) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def flat_params(module: nn.Module) -> torch.Tensor:
    return flat(module.parameters())


def flat_grads(module: nn.Module) -> torch.Tensor:
    return flat(p.grad for p in module.parameters())


def rank_batch(rank: int, n: int = 8, seed: int = 0) -> torch.Tensor:
    """Data that differs between ranks but that every rank can recreate for any rank."""
    return torch.randn(n, 4, generator=torch.Generator().manual_seed(1000 * seed + rank))


class Reversed(Sampler):
    """A user's own sampler (not a Random/SequentialSampler): Fabric must keep its order."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))

    def __len__(self) -> int:
        return self.n


def companion(fabric: Any, strategy: DDPStrategy) -> DDPStrategy:
    """A second DDPStrategy in the already launched job (same devices, environment, process group)."""
    main = fabric.strategy
    strategy.accelerator = main.accelerator
    strategy.precision = main.precision
    strategy.parallel_devices = main.parallel_devices
    strategy.cluster_environment = main.cluster_environment
    strategy.num_nodes = main.num_nodes
    strategy.setup_environment()  # the group exists: this only sets ranks and the device
    return strategy


HOOK_CALLS = [0]


def counting_allreduce_hook(state: Any, bucket: Any) -> Any:
    HOOK_CALLS[0] += 1
    return default_hooks.allreduce_hook(state, bucket)


# ---- checks ---------------------------------------------------------------------------------------


def core_checks(fabric: Any) -> dict[str, Any]:
    """Ranks, seeding, gradient averaging, a training run, all_gather with gradients, the collectives."""
    rank, other = fabric.global_rank, 1 - fabric.global_rank
    out: dict[str, Any] = {
        "global_rank": rank,
        "local_rank": fabric.local_rank,
        "node_rank": fabric.node_rank,
        "world_size": fabric.world_size,
        "is_global_zero": fabric.is_global_zero,
        "device": str(fabric.device),
        "dist_rank": dist.get_rank(),
        "dist_world_size": dist.get_world_size(),
        "backend": str(dist.get_backend()),
        "sampler_kwargs": fabric.strategy.distributed_sampler_kwargs,
    }

    # the same seed gives the same initial weights on every rank (recorded before DDP's broadcast)
    fabric.seed_everything(1234, verbose=False)
    model = make_model()
    initial = flat_params(model)
    gathered = fabric.all_gather(initial)
    out["initial_weights_equal"] = torch.equal(gathered[0], gathered[1])
    reference = copy.deepcopy(model)
    ddp_model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    out["wrapped_type"] = type(ddp_model._forward_module).__name__

    # DDP's gradients are the mean of the ranks' local gradients
    x = rank_batch(rank)
    fabric.backward(ddp_model(x).pow(2).mean())
    reference(x).pow(2).mean().backward()
    out["ddp_grads"] = fabric.all_gather(flat_grads(model))
    out["local_grads"] = fabric.all_gather(flat_grads(reference))
    optimizer.step()
    out["params_after_step"] = fabric.all_gather(flat_params(model))
    out["expected_params_after_step"] = initial - 0.1 * out["local_grads"].mean(0)

    # a small training run converges, and the replicas stay identical
    fabric.seed_everything(7, verbose=False)
    w_true = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    inputs = torch.randn(64, 4)
    targets = inputs @ w_true + 0.01 * torch.randn(64, 1)
    net = nn.Linear(4, 1)
    net, net_optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(inputs, targets), batch_size=8, shuffle=True))
    losses = []
    for _ in range(12):
        total, batches = torch.tensor(0.0), 0
        for xb, yb in loader:
            loss = F.mse_loss(net(xb), yb)
            net_optimizer.zero_grad()
            fabric.backward(loss)
            net_optimizer.step()
            total += loss.detach()
            batches += 1
        losses.append(float(fabric.all_reduce(total / batches, reduce_op="mean")))
    out["losses"] = losses
    out["trained_params"] = fabric.all_gather(flat_params(net))

    # all_gather(sync_grads=True): gradients flow back to the rank the value came from
    value = torch.full((3,), float(rank + 1), requires_grad=True)
    stacked = fabric.all_gather(value, sync_grads=True)
    out["sync_gathered"] = stacked.detach()
    (float(rank + 1) * stacked[other].sum()).backward()
    out["sync_grad"] = value.grad.clone()  # expected: the other rank's factor, other + 1

    # collectives on numbers, tensors and nested collections
    nested = {"a": rank + 1, "b": [float(rank) + 0.5, torch.tensor([rank, 10 * rank])], "c": (torch.tensor(rank == 0),)}
    for op in REDUCE_OPS:
        out[f"reduce_{op}"] = fabric.all_reduce(nested, reduce_op=op)
    out["reduce_op_enum"] = fabric.all_reduce(torch.tensor(rank + 1), reduce_op=dist.ReduceOp.SUM)
    out["reduce_avg_enum_int"] = fabric.all_reduce(torch.tensor(rank), reduce_op=dist.ReduceOp.AVG)
    untouched = torch.tensor([1.0])
    fabric.all_reduce(untouched, reduce_op="sum")
    out["reduce_input_untouched"] = untouched
    out["gather_scalar"] = fabric.all_gather(rank)
    out["gather_nested"] = fabric.all_gather({"n": rank, "t": [torch.tensor([rank, rank + 1])]})
    out["broadcast_tensor"] = fabric.broadcast(torch.arange(3) + 10 * rank, src=1)
    out["broadcast_other_shape"] = list(fabric.broadcast(torch.zeros(rank + 2), src=1).shape)
    out["broadcast_object"] = fabric.broadcast({"from": rank, "text": "hello" * (rank + 1)}, src=0)
    fabric.barrier()
    fabric.barrier("named")
    out["decision_any"] = fabric.reduce_boolean_decision(rank == 1, all=False)
    out["decision_all"] = fabric.reduce_boolean_decision(rank == 1, all=True)
    out["decision_all_true"] = fabric.reduce_boolean_decision(True)
    out["decision_none"] = fabric.reduce_boolean_decision(False, all=False)
    for name, op in (("bad_op_name", "median"), ("bad_op_type", 3)):
        try:
            fabric.all_reduce(torch.ones(1), reduce_op=op)
            out[name] = None
        except (ValueError, TypeError) as err:
            out[name] = f"{type(err).__name__}: {err}"
    return out


def data_checks(fabric: Any) -> dict[str, Any]:
    """What each rank's loaders yield: shuffled shards over epochs, ordered shards, a user's sampler, the full set."""
    dataset = TensorDataset(torch.arange(20))
    shuffled = fabric.setup_dataloaders(DataLoader(dataset, batch_size=3, shuffle=True))
    ordered = fabric.setup_dataloaders(DataLoader(dataset, batch_size=4))
    custom = fabric.setup_dataloaders(DataLoader(dataset, batch_size=4, sampler=Reversed(20)))
    full = fabric.setup_dataloaders(DataLoader(dataset, batch_size=5), use_distributed_sampler=False)

    def items(loader: Any) -> list[int]:
        return [int(i) for (batch,) in loader for i in batch]

    return {
        "shuffled_epochs": [items(shuffled) for _ in range(3)],
        "shuffled_sampler": type(shuffled.sampler).__name__,
        "ordered": items(ordered),
        "custom": items(custom),
        "custom_sampler": type(custom.sampler).__name__,
        "full": items(full),
    }


def accumulation_checks(fabric: Any) -> dict[str, Any]:
    """no_backward_sync: local gradients inside the block; the next backward syncs the accumulated sum."""
    rank = fabric.global_rank
    fabric.seed_everything(3, verbose=False)
    model = make_model()
    reference = copy.deepcopy(model)
    ddp_model = fabric.setup(model)
    micro = [rank_batch(rank, n=4, seed=s) for s in (1, 2)]
    with fabric.no_backward_sync(ddp_model):
        fabric.backward(ddp_model(micro[0]).pow(2).mean() / 2)
    inside = fabric.all_gather(flat_grads(model))
    local_first = copy.deepcopy(reference)
    (local_first(micro[0]).pow(2).mean() / 2).backward()
    fabric.backward(ddp_model(micro[1]).pow(2).mean() / 2)
    big_batch = torch.cat([rank_batch(r, n=4, seed=s) for r in range(fabric.world_size) for s in (1, 2)])
    reference(big_batch).pow(2).mean().backward()
    out = {
        "inside_grads": inside,
        "inside_local_expected": flat_grads(local_first),
        "accumulated": fabric.all_gather(flat_grads(model)),
        "big_batch": flat_grads(reference),
    }
    # the strategy's block_backward_sync() without an argument holds back every module it set up
    model.zero_grad()
    with fabric.strategy.block_backward_sync():
        fabric.backward(ddp_model(micro[0]).pow(2).mean())
    out["blocked_grads"] = fabric.all_gather(flat_grads(model))
    local = copy.deepcopy(reference)
    local.zero_grad()
    local(micro[0]).pow(2).mean().backward()
    out["blocked_local_expected"] = flat_grads(local)
    model.zero_grad()
    fabric.backward(ddp_model(micro[0]).pow(2).mean())
    out["after_block_grads"] = fabric.all_gather(flat_grads(model))
    return out


def checkpoint_checks(fabric: Any, directory: str) -> dict[str, Any]:
    """One file written by rank 0 only, loadable by every rank, with keys free of wrapper prefixes."""
    rank = fabric.global_rank
    torch.manual_seed(50 + rank)  # different weights per rank: DDP must hand out rank 0's
    model = make_model()
    ddp_model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
    fabric.backward(ddp_model(rank_batch(rank)).sum())
    optimizer.step()

    io = fabric.strategy.checkpoint_io
    calls: list[str] = []
    original_save = io.save_checkpoint

    def counting_save(*args: Any, **kwargs: Any) -> Any:
        calls.append(str(args[1] if len(args) > 1 else kwargs.get("path")))
        return original_save(*args, **kwargs)

    io.save_checkpoint = counting_save
    path = os.path.join(directory, "checkpoint.pt")
    try:
        fabric.save(path, {"model": ddp_model, "optimizer": optimizer, "step": 7})
    finally:
        io.save_checkpoint = original_save

    torch.manual_seed(999)
    fresh = make_model()
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.01)
    state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
    remainder = fabric.load(path, state)
    on_disk = torch.load(path, weights_only=True)

    torch.manual_seed(1000 + rank)
    other = fabric.setup(make_model())
    fabric.strategy.load_module_state_dict(other._forward_module, on_disk["model"])
    return {
        "save_calls": len(calls),
        "files": sorted(os.listdir(directory)),
        "loaded_equal": torch.equal(flat_params(fresh), flat_params(model)),
        "loaded_step": state["step"],
        "optimizer_state_loaded": len(fresh_optimizer.state) == len(optimizer.state) > 0,
        "remainder": sorted(remainder),
        "file_model_keys": sorted(on_disk["model"]),
        "strategy_state_dict_keys": sorted(fabric.strategy.get_module_state_dict(ddp_model._forward_module)),
        "fabric_module_keys": sorted(ddp_model.state_dict()),
        "strategy_loaded_into_ddp": torch.equal(flat_params(other), flat_params(model)),
    }


def rank_zero_first_check(fabric: Any, directory: str) -> bool | None:
    """Rank 1 enters the block only after rank 0 has left it; returns what rank 1 saw."""
    marker = os.path.join(directory, "rank_zero_first.txt")
    seen = None
    with fabric.rank_zero_first():
        if fabric.global_rank == 0:
            time.sleep(0.2)
            with open(marker, "w") as f:
                f.write("rank 0 was here")
        else:
            seen = os.path.exists(marker)
    return seen


def averaging_checks(fabric: Any) -> dict[str, Any]:
    """Post-local SGD: replicas drift between averagings and agree right after each one."""
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState

    rank = fabric.global_rank
    out: dict[str, Any] = {}
    # no gradient reduction after the 2 warm-up steps: only the averaging keeps replicas together
    local_sgd = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=2, post_local_gradient_allreduce=False)
    variants = {
        "local": DDPStrategy(model_averaging_period=2, ddp_comm_state=local_sgd),
        # the default state: gradients reduced within the machine (here: all ranks), averaging on top
        "default": DDPStrategy(model_averaging_period=3),
    }
    for name, strategy in variants.items():
        strategy = companion(fabric, strategy)
        torch.manual_seed(11)
        model = make_model()
        strategy.module_to_device(model)
        ddp_model = strategy.setup_module(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        agree = []
        for step in range(7):
            optimizer.zero_grad()
            ddp_model(rank_batch(rank, seed=20 + step)).pow(2).mean().backward()
            strategy.optimizer_step(optimizer)
            params = strategy.all_gather(flat_params(model))
            agree.append(bool(torch.equal(params[0], params[1])))
        out[name] = agree
    return out


def comm_hook_checks(fabric: Any) -> dict[str, Any]:
    """The fp16-compressed all-reduce hook runs and still averages the gradients (to fp16 precision)."""
    rank = fabric.global_rank
    strategy = companion(
        fabric, DDPStrategy(ddp_comm_hook=counting_allreduce_hook, ddp_comm_wrapper=default_hooks.fp16_compress_wrapper)
    )
    torch.manual_seed(21)
    model = make_model()
    reference = copy.deepcopy(model)
    ddp_model = strategy.setup_module(model)
    HOOK_CALLS[0] = 0
    x = rank_batch(rank, seed=9)
    ddp_model(x).pow(2).mean().backward()
    reference(x).pow(2).mean().backward()
    return {
        "hook_calls": HOOK_CALLS[0],
        "grads": strategy.all_gather(flat_grads(model)),
        "local_grads": strategy.all_gather(flat_grads(reference)),
    }


def reduce_examples(fabric: Any, examples: list[tuple[Any, Any]]) -> dict[str, list[Any]]:
    """All-reduce this rank's half of each example with every reduce op (the property test's job)."""
    data = [pair[fabric.global_rank] for pair in examples]
    return {op: [fabric.all_reduce(item, reduce_op=op) for item in data] for op in REDUCE_OPS}


# ---- whole jobs -----------------------------------------------------------------------------------


def popen_job(fabric: Any, directory: str) -> dict[str, Any]:
    """Everything the popen test asserts, from this rank (the script saves it to a file)."""
    fabric.print(PRINT_MARKER, fabric.global_rank)
    return {
        "core": core_checks(fabric),
        "data": data_checks(fabric),
        "accumulation": accumulation_checks(fabric),
        "checkpoint": checkpoint_checks(fabric, directory),
        "rank_zero_first": rank_zero_first_check(fabric, directory),
        "averaging": averaging_checks(fabric),
        "comm_hook": comm_hook_checks(fabric),
    }


def spawn_job(fabric: Any, directory: str) -> Any:
    """The spawn test's job: both ranks' results come back to the caller through rank 0's return value."""
    results = {
        "core": core_checks(fabric),
        "accumulation": accumulation_checks(fabric),
        "checkpoint": checkpoint_checks(fabric, directory),
    }
    everyone: list[Any] = [None] * fabric.world_size
    dist.all_gather_object(everyone, results)
    if fabric.global_rank == 0:
        return {"ranks": everyone, "tensor": torch.arange(3.0) * 7, "pid": os.getpid()}
    return "rank 1's value must not come back"


def property_job(fabric: Any, examples: list[tuple[Any, Any]]) -> Any:
    """The property test's job: every example reduced with every op; rank 0's results come back."""
    results = reduce_examples(fabric, examples)
    return results if fabric.global_rank == 0 else None


def fork_job(fabric: Any) -> dict[str, Any]:
    """A small job for the fork start method: a tensor that needed both ranks, then the strategy's teardown."""
    total = fabric.all_reduce(torch.tensor([fabric.global_rank + 1.0, 10.0]), reduce_op="sum")
    fabric.barrier()
    fabric.strategy.teardown()
    return {"sum": total, "initialized_after_teardown": dist.is_initialized(), "local_rank": os.environ.get("LOCAL_RANK")}


def save_failure_job(fabric: Any, directory: str) -> list[dict[str, Any]]:
    """Rank 0 fails to write (a folder that is a file; a file-size limit); every rank must raise the same.

    Returns what every rank saw (to rank 0's caller).
    """
    import resource
    import signal

    def attempt(path: str, state: dict[str, Any]) -> str | None:
        try:
            fabric.save(path, state)
        except Exception as err:
            return f"{type(err).__name__}: {err}"
        return None

    blocker = os.path.join(directory, "a-file")
    if fabric.global_rank == 0:
        with open(blocker, "w") as f:
            f.write("not a folder")
    fabric.barrier()
    out: dict[str, Any] = {"not_a_folder": attempt(os.path.join(blocker, "ckpt.pt"), {"step": 1})}
    # the job goes on in step: a good save after the failed one works on every rank
    out["good_save"] = attempt(os.path.join(directory, "good.pt"), {"step": 2})
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    if fabric.global_rank == 0:  # a full disk, as far as rank 0's write can tell (EFBIG)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limits[1]))
    try:
        out["too_big"] = attempt(os.path.join(directory, "big.pt"), {"weights": torch.zeros(100_000)})
    finally:
        if fabric.global_rank == 0:
            resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    out["files"] = sorted(os.listdir(directory))
    everyone: list[Any] = [None] * fabric.world_size
    dist.all_gather_object(everyone, out)
    return everyone


def failing_job(fabric: Any, failing_rank: int) -> None:
    """Rank ``failing_rank`` raises while its peer waits in a barrier for it."""
    fabric.barrier()
    if fabric.global_rank == failing_rank:
        raise RuntimeError(f"rank {failing_rank} fails on purpose")
    fabric.barrier()
