"""A damaged checkpoint never half-loads, and bit rot is caught.

Damage is done to real checkpoints in the test: shards deleted, truncated and bit-flipped under a real
2-process FSDP load (both ranks' shards must stay exactly as they were), single files and folders with
flipped bits, optimizer states of the wrong shape, a folder without its index, a sharded save into a
file-size limit, and a property test of random truncations and bit flips.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from fabric import Fabric
from fabric.checkpoint import integrity
from fabric.checkpoint.formats import load_sharded
from fabric.checkpoint.formats.file import CheckpointLoadError
from fabric.checkpoint.formats.shard_reader import read_index
from fabric.checkpoint.formats.sharded import save_sharded
from fabric.utilities.exceptions import CheckpointMismatchError
from support.dcp_jobs import run_job
from support.environment import job_environment
from support.models import stepped_pair

REFUSED = (CheckpointLoadError, CheckpointMismatchError)


def trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    return stepped_pair(seed=0)


def fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
    """Another model and optimizer of the same shapes, to load into."""
    return stepped_pair(seed=1)


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    values = {name: value.detach().clone() for name, value in model.state_dict().items()}
    for number, entry in enumerate(optimizer.state.values()):
        values.update({f"state{number}.{name}": value.clone() for name, value in entry.items()})
    return values


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


def flip(path: Path, offset: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


def data_offset(path: Path, record_suffix: str) -> tuple[int, str]:
    """Where the bytes of the first zip record whose name ends with ``record_suffix`` start (and its name)."""
    with zipfile.ZipFile(path) as archive:
        info = next(info for info in archive.infolist() if info.filename.endswith(record_suffix))
    raw = path.read_bytes()
    header = info.header_offset
    name_length = int.from_bytes(raw[header + 26 : header + 28], "little")
    extra_length = int.from_bytes(raw[header + 28 : header + 30], "little")
    return header + 30 + name_length + extra_length, info.filename


@pytest.fixture
def fabric() -> Fabric:
    return Fabric(accelerator="cpu", devices=1)


# ---- single files ------------------------------------------------------------------------------------


def test_a_flipped_bit_in_tensor_data_is_refused_naming_the_file_and_record(fabric, tmp_path):
    model, optimizer = trained()
    path = tmp_path / "ckpt.pt"
    fabric.save(path, {"model": model, "optimizer": optimizer})
    offset, record = data_offset(path, "data/0")
    flip(path, offset + 5, bit=3)
    target, target_optimizer = fresh()
    before = snapshot(target, target_optimizer)
    with pytest.raises(CheckpointLoadError, match="checksum") as caught:
        fabric.load(path, {"model": target, "optimizer": target_optimizer})
    assert str(path) in str(caught.value) and record in str(caught.value)
    assert same(before, snapshot(target, target_optimizer))


def test_an_optimizer_state_of_the_wrong_shape_is_refused_before_anything_changes(fabric, tmp_path):
    model, optimizer = trained()
    state = optimizer.state_dict()
    state["state"][0]["exp_avg"] = torch.zeros(3, 3)  # the first layer's weight is (512, 64)
    path = tmp_path / "bad.pt"
    torch.save({"model": model.state_dict(), "optimizer": state}, path)
    for stepped in (True, False):  # an optimizer with state of its own, and one that never stepped
        target, target_optimizer = fresh()
        if not stepped:
            target_optimizer = torch.optim.Adam(target.parameters(), lr=0.1)
        before = snapshot(target, target_optimizer)
        with pytest.raises(CheckpointMismatchError, match=r"'exp_avg' has shape \(3, 3\)"):
            fabric.load(path, {"model": target, "optimizer": target_optimizer})
        assert same(before, snapshot(target, target_optimizer))


def test_a_legacy_file_has_nothing_to_check_and_says_so(fabric, tmp_path, monkeypatch):
    model, _ = trained()
    path = tmp_path / "legacy.pt"
    torch.save({"model": model.state_dict()}, path, _use_new_zipfile_serialization=False)
    target, _ = fresh()
    monkeypatch.setattr(integrity, "_said", set())  # said once per process: maybe already, by an earlier test
    with pytest.warns(UserWarning, match="legacy"):
        fabric.load(path, {"model": target})
    assert torch.equal(target[0].weight, model[0].weight)


def test_strict_false_that_matches_nothing_warns_naming_both_sides(fabric, tmp_path):
    model, _ = trained()
    path = tmp_path / "ckpt.pt"
    fabric.save(path, {"model": model})
    with pytest.warns(UserWarning, match=r"none of the keys \['weights'\].*holds \['model'\]"):
        fabric.load(path, {"weights": nn.Linear(2, 2)}, strict=False)
    torch.save({"model": {"encoder.weight": torch.zeros(2)}}, tmp_path / "other.pt")
    with pytest.warns(UserWarning, match="none of the checkpoint's keys.*'encoder.weight'.*'0.weight'"):
        fabric.load(tmp_path / "other.pt", {"model": nn.Sequential(nn.Linear(2, 2))}, strict=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a partial match loads what matches, quietly
        fabric.load(path, {"model": fresh()[0], "other": 1}, strict=False)


# ---- folders of shards, one process ------------------------------------------------------------------


def saved_folder(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    model, optimizer = trained()
    folder = tmp_path / "sharded"
    save_sharded(folder, {"model": model, "optimizer": optimizer})
    return folder, snapshot(model, optimizer)


def test_a_flipped_bit_in_a_shard_is_refused_naming_the_file_and_entry(tmp_path):
    folder, _ = saved_folder(tmp_path)
    index = read_index(folder)
    item, info = max(index.storage_data.items(), key=lambda pair: pair[1].length)
    flip(folder / info.relative_path, info.offset + info.length // 2)
    target, target_optimizer = fresh()
    before = snapshot(target, target_optimizer)
    with pytest.raises(CheckpointLoadError, match="damaged") as caught:
        load_sharded(folder, {"model": target, "optimizer": target_optimizer})
    assert info.relative_path in str(caught.value) and item.fqn in str(caught.value)
    assert same(before, snapshot(target, target_optimizer))


def test_a_changed_index_is_refused(tmp_path):
    folder, _ = saved_folder(tmp_path)
    flip(folder / ".metadata", (folder / ".metadata").stat().st_size // 2)
    with pytest.raises(CheckpointLoadError, match=r"index '\.metadata' does not match"):
        load_sharded(folder, {"model": fresh()[0]})


def test_a_folder_without_its_index_says_it_is_incomplete_and_what_is_missing(fabric, tmp_path):
    folder, _ = saved_folder(tmp_path)
    (folder / ".metadata").unlink()
    with pytest.raises(CheckpointLoadError, match=r"not a complete sharded checkpoint: it has no \.metadata"):
        fabric.load(folder, {"model": fresh()[0]})


def test_a_truncated_or_missing_shard_file_is_named_before_anything_is_read(tmp_path):
    folder, _ = saved_folder(tmp_path)
    shard = next(folder.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    target, target_optimizer = fresh()
    before = snapshot(target, target_optimizer)
    with pytest.raises(CheckpointLoadError, match=rf"{shard.name}' has \d+ bytes, but the index places data up to byte"):
        load_sharded(folder, {"model": target, "optimizer": target_optimizer})
    shard.unlink()
    with pytest.raises(CheckpointLoadError, match=rf"data file '{shard.name}' .* is missing"):
        load_sharded(folder, {"model": target, "optimizer": target_optimizer})
    assert same(before, snapshot(target, target_optimizer))


def test_a_refused_sharded_load_leaves_an_optimizer_without_state_without_state(tmp_path):
    """torch's state-dict API gives an optimizer with no state a made-up one (step 1, zero moments) while we
    check the folder; a load that does not go through must not leave it behind."""
    folder, _ = saved_folder(tmp_path)
    index = read_index(folder)
    _, info = max(index.storage_data.items(), key=lambda pair: pair[1].length)
    flip(folder / info.relative_path, info.offset + info.length // 2)
    torch.manual_seed(1)
    target = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 8))
    optimizer = torch.optim.Adam(target.parameters(), lr=0.1)  # never stepped: no state yet
    before = snapshot(target, optimizer)
    with pytest.raises(CheckpointLoadError, match="damaged"):
        load_sharded(folder, {"model": target, "optimizer": optimizer})
    assert not optimizer.state and all(p.grad is None for p in target.parameters())
    assert same(before, snapshot(target, optimizer)) and optimizer.param_groups[0]["lr"] == 0.1


class AnchoredSGD(torch.optim.Optimizer):
    """Keeps in its state a tensor that shares its parameter's memory, as some optimizers keep references."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self.state[param].setdefault("anchor", param.detach())
                    param.add_(param.grad, alpha=-group["lr"])


