"""The GPU check's jobs, each written once with the device as a parameter, run on ``cuda`` and on ``cpu``.

``test_on_the_gpu`` runs every check here on ``cuda`` (skipped without a GPU; ``make gpu-check`` runs it);
``test_on_the_cpu`` runs the same checks on ``cpu``, so the logic of every CUDA path also runs in the CPU suite.
One GPU is enough: the DDP, FSDP2 and ModelParallel jobs are world size 1. Where the CPU cannot take the same
path (fabric turns 16-mixed on the CPU into bf16-mixed; inductor needs a compiler; the CPU offload policy is a
no-op on the CPU), the check says what it does instead, in one place: the ``if device == "cpu"`` lines below.

Jobs that set up a process group (DDP, FSDP2, ModelParallel, their checkpoints) run one process each with
``support/scripts/device/world1.py`` (world size 1: NCCL on the GPU, gloo on the CPU), a free port and a
timeout; the others run in the test process.

Only what the GPU machine's image has may be imported here: torch, pytest, numpy, lightning-utilities and
this checkout (no hypothesis-only or venv-only helpers).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fabric import Fabric
from support.environment import job_environment
from support.loading import script_path

JOB_TIMEOUT = 240  # seconds for one world-size-1 job (a first CUDA/NCCL start takes ~10-30 s)
TOLERANCE = 1e-4  # a sharded run against the one-process reference on the CPU (other kernels, same math)


# ---- process jobs -------------------------------------------------------------------------------------------


class JobFailed(AssertionError):
    pass


def run_job(device: str, job: str, out: Path, timeout: float = JOB_TIMEOUT) -> dict[str, Any]:
    """Run ``world1.py DEVICE JOB OUT`` in a new process; return its ``RESULT`` line's object."""
    command = [sys.executable, str(script_path("device", "world1.py")), device, job, str(out)]
    try:
        result = subprocess.run(command, env=job_environment(), cwd=out, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        raise JobFailed(f"{job} on {device}: no result after {timeout} s\n{_tail(err.stdout)}\n{_tail(err.stderr)}") from None
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        raise JobFailed(f"{job} on {device} exited {result.returncode}\nstdout:\n{_tail(result.stdout)}\nstderr:\n{_tail(result.stderr)}")
    return json.loads(lines[-1][len("RESULT ") :])


def _tail(text: Any, limit: int = 6000) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-limit:]


def backend_of(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def check_ddp(device: str, out: Path) -> None:
    """DDP, world size 1: NCCL on the GPU, training equal to one process's, every collective on the device, save/load."""
    r = run_job(device, "ddp", out)
    assert r["backend"] == backend_of(device) and r["wrapped"] == "DistributedDataParallel", r
    assert r["param_device"] == device and r["max_diff"] <= TOLERANCE, r
    assert r["collectives"] == [3.0, device, [[0, 1, 2]], device, device], r  # a process group adds the world dimension
    assert r["broadcast_object"] == {"answer": 42} and r["decision"] is True, r
    assert r["loaded_diff"] == 0.0 and r["remainder"] == {"step": 3}, r


def check_fsdp(device: str, out: Path) -> None:
    """FSDP2, world size 1: empty_init on meta materialised on the device, training, sharded and async saves."""
    r = run_job(device, "fsdp", out)
    assert r["backend"] == backend_of(device) and r["mesh"] == device, r
    assert r["empty_init_was_meta"] and r["materialized"] == {"devices": [device], "meta_left": False, "finite": True}, r
    assert r["param_types"] == ["DTensor"] and r["local_devices"] == [device], r
    assert r["losses_finite"] and r["max_diff"] <= TOLERANCE, r
    assert r["async_changed"] >= 0.5, r  # the model did change after save() returned ...
    assert r["async_diff"] == 0.0 and r["async_remainder"] == {"step": 3}, r  # ... and the file has what it held then
    assert r["sharded_diff"] == 0.0 and r["sharded_remainder"] == {"step": 3}, r


def check_fsdp_cpu_offload(device: str, out: Path) -> None:
    """FSDPStrategy(cpu_offload=True): shards live on the CPU (on a CPU run the policy is off and they are there anyway)."""
    r = run_job(device, "fsdp_offload", out)
    assert r["backend"] == backend_of(device) and r["local_devices"] == ["cpu"], r
    assert r["max_diff"] <= TOLERANCE and r["loaded_diff"] == 0.0, r


def check_model_parallel(device: str, out: Path) -> None:
    """ModelParallelStrategy (tensor parallel + fully_shard), world size 1: a 1 x 1 mesh on the device."""
    r = run_job(device, "tp", out)
    assert r["backend"] == backend_of(device), r
    assert r["mesh"] == [device, ["data_parallel", "tensor_parallel"], [1, 1]], r
    assert r["local_devices"] == [device] and r["max_diff"] <= TOLERANCE and r["loaded_diff"] == 0.0, r


def check_dcp_round_trip(device: str, out: Path) -> None:
    """A folder of shards saved under FSDP on the device loads on the CPU (into a plain model, in this process), is
    saved there as a single file, and that file loads back into an FSDP model on the device, which trains on."""
    saved = run_job(device, "dcp_save", out)
    assert saved["local_devices"] == [device], saved
    expected = torch.load(out / "saved.pt", weights_only=True)
    fabric = Fabric(accelerator="cpu", devices=1)
    model = fabric.setup(_sharding_net(seed=5))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    remainder = fabric.load(out / "from_device", {"model": model, "optimizer": optimizer})
    assert remainder == {"step": 3}
    assert all(torch.equal(value, expected[name]) for name, value in model.state_dict().items() if name in expected)
    assert next(model.parameters()).device.type == "cpu" and len(optimizer.state) == len(list(model.parameters()))
    fabric.save(out / "from_cpu.pt", {"model": model, "optimizer": optimizer, "step": 4})
    back = run_job(device, "dcp_load", out)
    assert back["local_devices"] == [device] and back["trains_on"], back
    assert back["diffs"] == {"from_cpu.pt": 0.0}, back
    assert back["remainders"] == {"from_cpu.pt": {"step": 4}}, back


def _sharding_net(seed: int) -> nn.Module:
    from support.scripts.sharding.model import make_net

    return make_net(seed)


# ---- in-process jobs ----------------------------------------------------------------------------------------


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))


