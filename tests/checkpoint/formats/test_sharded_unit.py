"""Sharded checkpoints in one process: folder publication in every crash window, safe index reading,
async saves and their errors, loading through ``Fabric.load``. (Multi-process jobs: test_sharded_checkpoint.py.)"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

from fabric import Fabric
from fabric.checkpoint.formats import choose, load_sharded
from fabric.checkpoint.formats.file import CheckpointLoadError
from fabric.checkpoint.formats.full import save_full
from fabric.checkpoint.formats.sharded import OBJECTS_FILE, SHARDED, save_sharded
from fabric.checkpoint.storage import disk as atomic_folder
from fabric.checkpoint.storage import locate
from support.models import stepped_pair


def model_and_optimizer(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    return stepped_pair(seed, (4, 8, 2), torch.optim.AdamW)


def weights_of(path: Path) -> dict[str, torch.Tensor]:
    model, optimizer = model_and_optimizer(seed=99)
    load_sharded(path, {"model": model, "optimizer": optimizer}, strict=False)
    return {name: value.clone() for name, value in model.state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_replacing_a_checkpoint_leaves_a_whole_one_in_every_window(tmp_path):
    target = tmp_path / "ckpt"
    old_model, old_opt = model_and_optimizer(seed=1)
    new_model, new_opt = model_and_optimizer(seed=2)
    save_sharded(target, {"model": old_model, "optimizer": old_opt})
    old = {k: v.clone() for k, v in old_model.state_dict().items()}
    new = {k: v.clone() for k, v in new_model.state_dict().items()}

    # window 1: the new folder is written but not published: the old one is what loads
    token = atomic_folder.new_token()
    temp = atomic_folder.temp_folder_for(target, token)
    save_sharded(tmp_path / "scratch", {"model": new_model, "optimizer": new_opt})
    os.rename(tmp_path / "scratch", temp)
    assert same(weights_of(target), old)

    # window 2: the old folder is renamed aside, the new one not yet in place
    aside = tmp_path / f"{atomic_folder.ASIDE_PREFIX}ckpt.{token}"
    os.rename(target, aside)
    assert atomic_folder.resolve_for_load(target) == aside
    store = locate(target)
    assert choose(store.detect(), store) is SHARDED  # what the formats' table makes of what the store found there
    assert same(weights_of(target), old)
    # the next save puts the previous checkpoint back first, then replaces it
    atomic_folder.prepare_target(target)
    assert target.is_dir() and not aside.exists() and not temp.exists()
    assert same(weights_of(target), old)

    # window 3: new in place, the aside copy not removed yet: the new one loads, the next save cleans up
    os.rename(target, aside)
    save_sharded(tmp_path / "scratch", {"model": new_model, "optimizer": new_opt})
    os.rename(tmp_path / "scratch", target)
    assert same(weights_of(target), new)
    save_sharded(target, {"model": new_model, "optimizer": new_opt})
    # the replaced folder is kept as the spare the next save overwrites in place; nothing else is left
    assert sorted(p.name for p in tmp_path.iterdir()) == [".fabric-spare-ckpt", "ckpt"]
    assert same(weights_of(target), new)
    save_sharded(target, {"model": old_model, "optimizer": old_opt})
    assert sorted(p.name for p in tmp_path.iterdir()) == [".fabric-spare-ckpt", "ckpt"]
    assert same(weights_of(target), old)


def test_aside_names_belong_to_one_target_only(tmp_path):
    (tmp_path / f"{atomic_folder.ASIDE_PREFIX}a.b.{'0' * 12}").mkdir()
    with pytest.raises(FileNotFoundError, match="not found"):
        atomic_folder.resolve_for_load(tmp_path / "a")
    assert atomic_folder.resolve_for_load(tmp_path / "a.b").name.endswith("0" * 12)


def test_index_with_pickled_code_is_refused(tmp_path):
    model, optimizer = model_and_optimizer(seed=1)
    save_sharded(tmp_path / "ckpt", {"model": model, "optimizer": optimizer})

    class Payload:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    with open(tmp_path / "ckpt" / ".metadata", "wb") as file:
        pickle.dump(Payload(), file)
    with pytest.raises(CheckpointLoadError, match=r"index '\.metadata' does not match the checksum"):
        load_sharded(tmp_path / "ckpt", {"model": model})  # the objects file's CRC of the index catches it first
    objects = torch.load(tmp_path / "ckpt" / OBJECTS_FILE, weights_only=True)
    del objects["index_crc32"]  # as in folders written before the CRC was kept, or by a thorough attacker
    torch.save(objects, tmp_path / "ckpt" / OBJECTS_FILE)
    with pytest.raises(CheckpointLoadError, match="refused global"):
        load_sharded(tmp_path / "ckpt", {"model": model})
    assert not (tmp_path / "pwned").exists()


def test_objects_file_is_loaded_weights_only(tmp_path):
    model, _optimizer = model_and_optimizer(seed=1)
    save_sharded(tmp_path / "ckpt", {"model": model, "extra": {"fn": "safe"}})
    objects = torch.load(tmp_path / "ckpt" / OBJECTS_FILE, weights_only=True)
    objects["skeleton"]["extra"] = {"fn": os.getcwd}  # a global that weights_only refuses
    torch.save(objects, tmp_path / "ckpt" / OBJECTS_FILE)
    with pytest.raises(CheckpointLoadError, match="weights_only=False"):
        load_sharded(tmp_path / "ckpt", {"model": model})
    remainder = load_sharded(tmp_path / "ckpt", {"model": model}, weights_only=False)
    assert remainder["extra"]["fn"] is os.getcwd


def test_misfits_are_reported_before_anything_changes(tmp_path):
    model, optimizer = model_and_optimizer(seed=1)
    save_sharded(tmp_path / "ckpt", {"model": model, "optimizer": optimizer, "step": 1})
    other, other_opt = model_and_optimizer(seed=2)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    wider = nn.Sequential(nn.Linear(4, 9), nn.ReLU(), nn.Linear(9, 2))
    with pytest.raises(RuntimeError, match=r"'0.weight' has shape \(8, 4\) in the checkpoint but \(9, 4\)"):
        load_sharded(tmp_path / "ckpt", {"model": wider})
    with pytest.raises(KeyError, match=r"no entry for \['missing'\]"):
        load_sharded(tmp_path / "ckpt", {"model": other, "missing": 0})
    with pytest.raises(TypeError, match="is a module here but the checkpoint holds a plain value or Stateful object"):
        load_sharded(tmp_path / "ckpt", {"step": other})
    # None or a dict would take a plain entry as it is; a folder keeps a module's tensors apart, so it refuses them
    with pytest.raises(TypeError, match=r"state\['model'\] is a plain value or Stateful object here but the checkpoint holds a module"):
        load_sharded(tmp_path / "ckpt", {"model": None})
    with pytest.raises(KeyError, match="unexpected keys"):
        load_sharded(tmp_path / "ckpt", {"model": nn.Sequential(nn.Linear(4, 8))})
    assert same(other.state_dict(), before)
    with pytest.raises(ValueError, match="belong to no single module"):
        load_sharded(tmp_path / "ckpt", {"optimizer": other_opt})


def test_fabric_load_reads_a_sharded_folder_and_a_full_file_on_one_device(tmp_path):
    model, optimizer = model_and_optimizer(seed=1)
    save_sharded(tmp_path / "ckpt", {"model": model, "optimizer": optimizer, "step": 7})
    save_full(tmp_path / "full.pt", {"model": model, "optimizer": optimizer, "step": 7})
    fabric = Fabric(accelerator="cpu", devices=1)
    for source in ("ckpt", "full.pt"):
        fresh, fresh_opt = model_and_optimizer(seed=5)
        fresh, fresh_opt = fabric.setup(fresh, fresh_opt)
        state = {"model": fresh, "optimizer": fresh_opt, "step": 0}
        assert fabric.load(tmp_path / source, state) == {}
        assert state["step"] == 7
        assert same(fresh.state_dict(), model.state_dict())
        assert fresh_opt.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"]


def test_async_save_publishes_in_the_background_and_waits_before_the_next(tmp_path):
    model, optimizer = model_and_optimizer(seed=1)
    handle = save_sharded(tmp_path / "ckpt", {"model": model, "optimizer": optimizer, "step": 1}, async_save=True)
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)  # changing the model after the call does not change what is saved
    handle.wait()
    assert same(weights_of(tmp_path / "ckpt"), snapshot)
    second = save_sharded(tmp_path / "ckpt", {"model": model, "step": 2}, async_save=True)
    state = {"step": 0}
    remainder = load_sharded(tmp_path / "ckpt", state)  # waits for the pending save first
    assert second.done() and state["step"] == 2
    assert same(remainder["model"], model.state_dict())


def test_async_save_error_surfaces_at_the_next_save(tmp_path):
    model, _optimizer = model_and_optimizer(seed=1)
    # the objects file cannot be written (a lambda does not pickle): a failure in the background thread
    save_sharded(tmp_path / "bad", {"model": model, "hook": lambda: None}, async_save=True)
    with pytest.raises(RuntimeError, match=r"background save of .*bad") as info:
        save_sharded(tmp_path / "ok", {"model": model})
    assert "the previous one is kept" in str(info.value.__cause__)
    assert not (tmp_path / "bad").exists() and sorted(p.name for p in tmp_path.iterdir()) == []
    assert not (tmp_path / "ok").exists()  # the failed save is reported before the next one starts
    save_sharded(tmp_path / "ok", {"model": model})  # reported once; saving works again
    assert (tmp_path / "ok").is_dir()
    with pytest.raises(OSError, match=r"Cannot save the sharded checkpoint .*File exists"):
        save_sharded(tmp_path / "ok" / OBJECTS_FILE / "ckpt", {"model": model})


def test_fabric_async_save_of_a_single_file(tmp_path):
    fabric = Fabric(accelerator="cpu", devices=1)
    model, optimizer = model_and_optimizer(seed=1)
    model, optimizer = fabric.setup(model, optimizer)
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": optimizer, "step": 4}, async_save=True)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()  # after the call: not in the file
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(tmp_path / "ckpt.pt", state)  # waits for the background write
    assert state["step"] == 4 and same(model.state_dict(), snapshot)


EXIT_SCRIPT = """
import sys, torch
from fabric import Fabric
fabric = Fabric(accelerator="cpu", devices=1)
model = fabric.setup(torch.nn.Linear(2, 2))
fabric.save(sys.argv[1], {"model": model, "hook": lambda: None}, async_save=True)
print("loop goes on")
"""


@pytest.mark.procs
def test_a_failed_background_save_is_reported_at_exit(tmp_path, subprocess_env):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT, str(tmp_path / "ckpt.pt")],
        env=subprocess_env, capture_output=True, text=True, timeout=120,
    )
    assert "loop goes on" in done.stdout
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    assert "background save of" in done.stderr and "ckpt.pt" in done.stderr
    assert not (tmp_path / "ckpt.pt").exists()
