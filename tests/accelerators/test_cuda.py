"""CUDA and NCCL paths, run for real where a GPU is present (skipped on CPU-only machines).

The CPU suite covers the logic of these paths; here the same public calls run on a real GPU: device
placement, mixed precision with its gradient scaler, NCCL collectives, and checkpoints written on
the GPU and read back on the CPU. One GPU is enough: multi-process NCCL jobs would need one GPU per
rank, so the NCCL checks run a one-rank DDP job (the code path is the same, the ring is trivial).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fabric import Fabric
from support import REPO

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROOT = REPO


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def _loader() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=generator)
    y = x.sum(dim=1, keepdim=True)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def _train(fabric: Fabric, steps: int = 30) -> list[float]:
    torch.manual_seed(0)
    model = _model()
    model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    loader = fabric.setup_dataloaders(_loader())
    losses = []
    for _ in range(steps):
        for x, y in loader:
            assert x.device.type == "cuda" and y.device.type == "cuda"
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return losses


def test_single_gpu_placement_and_training():
    fabric = Fabric(accelerator="cuda", devices=1)
    assert fabric.device == torch.device("cuda", 0)
    losses = _train(fabric)
    assert losses[-1] < 0.2 * losses[0]
    moved = fabric.to_device({"a": torch.ones(2), "b": [torch.zeros(1)]})
    assert moved["a"].device.type == "cuda" and moved["b"][0].device.type == "cuda"


def test_16_mixed_uses_a_gradient_scaler_and_trains():
    fabric = Fabric(accelerator="cuda", devices=1, precision="16-mixed")
    scaler = getattr(fabric.strategy.precision, "scaler", None)
    assert isinstance(scaler, torch.amp.GradScaler)
    model = fabric.setup(_model())
    x = torch.randn(4, 16, device=fabric.device)
    with fabric.autocast():
        assert model(x).dtype in (torch.float16, torch.float32)
    losses = _train(Fabric(accelerator="cuda", devices=1, precision="16-mixed"))
    assert losses[-1] < 0.2 * losses[0]


def test_bf16_mixed_runs_matmuls_in_bfloat16():
    fabric = Fabric(accelerator="cuda", devices=1, precision="bf16-mixed")
    seen = []
    model = _model()
    model[0].register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    model = fabric.setup(model)
    model(torch.randn(4, 16, device=fabric.device))
    assert seen == [torch.bfloat16]
    assert next(model.parameters()).dtype == torch.float32  # mixed: weights stay float32


@pytest.mark.parametrize(("precision", "dtype"), [("bf16-true", torch.bfloat16), ("16-true", torch.float16)])
def test_true_half_precisions_store_weights_in_half(precision, dtype):
    fabric = Fabric(accelerator="cuda", devices=1, precision=precision)
    with fabric.init_module():
        model = _model()
    assert next(model.parameters()).dtype == dtype and next(model.parameters()).device.type == "cuda"
    seen = []
    model[0].register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    output = fabric.setup(model)(torch.randn(2, 16, device=fabric.device))
    assert seen == [dtype]  # inputs were cast to the weights' dtype on the way in ...
    assert output.dtype == torch.get_default_dtype()  # ... and outputs back, as in Lightning Fabric


def test_gpu_checkpoint_loads_back_on_gpu_and_on_cpu(tmp_path):
    fabric = Fabric(accelerator="cuda", devices=1)
    model = _model()
    model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters()))
    fabric.backward(model(torch.randn(4, 16, device=fabric.device)).sum())
    optimizer.step()
    path = tmp_path / "gpu.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 3})

    other_fabric = Fabric(accelerator="cuda", devices=1)
    other = _model()
    other, other_optimizer = other_fabric.setup(other, torch.optim.Adam(other.parameters()))
    remainder = other_fabric.load(path, {"model": other, "optimizer": other_optimizer})
    assert remainder == {"step": 3}
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)

    on_cpu = Fabric(accelerator="cpu", devices=1)
    cpu_model = on_cpu.setup(_model())
    on_cpu.load(path, {"model": cpu_model}, strict=False)
    assert next(cpu_model.parameters()).device.type == "cpu"
    assert torch.equal(next(cpu_model.parameters()), next(model.parameters()).cpu())


NCCL_JOB = textwrap.dedent(
    """
    import torch
    from fabric import Fabric

    fabric = Fabric(accelerator="cuda", devices=1, strategy="ddp")
    fabric.launch()
    assert fabric.strategy.process_group_backend == "nccl", fabric.strategy.process_group_backend
    model = torch.nn.Linear(8, 1)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert type(model._forward_module).__name__ == "DistributedDataParallel"
    x = torch.randn(4, 8, device=fabric.device)
    with fabric.no_backward_sync(model):
        fabric.backward(model(x).sum())
    fabric.backward(model(x).sum())
    optimizer.step()
    total = fabric.all_reduce(torch.tensor(3.0, device=fabric.device), reduce_op="sum")
    assert total.item() == 3.0 and total.device.type == "cuda"
    gathered = fabric.all_gather(torch.arange(3, device=fabric.device))
    assert gathered.device.type == "cuda"
    assert fabric.broadcast({"answer": 42}) == {"answer": 42}
    tensor = fabric.broadcast(torch.ones(2, device=fabric.device))
    assert tensor.device.type == "cuda"
    assert fabric.reduce_boolean_decision(True)
    fabric.barrier()
    print("NCCL-OK", flush=True)
    """
)


@pytest.mark.procs
def test_one_rank_ddp_job_on_nccl(tmp_path):
    script = tmp_path / "nccl_job.py"
    script.write_text(NCCL_JOB)
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=240,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "NCCL-OK" in result.stdout