def _batches(steps: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    xs = torch.randn(steps, 8, 16, generator=generator)
    return [(x, x.sum(dim=1, keepdim=True)) for x in xs]


def same_as_raw(ours: torch.Tensor, raw: torch.Tensor, device: str) -> bool:
    """The same loop gives the same bits on the CPU; on a GPU too, unless a library picks another kernel for one of
    two identical calls, so there a difference within a few units of the dtype's last place is let through."""
    if device == "cpu" or torch.equal(ours, raw):
        return torch.equal(ours, raw)
    eps = torch.finfo(ours.dtype).eps
    return torch.allclose(ours, raw, rtol=8 * eps, atol=8 * eps)


def check_true_precisions_match_raw(device: str, out: Path) -> None:
    """bf16-true / 16-true / 64-true: Fabric's loop gives bit for bit the parameters of the same loop in raw PyTorch
    (weights in the dtype, inputs cast to it, outputs cast back to float32, loss in float32)."""
    for precision, dtype in (("bf16-true", torch.bfloat16), ("16-true", torch.float16), ("64-true", torch.float64)):
        raw = _mlp().to(device=device, dtype=dtype)
        raw_optimizer = torch.optim.SGD(raw.parameters(), lr=0.01)
        fabric = Fabric(accelerator=device, devices=1, precision=precision)
        with fabric.init_module():
            made = _mlp()  # made on the device in the dtype (its random init then differs from a cast float32 one)
        assert {(p.dtype, p.device.type) for p in made.parameters()} == {(dtype, device)}
        model, optimizer = _set_up(fabric)  # setup() casts a float32 model, as raw's .to(dtype) does
        assert {(p.dtype, p.device.type) for p in model.parameters()} == {(dtype, device)}
        for x, y in _batches():
            x, y = x.to(device), y.to(device)
            raw_loss = F.mse_loss(raw(x.to(dtype)).to(torch.get_default_dtype()), y)
            raw_loss.backward()
            raw_optimizer.step()
            raw_optimizer.zero_grad()
            output = model(x)
            assert output.dtype == torch.get_default_dtype(), (precision, output.dtype)
            loss = F.mse_loss(output, y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            assert same_as_raw(loss, raw_loss, device), (precision, loss, raw_loss)
        for a, b in zip(raw.parameters(), model.parameters()):
            assert same_as_raw(a, b, device), precision


def _sixteen_mixed(device: str) -> Fabric:
    """16-mixed with its gradient scaler. On the GPU it is the plain ``precision="16-mixed"`` (the scaler fabric
    makes); the CPU would run bf16-mixed instead, so there the same plugin gets a CPU scaler explicitly."""
    if device == "cuda":
        return Fabric(accelerator="cuda", devices=1, precision="16-mixed")
    from fabric.plugins.precision import MixedPrecision

    return Fabric(accelerator="cpu", devices=1, plugins=MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu")))


def check_16_mixed_skips_inf_and_restores_scaler(device: str, out: Path) -> None:
    """16-mixed: the same as raw autocast + GradScaler, a step with an inf gradient is skipped and halves the
    scale, and the scaler's state goes through fabric.save / fabric.load."""
    fabric = _sixteen_mixed(device)
    scaler = fabric.strategy.precision.scaler
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled()
    model, optimizer = _set_up(fabric)
    raw = _mlp().to(device)
    raw_optimizer = torch.optim.SGD(raw.parameters(), lr=0.01)
    raw_scaler = torch.amp.GradScaler(device)
    for x, y in _batches(3):
        x, y = x.to(device), y.to(device)
        with torch.autocast(device, dtype=torch.float16):
            raw_out = raw(x.half())
        raw_loss = F.mse_loss(raw_out.float(), y)
        raw_scaler.scale(raw_loss).backward()
        raw_scaler.step(raw_optimizer)
        raw_scaler.update()
        raw_optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        assert same_as_raw(loss, raw_loss, device), (loss, raw_loss)
    assert all(same_as_raw(a, b, device) for a, b in zip(raw.parameters(), model.parameters()))
    scale = scaler.get_scale()
    assert scale == raw_scaler.get_scale() and scale > 1

    before = [p.detach().clone() for p in model.parameters()]
    x, y = _batches(1)[0]
    x = x.to(device)
    x[0, 0] = float("inf")  # the gradients overflow: the scaler must skip this step
    fabric.backward(F.mse_loss(model(x), y.to(device)))
    optimizer.step()
    optimizer.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "a step with inf gradients was taken"
    assert scaler.get_scale() == scale / 2

    fabric.save(out / "scaler.ckpt", {"model": model, "optimizer": optimizer, "scaler": scaler})
    saved_state = scaler.state_dict()
    other = _sixteen_mixed(device)
    other_model, other_optimizer = _set_up(other, seed=3)
    other_scaler = other.strategy.precision.scaler
    assert other_scaler.get_scale() != saved_state["scale"]
    other.load(out / "scaler.ckpt", {"model": other_model, "optimizer": other_optimizer, "scaler": other_scaler})
    assert other_scaler.state_dict() == saved_state
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other_model.parameters()))


def _set_up(fabric: Fabric, seed: int = 0) -> tuple[Any, Any]:
    model = _mlp(seed)
    return fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))


