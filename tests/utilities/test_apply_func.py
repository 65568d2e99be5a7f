"""Moving whole batches: any nesting keeps its types and values; only tensors (and ``.to``-ables) move."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, defaultdict, namedtuple
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric import Fabric
from fabric.strategies.single_device import SingleDeviceStrategy
from fabric.utilities.apply_func import convert_tensors_to_scalars, convert_to_tensors, move_data_to_device

Pair = namedtuple("Pair", ["first", "second"])


@dataclasses.dataclass
class Record:
    features: Any
    label: Any
    note: str = "n"


class Opaque:
    """A leaf that is neither a tensor nor a container: must come back as the very same object."""

    def __repr__(self) -> str:
        return "Opaque()"


class MovesItself:
    """A batch object with its own ``.to`` (like a tokenizer's BatchEncoding)."""

    def __init__(self, tensor):
        self.tensor = tensor

    def to(self, device):
        return MovesItself(self.tensor.to(device))


_tensors = st.builds(
    lambda shape, dtype: torch.zeros(shape, dtype=dtype).uniform_() if dtype.is_floating_point else torch.ones(shape, dtype=dtype),
    st.lists(st.integers(0, 3), max_size=3).map(tuple),
    st.sampled_from([torch.float32, torch.float64, torch.int64, torch.bool, torch.bfloat16]),
)
_leaves = st.one_of(
    _tensors,
    st.integers(),
    st.floats(allow_nan=False),
    st.text(max_size=5),
    st.none(),
    st.booleans(),
    st.just(Opaque()),
    st.just(np.arange(3)),
)
_batches = st.recursive(
    _leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=4), children, max_size=3),
        st.dictionaries(st.text(max_size=4), children, max_size=3).map(OrderedDict),
        st.builds(Pair, children, children),
        st.builds(Record, children, children),
    ),
    max_leaves=10,
)


def check_moved(original: Any, moved: Any, device: str) -> None:
    """``moved`` mirrors ``original``: same container types and order, tensors on ``device``, the rest identical."""
    if isinstance(original, torch.Tensor):
        assert isinstance(moved, torch.Tensor)
        assert moved.device.type == device and moved.dtype == original.dtype and moved.shape == original.shape
        if device == "cpu":
            assert torch.equal(moved, original)
        return
    assert type(moved) is type(original), (type(original), type(moved))
    if isinstance(original, dict):
        assert list(moved) == list(original)
        for key in original:
            check_moved(original[key], moved[key], device)
    elif isinstance(original, (list, tuple)):
        assert len(moved) == len(original)
        for a, b in zip(original, moved):
            check_moved(a, b, device)
    elif dataclasses.is_dataclass(original):
        for field in dataclasses.fields(original):
            check_moved(getattr(original, field.name), getattr(moved, field.name), device)
    else:
        assert moved is original  # ints, strings, None, numpy arrays, opaque objects: untouched


@settings(max_examples=150, deadline=None)
@given(batch=_batches, device=st.sampled_from(["cpu", "meta"]))
def test_move_data_to_device_keeps_structure(batch, device):
    check_moved(batch, move_data_to_device(batch, device), device)
    check_moved(batch, move_data_to_device(batch, torch.device(device)), device)


@settings(max_examples=60, deadline=None)
@given(batch=_batches)
def test_fabric_to_device_and_batch_to_device(batch):
    fabric = Fabric(accelerator="cpu", strategy=SingleDeviceStrategy(device="meta"))
    check_moved(batch, fabric.to_device(batch), "meta")
    check_moved(batch, fabric.batch_to_device(batch), "meta")


def test_tensors_already_on_the_device_are_not_copied():
    tensor = torch.ones(3)
    assert move_data_to_device(tensor, "cpu") is tensor
    assert move_data_to_device({"t": [tensor]}, torch.device("cpu"))["t"][0] is tensor


def test_objects_with_their_own_to_are_moved():
    moved = move_data_to_device({"encoding": MovesItself(torch.ones(2))}, "meta")
    assert isinstance(moved["encoding"], MovesItself) and moved["encoding"].tensor.device.type == "meta"


def test_in_place_to_returning_none_keeps_the_object():
    class InPlace:
        def __init__(self):
            self.device = "cpu"

        def to(self, device):
            self.device = str(device)

    obj = InPlace()
    assert move_data_to_device([obj], "meta")[0] is obj and obj.device == "meta"


def test_defaultdict_keeps_its_factory():
    batch = defaultdict(list, {"x": [torch.ones(1)]})
    moved = move_data_to_device(batch, "meta")
    assert type(moved) is defaultdict and moved.default_factory is list
    assert moved["x"][0].device.type == "meta"


def test_modules_and_classes_inside_a_batch_are_left_alone():
    layer = torch.nn.Linear(1, 1)
    moved = move_data_to_device({"layer": layer, "cls": torch.Tensor}, "meta")
    assert moved["layer"] is layer and layer.weight.device.type == "cpu"
    assert moved["cls"] is torch.Tensor


def test_convert_to_tensors():
    data = {"i": 3, "f": 1.5, "b": True, "np": np.float64(2.0), "arr": np.arange(3), "t": torch.ones(1), "s": "x"}
    out = convert_to_tensors(data, torch.device("cpu"))
    assert out["i"].dtype == torch.int64 and out["i"].item() == 3
    assert out["f"].dtype == torch.float32 and out["f"].item() == 1.5
    assert out["b"].dtype == torch.bool
    assert out["np"].item() == 2.0
    assert torch.equal(out["arr"], torch.arange(3))
    assert out["t"] is data["t"] and out["s"] == "x"


def test_convert_tensors_to_scalars():
    out = convert_tensors_to_scalars({"a": torch.tensor(1.5), "b": [torch.tensor([2])], "c": "x"})
    assert out == {"a": 1.5, "b": [2], "c": "x"}
    assert type(out["b"][0]) is int
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        convert_tensors_to_scalars(torch.ones(2))
