"""Fabric on a GPU against raw PyTorch (and Lightning Fabric, when importable) in the same process.

``step``: the time of one training step and its peak memory, for a tiny MLP (32 -> 64 -> 64 -> 1, batch 32,
SGD: the wrappers' per-call cost, as in ``step_overhead.py``) and a ~110M-parameter transformer (12 layers,
width 768, vocabulary 16384, batch 8 x 256 tokens, AdamW), in 32-true, bf16-mixed and 16-mixed. The raw loop,
Fabric's and Lightning's run in interleaved blocks (the order rotating every round) after warm-up steps, with
``torch.cuda.synchronize()`` around every block; the result is the median of the blocks' per-step times.
Peak memory is ``torch.cuda.max_memory_allocated()`` over a variant's set-up and first steps, less what was
allocated before it (each variant's own footprint: parameters, gradients, optimizer state, activations).

``save``: ``fabric.save`` of the transformer's parameters and AdamW state (~1.3 GB) straight from the GPU
against ``torch.save`` of the same state dicts (and ``torch.save`` followed by an fsync, and Lightning's
``save``), interleaved, the median of ``--reps``.

Every case is written to ``--json`` as soon as it is measured, so a run cut short keeps what it measured.
``--device cpu --quick`` runs the same code with tiny sizes (the CPU test of this script's logic).

    python3 benchmarks/gpu.py step --json step.json [--device cuda] [--quick]
    python3 benchmarks/gpu.py save --json save.json [--device cuda] [--reps 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from torch import nn

from fabric import Fabric

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
Step = Callable[[], None]


# ---- what is measured ---------------------------------------------------------------------------------------


class Transformer(nn.Module):
    """A GPT-like stack of ``nn.TransformerEncoderLayer`` (pre-norm, causal mask), untied embedding and head."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(seq, width))
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.norm(self.blocks(x, mask=self.mask, is_causal=True)))


def transformer_config(quick: bool) -> dict[str, int]:
    if quick:
        return {"vocab": 64, "width": 32, "layers": 2, "heads": 2, "seq": 16, "batch": 2}
    return {"vocab": 16384, "width": 768, "layers": 12, "heads": 12, "seq": 256, "batch": 8}


def make_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))


def make_transformer(config: dict[str, int]) -> nn.Module:
    return Transformer(config["vocab"], config["width"], config["layers"], config["heads"], config["seq"])


class Case:
    """One model and its batch: how to build the model and its optimizer, the loss of an output."""

    def __init__(self, name: str, device: str, quick: bool) -> None:
        self.name = name
        generator = torch.Generator().manual_seed(0)
        if name == "mlp":
            self.make: Callable[[], nn.Module] = make_mlp
            self.batch = (torch.randn(32, 32, generator=generator).to(device), torch.randn(32, 1, generator=generator).to(device))
            self.optimizer = lambda params: torch.optim.SGD(params, lr=1e-3)
            self.loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lambda out, y: F.mse_loss(out.float(), y)
        else:
            config = transformer_config(quick)
            self.make = lambda: make_transformer(config)
            tokens = torch.randint(0, config["vocab"], (config["batch"], config["seq"] + 1), generator=generator).to(device)
            self.batch = (tokens[:, :-1], tokens[:, 1:])
            self.optimizer = lambda params: torch.optim.AdamW(params, lr=1e-4)
            self.loss = lambda out, y: F.cross_entropy(out.float().flatten(0, 1), y.flatten())

    def model(self) -> nn.Module:
        torch.manual_seed(0)
        return self.make()


