"""FabricModule, FabricOptimizer and FabricDataLoader behave like the objects they wrap."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

from fabric import Fabric
from fabric.wrappers import FabricDataLoader, FabricModule, FabricOptimizer, is_wrapped, unwrap

pytestmark = pytest.mark.usefixtures("clean_fabric_env")


class UserModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 2))
        self.register_buffer("counter", torch.zeros(1))
        self.custom = "value"

    def forward(self, x):
        return self.body(x)

    def scale(self, x):
        return 2 * x


def fabric_for(precision: str = "32-true") -> Fabric:
    return Fabric(accelerator="cpu", devices=1, precision=precision)


def setup_model(precision: str = "32-true"):
    torch.manual_seed(0)
    model = UserModel()
    return model, fabric_for(precision).setup(model)


# ---- FabricModule -------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["32-true", "64-true", "bf16-mixed"])
def test_module_is_a_module_with_the_same_forward(precision):
    model, fmodel = setup_model(precision)
    assert isinstance(fmodel, nn.Module) and isinstance(fmodel, FabricModule)
    assert fmodel.module is model
    model.eval()  # no dropout noise
    x = torch.randn(5, 3)
    expected = copy.deepcopy(model).to(torch.float64)(x.double()).float() if precision == "64-true" else None
    out = fmodel(x)
    assert out.dtype == torch.float32
    if precision == "32-true":
        assert torch.equal(out, model(x))
    elif precision == "64-true":
        assert torch.allclose(out, expected)
    else:
        assert torch.allclose(out, model(x), atol=0.1)  # bfloat16 arithmetic inside


def test_module_passes_attributes_and_methods_through():
    model, fmodel = setup_model()
    assert fmodel.custom == "value"
    assert fmodel.scale(3) == 6
    assert fmodel.body is model.body
    assert fmodel.counter is model.counter
    with pytest.raises(AttributeError):
        fmodel.does_not_exist  # noqa: B018 - the attribute lookup is what raises


def test_module_setattr_goes_to_the_user_module():
    model, fmodel = setup_model()
    fmodel.custom = "changed"
    fmodel.new_attribute = 5
    fmodel.head = nn.Linear(2, 1)
    assert model.custom == "changed" and model.new_attribute == 5 and model.head is fmodel.head
    assert "head.weight" in model.state_dict()
    assert "head.weight" in fmodel.state_dict()
    assert "new_attribute" not in fmodel.__dict__


def test_train_and_eval_propagate():
    model, fmodel = setup_model()
    fmodel.eval()
    assert fmodel.training is False
    assert all(not m.training for m in model.modules())
    fmodel.train()
    assert fmodel.training is True
    assert all(m.training for m in model.modules())
    model.eval()
    fmodel.train(False)
    assert not fmodel.training and not model.body[1].training
    fmodel.requires_grad_(False)
    assert not any(p.requires_grad for p in model.parameters())


def test_state_dict_keys_have_no_wrapper_prefix():
    model, fmodel = setup_model()
    assert list(fmodel.state_dict()) == list(model.state_dict())
    for key, value in fmodel.state_dict().items():
        assert torch.equal(value, model.state_dict()[key])


def test_state_dict_of_a_module_holding_a_fabric_module():
    model, fmodel = setup_model()
    outer = nn.ModuleDict({"inner": fmodel, "other": nn.Linear(1, 1)})
    plain = nn.ModuleDict({"inner": model, "other": outer["other"]})
    assert list(outer.state_dict()) == list(plain.state_dict())
    assert all("_forward_module" not in key for key in outer.state_dict())

    torch.manual_seed(1)
    replacement = nn.ModuleDict({"inner": UserModel(), "other": nn.Linear(1, 1)})
    result = outer.load_state_dict(replacement.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    for key, value in replacement.state_dict().items():
        assert torch.equal(outer.state_dict()[key], value)
    assert torch.equal(model.body[0].weight, replacement["inner"].body[0].weight)


def test_load_state_dict_round_trip():
    model, fmodel = setup_model()
    torch.manual_seed(5)
    other = UserModel()
    result = fmodel.load_state_dict(other.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    for key, value in other.state_dict().items():
        assert torch.equal(model.state_dict()[key], value)
    saved = copy.deepcopy(fmodel.state_dict())
    fresh = UserModel()
    fresh.load_state_dict(saved)  # a wrapper's state dict loads into the plain module
    assert torch.equal(fresh.body[2].bias, other.body[2].bias)


def test_load_state_dict_reports_keys_without_prefix():
    model, fmodel = setup_model()
    partial = {k: v for k, v in model.state_dict().items() if k != "body.0.bias"}
    partial["unknown"] = torch.zeros(1)
    result = fmodel.load_state_dict(partial, strict=False)
    assert result.missing_keys == ["body.0.bias"]
    assert result.unexpected_keys == ["unknown"]
    with pytest.raises(RuntimeError, match=r"body\.0\.bias"):
        fmodel.load_state_dict(partial)


def test_module_parameters_are_the_users():
    model, fmodel = setup_model()
    assert [id(p) for p in fmodel.parameters()] == [id(p) for p in model.parameters()]
    assert repr(fmodel).startswith("FabricModule(UserModel(")


# ---- FabricOptimizer ----------------------------------------------------------------------------


def setup_training(optimizer_class=torch.optim.SGD, **optimizer_kwargs):
    fabric = fabric_for()
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = optimizer_class(model.parameters(), **(optimizer_kwargs or {"lr": 0.1}))
    fmodel, foptimizer = fabric.setup(model, optimizer)
    return fabric, model, optimizer, fmodel, foptimizer


def _train_step(fabric, fmodel, foptimizer):
    fabric.backward(fmodel(torch.randn(4, 3)).pow(2).sum())
    foptimizer.step()
    foptimizer.zero_grad()


def test_optimizer_is_an_instance_of_the_users_class():
    _, _, optimizer, _, foptimizer = setup_training(torch.optim.Adam, lr=0.01)
    assert isinstance(foptimizer, torch.optim.Adam) and isinstance(foptimizer, FabricOptimizer)
    assert isinstance(foptimizer, torch.optim.Optimizer)
    assert foptimizer.optimizer is optimizer
    assert foptimizer.defaults == optimizer.defaults
    assert repr(foptimizer).startswith("FabricOptimizer(Adam (")


def test_optimizer_step_and_zero_grad_act_on_the_users_parameters():
    fabric, model, optimizer, fmodel, foptimizer = setup_training(torch.optim.SGD, lr=0.1, momentum=0.9)
    before = model.weight.detach().clone()
    fabric.backward(fmodel(torch.randn(4, 3)).sum())
    foptimizer.step()
    assert not torch.equal(model.weight, before)
    assert optimizer.state[model.weight]["momentum_buffer"] is not None
    foptimizer.zero_grad()
    assert model.weight.grad is None


def test_optimizer_step_with_closure():
    fabric, _model, _, fmodel, foptimizer = setup_training(torch.optim.SGD, lr=0.1)

    def closure():
        foptimizer.zero_grad()
        loss = fmodel(torch.ones(2, 3)).sum()
        fabric.backward(loss)
        return loss

    loss = foptimizer.step(closure)
    assert isinstance(loss, torch.Tensor)


def test_optimizer_param_groups_and_state_are_shared():
    fabric, _model, optimizer, fmodel, foptimizer = setup_training(torch.optim.Adam, lr=0.01)
    assert foptimizer.param_groups is optimizer.param_groups
    foptimizer.param_groups[0]["lr"] = 0.5
    assert optimizer.param_groups[0]["lr"] == 0.5
    _train_step(fabric, fmodel, foptimizer)
    assert foptimizer.state is optimizer.state and len(optimizer.state) == 2
    extra = nn.Parameter(torch.zeros(2))
    foptimizer.add_param_group({"params": [extra]})
    assert len(optimizer.param_groups) == 2


def test_optimizer_state_dict_round_trip_stays_in_sync():
    fabric, model, optimizer, fmodel, foptimizer = setup_training(torch.optim.Adam, lr=0.01)
    _train_step(fabric, fmodel, foptimizer)
    saved = copy.deepcopy(foptimizer.state_dict())
    assert saved["state"].keys() == optimizer.state_dict()["state"].keys()
    assert torch.equal(saved["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    _train_step(fabric, fmodel, foptimizer)
    foptimizer.load_state_dict(saved)
    assert torch.equal(optimizer.state[model.weight]["exp_avg"], saved["state"][0]["exp_avg"])
    assert foptimizer.param_groups is optimizer.param_groups and foptimizer.state is optimizer.state
    # loading into the user's optimizer directly must not detach the wrapper either
    optimizer.load_state_dict(saved)
    assert foptimizer.param_groups is optimizer.param_groups and foptimizer.state is optimizer.state
    foptimizer.param_groups[0]["lr"] = 0.123
    assert optimizer.param_groups[0]["lr"] == 0.123


def test_lr_scheduler_on_the_wrapped_optimizer():
    fabric, _model, optimizer, fmodel, foptimizer = setup_training(torch.optim.SGD, lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(foptimizer, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        for _ in range(3):
            _train_step(fabric, fmodel, foptimizer)
            scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.125)
    assert foptimizer.param_groups[0]["lr"] == pytest.approx(0.125)
    assert "step" not in optimizer.__dict__  # the scheduler patched the wrapper, not the user's optimizer


def test_lr_scheduler_keeps_working_after_fabric_load(tmp_path):
    fabric, model, optimizer, fmodel, foptimizer = setup_training(torch.optim.SGD, lr=1.0)
    _train_step(fabric, fmodel, foptimizer)
    fabric.save(tmp_path / "ckpt.pt", {"optimizer": foptimizer})
    fabric.load(tmp_path / "ckpt.pt", {"optimizer": foptimizer})
    scheduler = torch.optim.lr_scheduler.StepLR(foptimizer, step_size=1, gamma=0.1)
    _train_step(fabric, fmodel, foptimizer)
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
    before = model.weight.detach().clone()
    fabric.backward(fmodel(torch.ones(1, 3)).sum())
    grad = model.weight.grad.clone()
    foptimizer.step()
    # the step used the scheduled lr of 0.1, not the 1.0 of a detached copy of the param groups
    assert torch.allclose(model.weight.detach(), before - 0.1 * grad)


def test_optimizer_hooks_registered_on_the_wrapper_fire():
    fabric, _model, _optimizer, fmodel, foptimizer = setup_training()
    calls = []
    foptimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append(opt))
    _train_step(fabric, fmodel, foptimizer)
    assert len(calls) == 1


# ---- FabricDataLoader ---------------------------------------------------------------------------


class EpochRecordingSampler(Sampler):
    def __init__(self, n):
        self.n = n
        self.epochs = []

    def set_epoch(self, epoch):
        self.epochs.append(epoch)

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self):
        return self.n


def test_dataloader_len_iter_device_and_attributes():
    loader = DataLoader(TensorDataset(torch.arange(10.0)), batch_size=4)
    wrapped = fabric_for().setup_dataloaders(loader)
    assert len(wrapped) == 3
    assert wrapped.device == torch.device("cpu")
    assert wrapped.batch_size == 4 and wrapped.dataset is loader.dataset
    assert wrapped.dataloader is loader
    batches = [b[0].tolist() for b in wrapped]
    assert batches == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0], [8.0, 9.0]]
    assert [b[0].tolist() for b in wrapped] == batches  # iterable again
    with pytest.raises(AttributeError):
        wrapped.no_such_attribute  # noqa: B018 - the attribute lookup is what raises


def test_dataloader_advances_the_sampler_epoch():
    sampler = EpochRecordingSampler(4)
    wrapped = fabric_for().setup_dataloaders(DataLoader(TensorDataset(torch.zeros(4)), sampler=sampler))
    for _ in range(3):
        list(wrapped)
    assert sampler.epochs == [0, 1, 2]


def test_dataloader_wraps_any_dataloader_batch():
    wrapped = fabric_for().setup_dataloaders(DataLoader([torch.ones(1), {"x": torch.zeros(2)}], batch_size=None))
    assert len(wrapped) == 2
    out = list(wrapped)
    assert torch.equal(out[0], torch.ones(1)) and torch.equal(out[1]["x"], torch.zeros(2))


# ---- set-up errors ------------------------------------------------------------------------------


def test_setting_up_twice_is_a_clear_error():
    fabric, _model, _optimizer, fmodel, foptimizer = setup_training()
    with pytest.raises(ValueError, match="model was already set up"):
        fabric.setup(fmodel)
    with pytest.raises(ValueError, match="model was already set up"):
        fabric.setup_module(fmodel)
    with pytest.raises(ValueError, match="optimizer was already set up"):
        fabric.setup(nn.Linear(1, 1), foptimizer)
    with pytest.raises(ValueError, match="optimizer was already set up"):
        fabric.setup_optimizers(foptimizer)
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(torch.zeros(2))))
    with pytest.raises(ValueError, match="dataloader was already set up"):
        fabric.setup_dataloaders(loader)


def test_empty_setup_calls_are_clear_errors():
    fabric = fabric_for()
    with pytest.raises(ValueError, match=r"setup_optimizers\(\) needs at least one optimizer"):
        fabric.setup_optimizers()
    with pytest.raises(ValueError, match=r"setup_dataloaders\(\) needs at least one dataloader"):
        fabric.setup_dataloaders()


def test_unwrap_and_is_wrapped():
    fabric, model, optimizer, fmodel, foptimizer = setup_training()
    loader = DataLoader(TensorDataset(torch.zeros(2)))
    floader = fabric.setup_dataloaders(loader)
    assert unwrap(fmodel) is model and unwrap(foptimizer) is optimizer and unwrap(floader) is loader
    assert unwrap(model) is model
    assert is_wrapped(fmodel) and is_wrapped(foptimizer) and is_wrapped(floader)
    assert not is_wrapped(model) and not is_wrapped(optimizer) and not is_wrapped(loader)
    assert isinstance(floader, FabricDataLoader)
