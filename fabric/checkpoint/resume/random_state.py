"""Every random number generator of this process, captured and restored (exact resume needs all of them).

The states are plain tensors, lists and numbers, so a checkpoint holding them loads with
``weights_only=True``: torch (CPU and, when in use, CUDA), NumPy's global generator and Python's ``random``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["capture_random_state", "check_random_state", "restore_random_state"]


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
    return f"a dict with keys {sorted(map(str, value))}" if isinstance(value, dict) else type(value).__name__
