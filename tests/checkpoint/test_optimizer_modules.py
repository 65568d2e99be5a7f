"""One rule finds the module that names an optimizer's parameters (``layout.module_of``), on every path that hands an
optimizer to torch's state-dict API: the module in the state that holds them all, or several modules of this rank
that hold them together (the stages of one model in a pipeline, each keeping the model's names), or a refusal.

In one process: the rule itself, and sharded folders and full files of an optimizer over two stages. In a real
2-rank FSDP job (``support/scripts/checkpoint/stages_job.py``): both formats and ``load_raw``, whose optimizer is
found among the strategy's set-up modules.
"""

from __future__ import annotations

import copy
import sys
from itertools import chain
from pathlib import Path

import pytest
import torch
from torch import nn

from fabric.checkpoint.errors import CheckpointMismatchError
from fabric.checkpoint.formats import load_sharded
from fabric.checkpoint.formats.full import load_full, save_full
from fabric.checkpoint.formats.sharded import save_sharded
from fabric.checkpoint.layout import as_one_module, module_in_state, module_of
from support.environment import job_environment
from support.loading import script_path
from support.processes import read_ranks, run


def stack(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Module()
    model.layers = nn.ModuleDict({str(index): nn.Linear(4, 4) for index in range(4)})
    return model


def stages(seed: int) -> tuple[nn.Module, nn.Module]:
    """Two stages of one model that keep its names: ``layers.0``/``layers.1`` and ``layers.2``/``layers.3``."""
    model = stack(seed)
    first, second = copy.deepcopy(model), copy.deepcopy(model)
    for name in ("2", "3"):
        del first.layers[name]
    for name in ("0", "1"):
        del second.layers[name]
    return first, second


def stepped(first: nn.Module, second: nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(chain(first.parameters(), second.parameters()), lr=0.1)
    x = torch.randn(2, 4)
    for layer in (*first.layers.values(), *second.layers.values()):
        x = torch.tanh(layer(x))
    x.sum().backward()
    optimizer.step()
    return optimizer


def moments(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    params = [param for group in optimizer.param_groups for param in group["params"]]
    return [optimizer.state[param][name] for param in params for name in ("exp_avg", "exp_avg_sq")]


def test_the_module_holding_every_parameter_is_the_one() -> None:
    model, other = stack(1), stack(2)
    optimizer = torch.optim.SGD(model.layers["1"].parameters(), lr=0.1)
    assert module_of(optimizer, [other, model.layers["1"], model], "refused") is model.layers["1"]  # the first that holds all
    assert module_in_state(optimizer, {"other": other, "model": model, "optimizer": optimizer}, "optimizer") is model


def test_several_modules_are_seen_as_one_that_keeps_their_names() -> None:
    first, second = stages(1)
    optimizer = torch.optim.SGD(chain(first.parameters(), second.parameters()), lr=0.1)
    joined = module_of(optimizer, [first, second], "refused")
    names = dict(joined.named_parameters())
    assert sorted(names) == [f"layers.{index}.{kind}" for index in range(4) for kind in ("bias", "weight")]
    assert names["layers.0.weight"] is first.layers["0"].weight and names["layers.3.bias"] is second.layers["3"].bias  # no copy
    # torch's API names the optimizer's state after them
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    assert set(get_optimizer_state_dict(joined, optimizer)["param_groups"][0]["params"]) == set(names)


def test_a_parameter_of_no_module_and_two_modules_naming_alike_are_refused() -> None:
    first, second = stages(1)
    stray = nn.Parameter(torch.zeros(2))
    with pytest.raises(CheckpointMismatchError, match="belong to no single module"):
        module_in_state(torch.optim.SGD([*first.parameters(), stray], lr=0.1), {"a": first, "b": second}, "opt", CheckpointMismatchError)
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)  # two unrelated models: both name a parameter "weight"
    with pytest.raises(ValueError, match=r"belong to no single module.*name different parameters 'weight'"):
        module_in_state(torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1), {"a": a, "b": b}, "opt")
    with pytest.raises(ValueError, match="name different parameters 'weight'"):
        as_one_module([a, b])


@pytest.mark.parametrize("form", ["sharded folder", "full file"])
def test_an_optimizer_over_two_stages_round_trips(tmp_path: Path, form: str) -> None:
    first, second = stages(1)
    optimizer = stepped(first, second)
    fresh_first, fresh_second = stages(2)
    fresh = torch.optim.AdamW(chain(fresh_first.parameters(), fresh_second.parameters()), lr=0.1)
    state = {"stage0": fresh_first, "stage1": fresh_second, "optimizer": fresh}
    if form == "sharded folder":
        save_sharded(tmp_path / "ckpt", {"stage0": first, "stage1": second, "optimizer": optimizer})
        load_sharded(tmp_path / "ckpt", state)
    else:
        save_full(tmp_path / "ckpt.pt", {"stage0": first, "stage1": second, "optimizer": optimizer})
        load_full(tmp_path / "ckpt.pt", state)
    assert all(torch.equal(a, b) for a, b in zip(moments(fresh), moments(optimizer)))
    assert all(torch.equal(a, b) for a, b in zip(fresh_second.parameters(), second.parameters()))


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_an_optimizer_over_two_fsdp_stages_saves_loads_and_load_raws(tmp_path: Path) -> None:
    env = job_environment()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={env['MASTER_PORT']}",
        str(script_path("checkpoint", "stages_job.py")), str(tmp_path),
    ]  # fmt: skip
    run(command, timeout=240, env=env, cwd=tmp_path)
    ranks = read_ranks(tmp_path)
    assert sorted(ranks) == [0, 1]
    for results in ranks.values():
        assert results["folder"] == {"moments": True, "weights": True}
        assert results["file"] == {"moments": True, "weights": True}
        assert results["load_raw"] == {"moments": True}  # found among the strategy's two set-up modules
        # the folder keeps the optimizer's state under the whole model's names
        assert results["optimizer_names"] == [f"layers.{index}.{kind}" for index in range(4) for kind in ("bias", "weight")]
