"""``fabric.utilities.init``'s meta-device helpers and ``fabric.utilities.LightningEnum``: the names and behaviour
Lightning programs (litgpt's sequential generation, enums of their own) rely on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fabric.utilities import LightningEnum
from fabric.utilities.init import EmptyInit, _EmptyInit, _has_meta_device_parameters_or_buffers, _materialize, _materialize_meta_tensors


class _Counted(nn.Module):
    """A module with its own parameter and buffer, counting ``reset_parameters`` calls."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(3))
        self.register_buffer("running", torch.empty(3))
        self.resets = 0

    def reset_parameters(self) -> None:
        self.resets += 1
        nn.init.constant_(self.weight, 2.0)
        self.running.fill_(5.0)


def test_materialize_meta_tensors_initializes_only_the_submodules_still_on_meta():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), _Counted(), nn.Sequential(nn.Linear(4, 2)))
    loaded = torch.full((4, 4), 7.0)
    model[0].weight = nn.Parameter(loaded)  # a partial checkpoint loaded (assign=True) the first layer
    model[0].bias = nn.Parameter(torch.ones(4))
    assert _has_meta_device_parameters_or_buffers(model) and not _has_meta_device_parameters_or_buffers(model[0])

    _materialize_meta_tensors(model, torch.device("cpu"))
    assert not _has_meta_device_parameters_or_buffers(model)
    assert model[0].weight is not None and torch.equal(model[0].weight, loaded)  # kept: it was not on meta
    assert model[1].resets == 1 and torch.equal(model[1].weight, torch.full((3,), 2.0)) and torch.equal(model[1].running, torch.full((3,), 5.0))
    assert model[2][0].weight.device.type == "cpu" and model[2][0].weight.abs().sum() > 0  # nn.Linear's reset_parameters ran


def test_materialize_needs_reset_parameters():
    class NoReset(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(2))

    with torch.device("meta"):
        module = NoReset()
    with pytest.raises(TypeError, match=r"NoReset has tensors on the meta device but no reset_parameters\(\)"):
        _materialize(module, "cpu")
    with pytest.raises(TypeError, match="NoReset"):
        _materialize_meta_tensors(nn.Sequential(module), "cpu")


def test_meta_checks_of_optimizers_and_wrong_types():
    with torch.device("meta"):
        meta = nn.Linear(2, 2)
    assert _has_meta_device_parameters_or_buffers(torch.optim.SGD(meta.parameters(), lr=0.1))
    assert not _has_meta_device_parameters_or_buffers(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    with pytest.raises(TypeError, match="got int"):
        _has_meta_device_parameters_or_buffers(3)  # type: ignore[arg-type]


def test_empty_init_under_lightnings_name():
    assert _EmptyInit is EmptyInit
    with _EmptyInit():
        layer = nn.Linear(2, 2)
    assert layer.weight.shape == (2, 2)


class Stage(LightningEnum):
    TRAIN = "train"
    VALIDATING = "Validating"


def test_lightning_enum_compares_with_strings_in_any_case():
    assert Stage.TRAIN == "train" and Stage.TRAIN == "TRAIN" and Stage.VALIDATING == "validating"
    assert Stage.TRAIN != "test" and isinstance(Stage.TRAIN, str)
    assert hash(Stage.TRAIN) == hash("train") and {Stage.TRAIN: 1}["train"] == 1
    assert Stage("train") is Stage.TRAIN
    assert Stage.from_str("validating") is Stage.VALIDATING and Stage.from_str("TRAIN") is Stage.TRAIN
    with pytest.warns(UserWarning, match="Invalid string"):
        assert Stage.try_from_str("test") is None
    with pytest.raises(ValueError, match="Invalid match"):
        Stage.from_str("test")
