"""Exact resume: the pieces that let a run stopped mid-epoch continue bit for bit.

A resumed run matches the uninterrupted one only if, at the first step after the checkpoint, every
rank sees the same batch and the same random numbers. That takes three things in the checkpoint,
per rank: the data position (epoch, batches consumed), the random number generators (torch CPU and
CUDA, NumPy, Python's ``random``), and, because re-creating a DataLoader iterator itself draws from
torch's generator (the workers' base seed, a RandomSampler's seed), the generator state from the
start of the interrupted epoch. ``FabricDataLoader`` keeps all three (see ``docs/resume.md``); this
module holds the parts that know nothing of loaders:

* :func:`capture_random_state` / :func:`restore_random_state`: every generator of this process, as
  plain tensors, lists and numbers (so a checkpoint holding them loads with ``weights_only=True``);
* :class:`SkipBatches` and :func:`loader_skipping`: the resumed epoch starts after the consumed
  batches without loading them, by skipping at the batch-sampler level;
* :func:`gather_per_rank_states`: objects whose state differs per rank are gathered onto rank 0
  (which alone writes the file) as ``{"per_rank": [state of rank 0, state of rank 1, ...]}``;
  :func:`state_of_rank` picks this rank's entry when loading.
"""

from __future__ import annotations

import io
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fabric.utilities.data import loader_arguments

__all__ = [
    "PER_RANK_KEY",
    "SkipBatches",
    "capture_random_state",
    "check_random_state",
    "gather_per_rank_states",
    "is_per_rank_record",
    "loader_skipping",
    "restore_random_state",
    "state_of_rank",
]

#: The key of a checkpoint entry that holds one state per rank.
PER_RANK_KEY = "per_rank"


# ---- random number generators -------------------------------------------------------------------


def capture_random_state() -> dict[str, Any]:
    """The state of every random number generator of this process, safe for ``weights_only`` loading."""
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": str(np_kind),
            "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),  # uint32 values, stored losslessly
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
        "python": {"version": int(py_version), "internal": list(py_internal), "gauss_next": py_gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def check_random_state(state: Any) -> None:
    """Raise ValueError if ``state`` is not what :func:`capture_random_state` makes (before changing anything)."""
    if not isinstance(state, dict) or not {"torch", "numpy", "python"} <= set(state):
        raise ValueError(
            f"Expected random generator states with keys 'torch', 'numpy', 'python', got {_describe(state)}"
        )
    if not isinstance(state["torch"], Tensor) or state["torch"].dtype != torch.uint8:
        raise ValueError(f"The saved torch generator state must be a uint8 tensor, got {_describe(state['torch'])}")
    numpy_state, python_state = state["numpy"], state["python"]
    if not isinstance(numpy_state, dict) or not isinstance(numpy_state.get("keys"), Tensor):
        raise ValueError(f"The saved NumPy generator state is malformed: {_describe(numpy_state)}")
    if not isinstance(python_state, dict) or not isinstance(python_state.get("internal"), (list, tuple)):
        raise ValueError(f"The saved Python `random` state is malformed: {_describe(python_state)}")


def restore_random_state(state: dict[str, Any]) -> None:
    """Put every generator back in the state :func:`capture_random_state` recorded."""
    check_random_state(state)
    torch.set_rng_state(state["torch"])
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            numpy_state["kind"],
            numpy_state["keys"].numpy().astype(np.uint32),
            int(numpy_state["pos"]),
            int(numpy_state["has_gauss"]),
            float(numpy_state["cached_gaussian"]),
        )
    )
    python_state = state["python"]
    random.setstate((python_state["version"], tuple(python_state["internal"]), python_state["gauss_next"]))
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return f"a dict with keys {sorted(map(str, value))}"
    return f"{type(value).__name__}"


# ---- skipping consumed batches without loading them ------------------------------------------------