def test_a_fresh_optimizer_state_that_shares_a_parameters_memory_is_not_read_into_in_place(tmp_path):
    """A resumed job's optimizer state is read straight into torch's placeholder, unless the placeholder shares
    memory with a parameter: that one is staged, so damage found midway leaves the parameter as it was."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 8))
    optimizer = AnchoredSGD(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    folder = tmp_path / "sharded"
    save_sharded(folder, {"model": model, "optimizer": optimizer})
    index = read_index(folder)
    info = next(info for key, info in index.storage_data.items() if key.fqn == "optimizer/state/0.weight/anchor")
    assert info.length > integrity.SMALL_ARCHIVE  # read straight into its destination
    flip(folder / info.relative_path, info.offset + info.length // 2)
    torch.manual_seed(1)
    target = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 8))
    target_optimizer = AnchoredSGD(target.parameters())  # never stepped: torch's API makes its placeholder state
    before = {name: value.clone() for name, value in target.state_dict().items()}
    with pytest.raises(CheckpointLoadError, match="damaged"):
        load_sharded(folder, {"model": target, "optimizer": target_optimizer})
    assert same(before, target.state_dict()) and not target_optimizer.state


# ---- random damage: a clear error and an unchanged target, or exactly the saved values -------------


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("pristine")
    model, optimizer = trained()
    Fabric(accelerator="cpu", devices=1).save(root / "file.pt", {"model": model, "optimizer": optimizer})
    save_sharded(root / "folder", {"model": model, "optimizer": optimizer})
    return {"root": root, "saved": snapshot(model, optimizer)}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    kind=st.sampled_from(["file", "folder"]),
    damage=st.sampled_from(["flip", "truncate"]),
    where=st.floats(min_value=0.0, max_value=0.999),
    bit=st.integers(min_value=0, max_value=7),
    flips=st.integers(min_value=1, max_value=3),
)
def test_random_damage_gives_a_clear_error_and_no_change_or_the_exact_values(pristine, tmp_path, kind, damage, where, bit, flips):
    root: Path = pristine["root"]  # type: ignore[assignment]
    case = tmp_path / f"case-{kind}"
    shutil.rmtree(case, ignore_errors=True)
    if kind == "file":
        target_path = case / "file.pt"
        case.mkdir()
        shutil.copy(root / "file.pt", target_path)
        victims = [target_path]
    else:
        target_path = case / "folder"
        shutil.copytree(root / "folder", target_path)
        victims = sorted(p for p in target_path.iterdir() if p.is_file())
    victim = victims[int(where * len(victims))]
    size = victim.stat().st_size
    if damage == "truncate":
        victim.write_bytes(victim.read_bytes()[: int(where * size)])
    else:
        for step in range(flips):
            flip(victim, int(where * size + step * 977) % size, bit)
    model, optimizer = fresh()
    before = snapshot(model, optimizer)
    fabric = Fabric(accelerator="cpu", devices=1)
    refusal: Exception | None = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fabric.load(target_path, {"model": model, "optimizer": optimizer})
    except REFUSED as err:
        refusal = err
    if refusal is not None:
        assert str(target_path) in str(refusal) or victim.name in str(refusal), refusal
        assert same(before, snapshot(model, optimizer)), f"{victim.name} {damage}: refused, but the target changed"
        return
    assert same(pristine["saved"], snapshot(model, optimizer)), f"{victim.name} {damage} at {where}: loaded other values"  # type: ignore[arg-type]


# ---- two processes under FSDP: no rank changes anything -------------------------------------------------


@pytest.mark.procs
@pytest.mark.timeout(300)
@pytest.mark.parametrize("damage", ["missing", "truncated", "flipped"])
def test_a_damaged_shard_changes_neither_rank_under_fsdp(saved_on_two, tmp_path, damage):
    folder = tmp_path / "sharded"
    shutil.copytree(saved_on_two / "sharded", folder)
    shard = folder / "__1_0.distcp"  # rank 1's shards only: rank 0 could read its own
    if damage == "missing":
        shard.unlink()
    elif damage == "truncated":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size - 100])
    else:
        index = read_index(folder)
        info = max((info for info in index.storage_data.values() if info.relative_path == shard.name), key=lambda i: i.length)
        flip(shard, info.offset + info.length // 2)
    run_job(2, str(tmp_path), "load_damaged", str(folder))
    for rank in (0, 1):
        report = json.loads((tmp_path / f"damaged-rank{rank}.json").read_text())
        assert report["error"] is not None, f"rank {rank} loaded a damaged checkpoint"
        assert "__1_0.distcp" in report["error"], report["error"]
        assert report["unchanged"] and report["tensors"] > 0, f"rank {rank}: {report}"


# ---- a full disk while the shards are written ------------------------------------------------------------


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_a_sharded_save_into_a_file_size_limit_keeps_the_old_checkpoint_and_leaves_no_temp_folder(tmp_path):
    script = tmp_path / "limit.py"
    script.write_text(textwrap.dedent(f"""
        import resource, signal, torch
        from torch import nn
        from fabric.checkpoint.formats import load_sharded
        from fabric.checkpoint.formats.sharded import save_sharded
        folder = {str(tmp_path / "ckpt")!r}
        small = nn.Linear(4, 4)
        save_sharded(folder, {{"model": small}})
        big = nn.Linear(4, 4)
        big.register_buffer("pad", torch.ones(64, 1024))  # 256 KiB: over the limit below
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write over the limit fails with EFBIG, like a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
        try:
            save_sharded(folder, {{"model": big}})
        except Exception as err:  # ours is an Exception: torch's CheckpointException would escape this
            print("ERROR", type(err).__name__, err)
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        target = nn.Linear(4, 4)
        load_sharded(folder, {{"model": target}})
        print("OLD", torch.equal(target.weight, small.weight))
    """))
    result = subprocess.run([sys.executable, str(script)], env=job_environment(), capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ERROR RuntimeError Saving the sharded checkpoint" in result.stdout and "previous one is kept" in result.stdout, result.stdout
    assert "OLD True" in result.stdout, result.stdout
    assert len(result.stdout.splitlines()[0]) < 400, "one clear line, not torch's per-rank traces"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".fabric-tmp")] == []


# ---- saves a user can get wrong: a clear error, the previous file unchanged -------------------------


def test_saving_under_a_file_names_the_file_in_the_way(fabric, tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(FileExistsError, match=r"'.*afile' is a file, not a folder"):
        fabric.save(tmp_path / "afile" / "sub" / "ckpt.pt", {"step": 1})


def test_an_object_that_cannot_be_pickled_is_named_and_the_previous_file_kept(fabric, tmp_path):
    import threading

    path = tmp_path / "ckpt.pt"
    fabric.save(path, {"step": 1})
    with pytest.raises(TypeError, match=r"cannot be saved \(cannot pickle '_thread.lock' object\)"):
        fabric.save(path, {"step": 2, "lock": threading.Lock()})
    assert fabric.load(path) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]
