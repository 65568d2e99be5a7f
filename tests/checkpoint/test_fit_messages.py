"""What a load into an object it does not fit says: every misfit, with both shapes, up to a limit (``fit.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fabric import Fabric
from fabric.checkpoint.errors import CheckpointMismatchError
from fabric.checkpoint.fit import SHOWN_KEYS, check_module_fits, tensor_shapes


def _layers(width: int, count: int) -> nn.Module:
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(count)))


def test_every_tensor_of_another_shape_is_named_with_both_shapes(tmp_path) -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.save(tmp_path / "model.pt", {"model": _layers(4, 2)})
    model = _layers(3, 2)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(CheckpointMismatchError) as info:
        fabric.load(tmp_path / "model.pt", {"model": model})
    lines = str(info.value).splitlines()
    assert lines[0] == "state['model']: The checkpoint does not fit Sequential: 4 tensors have another shape in the model:"
    assert lines[1:] == [
        "  '0.weight' has shape (4, 4) in the checkpoint but (3, 3) in the model",
        "  '0.bias' has shape (4,) in the checkpoint but (3,) in the model",
        "  '1.weight' has shape (4, 4) in the checkpoint but (3, 3) in the model",
        "  '1.bias' has shape (4,) in the checkpoint but (3,) in the model",
    ]
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())  # nothing loaded


def test_one_misfit_is_one_sentence() -> None:
    saved = tensor_shapes(nn.Linear(4, 2).state_dict())
    target = {**nn.Linear(4, 2).state_dict(), "weight": torch.zeros(2, 5)}
    with pytest.raises(CheckpointMismatchError) as info:
        check_module_fits("Linear", target, saved, strict=True)
    assert str(info.value) == "The checkpoint does not fit Linear: 'weight' has shape (2, 4) in the checkpoint but (2, 5) in the model"


def test_past_the_limit_the_rest_are_counted() -> None:
    count = SHOWN_KEYS + 5  # layers, two tensors each
    with pytest.raises(CheckpointMismatchError) as info:
        check_module_fits("Sequential", _layers(3, count).state_dict(), tensor_shapes(_layers(4, count).state_dict()), strict=True)
    lines = str(info.value).splitlines()
    assert lines[0].endswith(f": {2 * count} tensors have another shape in the model:")
    assert len(lines) == 1 + SHOWN_KEYS + 1 and lines[-1] == f"  and {2 * count - SHOWN_KEYS} more"


def test_missing_and_unexpected_keys_and_misshapen_ones_are_said_together() -> None:
    saved = {**tensor_shapes(_layers(4, 1).state_dict()), **{f"extra.{i}": (1,) for i in range(SHOWN_KEYS + 2)}}
    target = {**_layers(3, 1).state_dict(), "new": torch.zeros(1)}
    with pytest.raises(CheckpointMismatchError) as info:
        check_module_fits("Sequential", target, saved, strict=True)
    message = str(info.value)
    shown = [f"extra.{i}" for i in range(SHOWN_KEYS)]
    assert f"missing keys ['new'], unexpected keys {shown!r} and 2 more; pass strict=False to load the keys that match" in message
    assert "; 2 tensors have another shape in the model:\n  '0.weight' has shape (4, 4) in the checkpoint but (3, 3)" in message