def raw_step(case: Case, precision: str, device: str) -> Step:
    model = case.model().to(device)
    optimizer = case.optimizer(model.parameters())
    x, y = case.batch
    loss_of = case.loss
    if precision == "32-true":

        def step() -> None:
            loss_of(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()

        return step
    dtype = torch.float16 if precision == "16-mixed" else torch.bfloat16
    x_in = x.to(dtype) if x.is_floating_point() else x  # Fabric (as Lightning) casts floating inputs to the autocast dtype
    if precision == "bf16-mixed":

        def step() -> None:
            with torch.autocast(device, dtype=dtype):
                out = model(x_in)
            loss_of(out, y).backward()
            optimizer.step()
            optimizer.zero_grad()

        return step
    scaler = torch.amp.GradScaler(device)

    def step() -> None:
        with torch.autocast(device, dtype=dtype):
            out = model(x_in)
        scaler.scale(loss_of(out, y)).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()

    return step


def fabric_step(fabric_class: Any, case: Case, precision: str, device: str) -> Step:
    """The same loop through ``fabric_class`` (ours or Lightning's: the same API)."""
    fabric = fabric_class(accelerator=device, devices=1, precision=precision)
    model = case.model()
    model, optimizer = fabric.setup(model, case.optimizer(model.parameters()))
    x, y = case.batch
    loss_of = case.loss

    def step() -> None:
        fabric.backward(loss_of(model(x), y))
        optimizer.step()
        optimizer.zero_grad()

    return step


def lightning_fabric() -> tuple[Any, str | None, str | None]:
    """Lightning's ``Fabric`` class and version if importable (never a dependency), else (None, None, why)."""
    errors = []
    for module_name in ("lightning.fabric", "lightning_fabric"):
        try:
            module = __import__(module_name, fromlist=["Fabric"])
            return module.Fabric, getattr(module, "__version__", None) or _version_of(module_name), None
        except Exception as err:  # not installed, or broken: either way the comparison is left out
            errors.append(f"{module_name}: {type(err).__name__}: {err}")
    return None, None, "; ".join(errors)


def _version_of(module_name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module_name.split(".")[0].replace("_", "-"))
    except Exception:
        return None


# ---- measuring ----------------------------------------------------------------------------------------------


class Device:
    """The device's clock and memory counters; on the CPU (the logic test) memory is not measured."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.cuda = name == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def start_peak(self) -> int:
        gc.collect()
        if not self.cuda:
            return 0
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def peak_since(self, base: int) -> int | None:
        if not self.cuda:
            return None
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base


def block_seconds(step: Step, steps: int, device: Device) -> float:
    device.sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    device.sync()
    return (time.perf_counter() - start) / steps


def interleaved(variants: dict[str, Step], rounds: int, steps: int, device: Device) -> dict[str, list[float]]:
    """Blocks of ``steps`` steps of each variant, the order rotating every round; per-step seconds of every block."""
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(block_seconds(variants[name], steps, device))
    return times


def ratios(medians: dict[str, float | None], baseline: str = "raw") -> dict[str, float | None]:
    """Each variant's median over the baseline's (None where either is missing)."""
    base = medians.get(baseline)
    return {name: (value / base if value is not None and base else None) for name, value in medians.items() if name != baseline}


def measure_step(case: Case, precision: str, device: Device, rounds: int, steps: int, warmup: int, lightning: Any) -> dict[str, Any]:
    builders: dict[str, Callable[[], Step]] = {
        "raw": lambda: raw_step(case, precision, device.name),
        "fabric": lambda: fabric_step(Fabric, case, precision, device.name),
    }
    if lightning is not None:
        builders["lightning"] = lambda: fabric_step(lightning, case, precision, device.name)
    variants: dict[str, Step] = {}
    peaks: dict[str, int | None] = {}
    errors: dict[str, str] = {}
    # the first steps on a device allocate what its libraries keep for the process (cuBLAS's workspace): a throwaway
    # raw loop pays for that, so that no variant's peak carries it
    primer = builders["raw"]()
    for _ in range(2):
        primer()
    del primer
    for name, build in builders.items():  # one at a time, so each peak is that variant's own
        base = device.start_peak()
        try:
            step = build()
            for _ in range(warmup):
                step()
            device.sync()
        except Exception as err:  # Lightning's failure is a finding, not the end of the benchmark
            if name == "raw":
                raise
            errors[name] = f"{type(err).__name__}: {err}"
            continue
        peaks[name] = device.peak_since(base)
        variants[name] = step
    times = interleaved(variants, rounds, steps, device)
    medians: dict[str, float | None] = {name: statistics.median(values) for name, values in times.items()}
    result: dict[str, Any] = {
        "step_ms": {name: round(value * 1e3, 4) for name, value in medians.items() if value is not None},
        "step_ratio": _rounded(ratios(medians)),
        "peak_mib": {name: (round(value / 2**20, 1) if value is not None else None) for name, value in peaks.items()},
        "peak_ratio": _rounded(ratios({name: (float(v) if v is not None else None) for name, v in peaks.items()})),
        "blocks": f"{rounds} rounds x {steps} steps, {warmup} warm-up steps, median of blocks",
    }
    if errors:
        result["errors"] = errors
    del variants
    gc.collect()
    if device.cuda:
        torch.cuda.empty_cache()
    return result


def _rounded(values: dict[str, float | None]) -> dict[str, float | None]:
    return {name: (round(value, 4) if value is not None else None) for name, value in values.items()}


Progress = Callable[[dict[str, Any]], None]


def measure_save(device: Device, reps: int, folder: Path, quick: bool, lightning: Any, progress: Progress | None = None) -> dict[str, Any]:
    """The medians so far go to ``progress`` after every round (a slow disk cut by a timeout still leaves numbers)."""
    case = Case("transformer", device.name, quick)
    fabric = Fabric(accelerator=device.name, devices=1)
    model = case.model()
    model, optimizer = fabric.setup(model, case.optimizer(model.parameters()))
    x, y = case.batch
    fabric.backward(case.loss(model(x), y))
    optimizer.step()  # AdamW's moments exist: the state is parameters + 2x their size
    optimizer.zero_grad()
    module, plain_optimizer = model.module, optimizer.optimizer
    numel = sum(p.numel() for p in module.parameters())

    def torch_save() -> None:
        torch.save({"model": module.state_dict(), "optimizer": plain_optimizer.state_dict()}, folder / "torch.pt")

    def torch_save_fsync() -> None:
        torch.save({"model": module.state_dict(), "optimizer": plain_optimizer.state_dict()}, folder / "torch_fsync.pt")
        fd = os.open(folder / "torch_fsync.pt", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def fabric_save() -> None:
        fabric.save(folder / "fabric.pt", {"model": model, "optimizer": optimizer})

    variants: dict[str, Step] = {"torch.save": torch_save, "torch.save+fsync": torch_save_fsync, "fabric.save": fabric_save}
    errors: dict[str, str] = {}
    if lightning is not None:
        try:
            other = lightning(accelerator=device.name, devices=1)
            lightning_model, lightning_optimizer = other.setup(module, plain_optimizer)
            variants["lightning.save"] = lambda: other.save(folder / "lightning.pt", {"model": lightning_model, "optimizer": lightning_optimizer})
        except Exception as err:
            errors["lightning.save"] = f"{type(err).__name__}: {err}"
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for rep in range(reps + 1):  # the first round is a warm-up (page cache, allocator, lazy imports)
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            device.sync()
            start = time.perf_counter()
            try:
                variants[name]()
            except Exception as err:
                if name in ("torch.save", "fabric.save"):
                    raise
                errors[name] = f"{type(err).__name__}: {err}"
                continue
            if rep:
                times[name].append(time.perf_counter() - start)
            for path in folder.iterdir():  # every save writes a new file, as a training run does
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        if rep and progress is not None:
            progress(_save_result(times, numel, device, rep, errors))
    return _save_result(times, numel, device, reps, errors)


def _save_result(times: dict[str, list[float]], numel: int, device: Device, reps: int, errors: dict[str, str]) -> dict[str, Any]:
    medians: dict[str, float | None] = {name: (statistics.median(values) if values else None) for name, values in times.items()}
    result: dict[str, Any] = {
        "state": f"{numel / 1e6:.1f}M parameters + AdamW state, on {device.name}",
        "seconds": {name: (round(value, 4) if value is not None else None) for name, value in medians.items()},
        "ratio_to_torch_save": _rounded(ratios(medians, baseline="torch.save")),
        "reps": reps,
    }
    if errors:
        result["errors"] = dict(errors)
    return result


# ---- output -------------------------------------------------------------------------------------------------


def environment(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Replace ``path`` whole (a reader never sees half a file)."""
    temp = path.with_name(path.name + ".tmp")
    temp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(temp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["step", "save"])
    parser.add_argument("--json", required=True, type=Path, help="where to write the results (rewritten after each case)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few repetitions (the logic test on the CPU)")
    parser.add_argument("--models", nargs="+", default=["mlp", "transformer"], choices=["mlp", "transformer"])
    parser.add_argument("--precisions", nargs="+", default=None, help=f"default: {' '.join(PRECISIONS)} (on the CPU: 32-true bf16-mixed)")
    parser.add_argument("--reps", type=int, default=3, help="save: timed repetitions of each variant")
    parser.add_argument("--dir", default=None, help="save: where to write (default: a new folder in the system temp dir)")
    parser.add_argument("--no-lightning", action="store_true", help="leave Lightning Fabric out even if it is importable")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu.py: no GPU found (torch {torch.__version__}, CUDA not available)", file=sys.stderr)
        return 2
    device = Device(args.device)
    lightning, lightning_version, lightning_missing = (None, None, "--no-lightning") if args.no_lightning else lightning_fabric()
    results: dict[str, Any] = {**environment(args.device), "lightning": lightning_version or f"not compared ({lightning_missing})", "cases": {}}
    write_json(args.json, results)
    if args.what == "step":
        precisions = args.precisions or (PRECISIONS if device.cuda else ("32-true", "bf16-mixed"))
        for model_name in args.models:
            case = Case(model_name, args.device, args.quick)
            tiny = model_name == "mlp"
            rounds, steps, warmup = (3, 2, 1) if args.quick else ((20, 50, 50) if tiny else (10, 5, 3))
            for precision in precisions:
                name = f"{model_name}/{precision}"
                results["cases"][name] = measure_step(case, precision, device, rounds, steps, warmup, lightning)
                write_json(args.json, results)
                print(f"{name}: {json.dumps(results['cases'][name]['step_ratio'])} of raw's step time", flush=True)
            del case
    else:
        folder = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="fabric-gpu-save-"))
        folder.mkdir(parents=True, exist_ok=True)
        try:

            def progress(partial: dict[str, Any]) -> None:
                results["cases"]["save"] = partial
                write_json(args.json, results)

            results["cases"]["save"] = measure_save(device, args.reps, folder, args.quick, lightning, progress)
        finally:
            if not args.dir:
                shutil.rmtree(folder, ignore_errors=True)
        write_json(args.json, results)
        print(f"save: {json.dumps(results['cases']['save']['ratio_to_torch_save'])} of torch.save's time", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
