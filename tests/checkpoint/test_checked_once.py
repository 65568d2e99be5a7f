"""Every fit check runs once per load: the load walk checks each module and optimizer before anything changes, and
the strategy's hooks that apply them (``load_module_state_dict``, ``load_optimizer_state_dict``) do not check the same
values again; called directly, outside a load, the hooks still check."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fabric import Fabric
from fabric.checkpoint import fit
from fabric.checkpoint.errors import CheckpointMismatchError


def test_a_load_checks_each_module_and_optimizer_once(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": optimizer})
    calls: list[str] = []
    for name in ("check_module_fits", "_check_state_tensors"):  # the module's check; the optimizer's, per parameter
        original = getattr(fit, name)
        monkeypatch.setattr(fit, name, lambda *args, _name=name, _original=original, **kwargs: (calls.append(_name), _original(*args, **kwargs))[1])
    fabric.load(tmp_path / "ckpt.pt", {"model": model, "optimizer": optimizer})
    assert sorted(calls) == ["_check_state_tensors", "_check_state_tensors", "check_module_fits"]  # weight and bias


def test_the_strategys_hooks_still_check_when_called_directly() -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    model = nn.Linear(4, 3)
    with pytest.raises(CheckpointMismatchError, match="shape"):
        fabric.strategy.load_module_state_dict(model, {"weight": torch.zeros(5, 4), "bias": torch.zeros(3)})
    assert torch.count_nonzero(model.bias) > 0 or torch.count_nonzero(model.weight) > 0  # unchanged, not half-loaded