class SkipBatches:
    """A batch sampler that leaves out the first ``skip`` batches of ``batch_sampler``.

    Only indices are drawn for the skipped batches: no sample is loaded. ``on_start`` is called once
    the skipped part has been drawn (the sampler's own random draws for the epoch are done by then)
    and before the first kept batch is handed out, or at the end if nothing is left.
    """

    def __init__(self, batch_sampler: Any, skip: int, on_start: Callable[[], None] | None = None) -> None:
        self.batch_sampler = batch_sampler
        self.skip = skip
        self.on_start = on_start

    @property
    def sampler(self) -> Any:
        return getattr(self.batch_sampler, "sampler", None)

    def __iter__(self) -> Iterator[Any]:
        iterator = iter(self.batch_sampler)
        started = False
        try:
            for _ in range(self.skip):
                if next(iterator, _END) is _END:
                    break
            started = True
            if self.on_start is not None:
                self.on_start()
            yield from iterator
        finally:
            if not started and self.on_start is not None:
                self.on_start()

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.skip)


_END = object()


def loader_skipping(dataloader: Any, skip: int, on_start: Callable[[], None]) -> Any | None:
    """A DataLoader like ``dataloader`` whose next epoch starts after ``skip`` batches, or None.

    None when the loader cannot be rebuilt that way (not a ``torch.utils.data.DataLoader``, an
    iterable dataset, or a subclass that does not take the standard arguments); the caller then
    skips by iterating.
    """
    from torch.utils.data import DataLoader, IterableDataset

    if not isinstance(dataloader, DataLoader) or isinstance(dataloader.dataset, IterableDataset):
        return None
    kwargs = loader_arguments(dataloader)
    if dataloader.batch_sampler is not None:
        kwargs["batch_sampler"] = SkipBatches(dataloader.batch_sampler, skip, on_start)
    else:  # batch_size=None: the sampler yields one sample's index per "batch"
        kwargs.update(batch_size=None, sampler=SkipBatches(dataloader.sampler, skip, on_start))
    try:
        return type(dataloader)(dataloader.dataset, **kwargs)
    except (TypeError, ValueError):
        return None


# ---- per-rank states in a file written by rank 0 ----------------------------------------------------


def is_per_rank_record(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {PER_RANK_KEY} and isinstance(value[PER_RANK_KEY], list)


def gather_per_rank_states(
    state: dict[str, Any], all_gather: Callable[[Tensor], Tensor], world_size: int
) -> dict[str, Any]:
    """Replace each object that keeps per-rank state by ``{"per_rank": [its state on every rank]}``.

    Such objects say so with a true ``_fabric_per_rank_state`` attribute. A collective: every rank
    must call it with the same keys (``Fabric.save`` is called on every rank).
    """
    keys = [key for key, value in state.items() if getattr(type(value), "_fabric_per_rank_state", False)]
    if not keys:
        return state
    local = {key: state[key].state_dict() for key in keys}
    everyone = _gather_objects(local, all_gather, world_size)
    gathered = dict(state)
    for key in keys:
        gathered[key] = {PER_RANK_KEY: [states[key] for states in everyone]}
    return gathered


def state_of_rank(value: Any, rank: int, world_size: int, what: str) -> Any:
    """This rank's entry of a per-rank record (a plain state is returned as it is)."""
    if not is_per_rank_record(value):
        return value
    states = value[PER_RANK_KEY]
    if len(states) != world_size:
        raise ValueError(
            f"The saved state of the {what} comes from a run with {len(states)} process(es), this run has"
            f" {world_size}: an exact resume needs the same number of processes. Leave the {what} out of"
            " the state you load to resume without its position and random states."
        )
    return states[rank]


def _gather_objects(obj: Any, all_gather: Callable[[Tensor], Tensor], world_size: int) -> list[Any]:
    """``obj`` from every rank, in rank order, through tensor collectives (works for any strategy)."""
    if world_size == 1:
        return [obj]
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    sizes = all_gather(torch.tensor([payload.numel()], dtype=torch.int64)).reshape(-1).tolist()
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[: payload.numel()] = payload
    rows = all_gather(padded).reshape(world_size, -1).cpu()
    return [
        torch.load(io.BytesIO(rows[rank, :size].numpy().tobytes()), weights_only=True)
        for rank, size in enumerate(sizes)
    ]
