"""``fabric.utilities.load._lazy_load``: a checkpoint on a memory map, each tensor read from disk when first used.

How much of the file is read is measured where the kernel counts it: the resident pages of the file's mapping in
``/proc/self/smaps``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import io
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

from fabric.utilities.load import _lazy_load, _NotYetLoadedTensor

MiB = 2**20
needs_smaps = pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads the mapping's resident pages from /proc/self/smaps (Linux)")


def _resident_bytes(path: Path) -> int:
    """How much of ``path`` is mapped into this process and in memory (summed over its mappings)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and fields[0].replace("-", "").isalnum() and len(fields) >= 5:
            inside = line.endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(fields[1]) * 1024
    return total


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024), nn.BatchNorm1d(4))  # two 4 MiB weights


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    model = _model()
    path = tmp_path / "model.pt"
    torch.save(model.state_dict(), path)
    return path, model.state_dict()


@needs_smaps
def test_no_tensor_is_read_until_it_is_used(saved):
    path, expected = saved
    state = _lazy_load(path)
    assert _resident_bytes(path) < MiB  # nothing of the 8 MiB of weights
    assert state["0.weight"].sum().item() == pytest.approx(expected["0.weight"].sum().item())
    assert 4 * MiB <= _resident_bytes(path) < 5 * MiB  # that tensor's bytes only
    assert torch.equal(state["1.weight"], expected["1.weight"])
    assert _resident_bytes(path) >= 8 * MiB


def test_the_values_and_the_state_dict_metadata_are_the_saved_ones(saved):
    path, expected = saved
    state = _lazy_load(path)
    assert list(state) == list(expected)
    assert all(torch.equal(state[key], value) and state[key].dtype == value.dtype for key, value in expected.items())
    assert all(type(value) is torch.Tensor and value.device.type == "cpu" for value in state.values())
    assert state._metadata == expected._metadata  # BatchNorm's version, for load_state_dict
    model = _model()
    assert not model.load_state_dict(state).missing_keys  # as litgpt calls it: state = lazy_load(path)
    assert all(torch.equal(value, expected[key]) for key, value in model.state_dict().items())


@needs_smaps
def test_as_a_context_manager_the_map_is_released_on_exit(saved):
    path, expected = saved
    model = _model()
    with _lazy_load(path) as state:
        model.load_state_dict(state)
        assert _resident_bytes(path) >= 8 * MiB
    assert len(state) == 0
    gc.collect()
    assert _resident_bytes(path) == 0  # unmapped: the model holds copies of its own
    assert torch.equal(model[1].weight, expected["1.weight"])


def test_nested_checkpoints_parameters_and_assign(tmp_path):
    model = nn.Linear(3, 2)
    path = tmp_path / "checkpoint.pt"
    torch.save({"model": model.state_dict(), "step": 7, "scale": nn.Parameter(torch.ones(2))}, path)
    checkpoint = _lazy_load(path)
    assert type(checkpoint) is not dict and isinstance(checkpoint, dict) and checkpoint["step"] == 7
    assert isinstance(checkpoint["scale"], nn.Parameter)  # a saved Parameter stays one
    state = checkpoint.get("model", checkpoint)
    fresh = nn.Linear(3, 2)
    fresh.load_state_dict(state, assign=True)  # the model takes the tensors on the map (Lightning's placeholders cannot)
    assert isinstance(fresh.weight, nn.Parameter) and torch.equal(fresh.weight, model.weight)


def test_lightnings_placeholder_name_exists_and_nothing_is_one(saved):
    path, _ = saved
    value = _lazy_load(path)["0.weight"]
    assert not isinstance(value, _NotYetLoadedTensor) and not hasattr(value, "_load_tensor")


def test_saved_pickled_or_copied_it_is_a_dict_of_plain_tensors_again(saved, tmp_path):
    path, expected = saved
    state = _lazy_load(path)
    again = tmp_path / "again.pt"
    torch.save(state, again)
    reloaded = torch.load(again, weights_only=True)  # no class of ours in the file
    assert type(reloaded) is type(expected) and reloaded._metadata == expected._metadata
    assert torch.equal(reloaded["0.weight"], expected["0.weight"])
    assert type(pickle.loads(pickle.dumps(_lazy_load(again)))) is type(expected)
    assert type(copy.deepcopy(state)) is type(expected)
    plain = tmp_path / "plain.pt"
    torch.save({"a": torch.ones(2)}, plain)
    # a plain dict comes back an OrderedDict: weights_only refuses a dict subclass's only way through pickle
    resaved = torch.load(io.BytesIO(_saved_bytes(_lazy_load(plain))), weights_only=True)
    assert list(resaved) == ["a"] and torch.equal(resaved["a"], torch.ones(2))


def _saved_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_files_it_cannot_load(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"does not exist or is not a file"):
        _lazy_load(tmp_path / "missing.pt")
    with pytest.raises(FileNotFoundError, match=r"is not a file"):
        _lazy_load(tmp_path)
    legacy = tmp_path / "legacy.pt"
    torch.save({"a": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(RuntimeError, match=r"cannot be loaded lazily: it is no checkpoint in torch's zip format"):
        _lazy_load(legacy)
    pickled = tmp_path / "pickled.pt"
    torch.save({"args": argparse.Namespace(lr=0.1), "w": torch.ones(2)}, pickled)
    with pytest.raises(pickle.UnpicklingError, match=r"refused by default; if you trust the file, pass weights_only=False.*argparse.Namespace"):
        _lazy_load(pickled)
    assert _lazy_load(pickled, weights_only=False)["args"].lr == 0.1