def check_async_save_copies_off_the_device(device: str, out: Path) -> None:
    """fabric.save(async_save=True) returns once the state is copied to host memory: changing the model right
    after does not change the file, and the file loads back on the device."""
    fabric = Fabric(accelerator=device, devices=1)
    model, optimizer = _set_up(fabric)
    x, y = _batches(1)[0]
    fabric.backward(F.mse_loss(model(x.to(device)), y.to(device)))
    optimizer.step()
    saved = [p.detach().clone() for p in model.parameters()]
    fabric.save(out / "async.ckpt", {"model": model, "optimizer": optimizer, "step": 1}, async_save=True)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)  # on the device, after save() returned
    remainder = fabric.load(out / "async.ckpt", {"model": model, "optimizer": optimizer})  # waits for the write
    assert remainder == {"step": 1}
    assert all(torch.equal(a, b) for a, b in zip(saved, model.parameters()))
    assert next(model.parameters()).device.type == device
    on_disk = torch.load(out / "async.ckpt", weights_only=True, map_location="cpu")
    assert all(t.device.type == "cpu" for t in on_disk["model"].values())


def check_empty_init_on_the_device(device: str, out: Path) -> None:
    """init_module(empty_init=True) on one device: parameters made on the device, uninitialised, then loaded."""
    fabric = Fabric(accelerator=device, devices=1)
    source = _mlp()
    torch.save(source.state_dict(), out / "weights.pt")
    with fabric.init_module(empty_init=True):
        model = _mlp()
    assert all(p.device.type == device and not p.is_meta for p in model.parameters())
    model = fabric.setup(model)
    fabric.load_raw(out / "weights.pt", model)
    assert all(torch.equal(a.to(device), b) for a, b in zip(source.parameters(), model.parameters()))


def check_pinned_loader(device: str, out: Path) -> None:
    """A DataLoader with pin_memory=True through setup_dataloaders: every batch arrives on the device, whole and in
    order (the host-to-device copies are non-blocking on CUDA), the same batches as the raw loader's."""
    generator = torch.Generator().manual_seed(0)
    dataset = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=generator), torch.arange(64))
    pin = device == "cuda"  # pinning needs an accelerator; on the CPU the same loader without it
    loader = torch.utils.data.DataLoader(dataset, batch_size=8, pin_memory=pin)
    fabric = Fabric(accelerator=device, devices=1)
    wrapped = fabric.setup_dataloaders(loader)
    seen = 0
    for (x, index), (raw_x, raw_index) in zip(wrapped, loader):
        assert x.device.type == device and index.device.type == device
        x = x * 1.0  # a kernel reading the batch right after the non-blocking copy
        assert torch.equal(x.cpu(), raw_x) and torch.equal(index.cpu(), raw_index)
        seen += 1
    assert seen == len(loader) == 8


def check_compile(device: str, out: Path) -> None:
    """fabric.setup(torch.compile(model)) trains like the compiled raw model and saves keys without ``_orig_mod``.
    inductor on the GPU; on the CPU the "eager" backend (no C++ compiler needed: fabric's part is the same)."""
    backend = "inductor" if device == "cuda" else "eager"
    fabric = Fabric(accelerator=device, devices=1)
    raw = torch.compile(_mlp().to(device), backend=backend)
    raw_optimizer = torch.optim.SGD(raw.parameters(), lr=0.01)
    model, optimizer = _set_up_compiled(fabric, backend)
    for x, y in _batches():
        x, y = x.to(device), y.to(device)
        raw_loss = F.mse_loss(raw(x), y)
        raw_loss.backward()
        raw_optimizer.step()
        raw_optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        assert torch.allclose(loss, raw_loss, rtol=1e-5, atol=1e-6), (loss, raw_loss)
    assert not any("_orig_mod" in key for key in model.state_dict())
    fabric.save(out / "compiled.ckpt", {"model": model})
    plain = fabric.setup(_mlp(seed=4))
    fabric.load(out / "compiled.ckpt", {"model": plain})
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters()))


def _set_up_compiled(fabric: Fabric, backend: str) -> tuple[Any, Any]:
    model = torch.compile(_mlp(), backend=backend)
    return fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))


# name -> (check, timeout in seconds on the GPU); both tests below parametrize over this one table
CHECKS: dict[str, tuple[Callable[[str, Path], None], int]] = {
    "ddp_world1": (check_ddp, 300),
    "fsdp2_world1": (check_fsdp, 300),
    "fsdp2_cpu_offload": (check_fsdp_cpu_offload, 300),
    "model_parallel_world1": (check_model_parallel, 300),
    "dcp_device_cpu_device": (check_dcp_round_trip, 400),
    "async_save": (check_async_save_copies_off_the_device, 120),
    "empty_init": (check_empty_init_on_the_device, 120),
    "16_mixed_scaler": (check_16_mixed_skips_inf_and_restores_scaler, 120),
    "true_precisions_vs_raw": (check_true_precisions_match_raw, 120),
    "pinned_loader": (check_pinned_loader, 120),
    "compile": (check_compile, 300),
}


def _with_timeouts() -> list[Any]:
    return [pytest.param(name, marks=pytest.mark.timeout(timeout)) for name, (_, timeout) in CHECKS.items()]


@pytest.mark.procs
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", _with_timeouts())
def test_on_the_gpu(name: str, tmp_path: Path) -> None:
    check, _ = CHECKS[name]
    check("cuda", tmp_path)


@pytest.mark.procs
@pytest.mark.parametrize("name", _with_timeouts())
def test_on_the_cpu(name: str, tmp_path: Path) -> None:
    """Gloo instead of NCCL; where the CPU cannot take the GPU's path the check says what it runs instead
    (16-mixed with an explicit CPU GradScaler, torch.compile's "eager" backend, no pinning, no offload policy)."""
    check, _ = CHECKS[name]
    check("cpu", tmp_path)
