"""Accelerators: availability, and how ``devices=`` is parsed (GPU parsing runs here without a GPU)."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fabric.accelerators import ACCELERATOR_REGISTRY, Accelerator, CPUAccelerator, CUDAAccelerator, MPSAccelerator
from fabric.accelerators.cpu import parse_cpu_cores
from fabric.accelerators.cuda import num_cuda_devices, parse_gpu_ids


def test_registry():
    assert ACCELERATOR_REGISTRY == {"cpu": CPUAccelerator, "cuda": CUDAAccelerator, "mps": MPSAccelerator}  # noqa: SIM300 - a registry, not a constant
    for cls in ACCELERATOR_REGISTRY.values():
        assert issubclass(cls, Accelerator)
        assert ACCELERATOR_REGISTRY[cls.name] is cls


# ---- CPU -------------------------------------------------------------------------------------------


def test_cpu_is_always_available():
    assert CPUAccelerator.is_available() is True
    assert CPUAccelerator.auto_device_count() == 1


@pytest.mark.parametrize(("devices", "expected"), [("auto", 1), (1, 1), (4, 4), ("3", 3), (" 2 ", 2)])
def test_cpu_devices(devices, expected):
    assert parse_cpu_cores(devices) == expected
    assert CPUAccelerator.parse_devices(devices) == expected
    assert CPUAccelerator.get_parallel_devices(expected) == [torch.device("cpu")] * expected


@pytest.mark.parametrize("devices", [0, -1, -2, "-1", "two", "", 2.0, True, False, None, [1], "0,1"])
def test_cpu_devices_invalid(devices):
    with pytest.raises(ValueError, match=re.escape(f"devices={devices!r} is not valid for the CPU accelerator")):
        parse_cpu_cores(devices)


def test_cpu_setup_device():
    CPUAccelerator().setup_device(torch.device("cpu"))
    with pytest.raises(ValueError, match="CPUAccelerator was given the device cuda:0"):
        CPUAccelerator().setup_device(torch.device("cuda", 0))


# ---- GPU ids (CUDA and MPS share the parser) ----------------------------------------------------------


@pytest.mark.parametrize(
    ("devices", "available", "expected"),
    [
        ("auto", 2, [0, 1]),
        ("auto", 1, [0]),
        (-1, 3, [0, 1, 2]),
        ("-1", 2, [0, 1]),
        (1, 2, [0]),
        (2, 2, [0, 1]),
        ("2", 4, [0, 1]),
        ("0,1", 2, [0, 1]),
        ("1,", 2, [1]),
        (" 1 , 3 ", 4, [1, 3]),
        ("3,0", 4, [3, 0]),
        ([0, 1], 2, [0, 1]),
        ([1], 2, [1]),
        ((2, 0), 3, [2, 0]),
    ],
)
def test_gpu_ids(devices, available, expected):
    assert parse_gpu_ids(devices, available, "cuda") == expected


@pytest.mark.parametrize("devices", [0, -2, "0", "-2", "two", "", ",", "a,b", "0,-1", [], [-1], [0.5], [True], True, None, 1.0, {0}])
def test_gpu_ids_invalid(devices):
    with pytest.raises(ValueError, match="CUDA accelerator") as info:
        parse_gpu_ids(devices, 4, "cuda")
    message = str(info.value)
    assert f"devices={devices!r}" in message and "CUDA accelerator" in message
    for accepted in ("'auto'", "-1", "a positive int", "'0,1'", "[0, 1]"):
        assert accepted in message


@pytest.mark.parametrize("devices", [[0, 0], "1,1", (2, 1, 2)])
def test_gpu_ids_duplicates(devices):
    with pytest.raises(ValueError, match=re.escape(f"devices={devices!r} names a device more than once")):
        parse_gpu_ids(devices, 4, "cuda")


@pytest.mark.parametrize(("devices", "missing"), [(3, [2]), ([0, 5], [5]), ("1,2", [2]), ("4", [2, 3])])
def test_gpu_ids_out_of_range(devices, missing):
    with pytest.raises(RuntimeError) as info:
        parse_gpu_ids(devices, 2, "cuda")
    message = str(info.value)
    assert f"devices={devices!r}" in message
    assert f"CUDA device(s) {missing}" in message
    assert "only 2 (indices 0..1) are available" in message


@pytest.mark.parametrize("devices", ["auto", -1, "-1", 1, [0]])
def test_gpu_ids_without_any_gpu(devices):
    with pytest.raises(RuntimeError, match=re.escape(f"devices={devices!r}")) as info:
        parse_gpu_ids(devices, 0, "mps")
    assert "MPS" in str(info.value) and "none is available" in str(info.value)


@given(available=st.integers(1, 16), data=st.data())
def test_gpu_id_lists_within_range_are_kept(available, data):
    ids = data.draw(st.lists(st.integers(0, available - 1), min_size=1, max_size=available, unique=True))
    assert parse_gpu_ids(ids, available, "cuda") == ids
    # a trailing comma marks indices even for one id ("1" alone would mean "one GPU")
    assert parse_gpu_ids(",".join(map(str, ids)) + ",", available, "cuda") == ids


@given(available=st.integers(0, 8), extra=st.integers(0, 8))
def test_gpu_id_beyond_the_available_ones_is_refused(available, extra):
    with pytest.raises(RuntimeError, match=re.escape(f"[{available + extra}]")):
        parse_gpu_ids([available + extra], available, "cuda")


def test_gpu_parallel_devices():
    assert CUDAAccelerator.get_parallel_devices([0, 2]) == [torch.device("cuda", 0), torch.device("cuda", 2)]
    assert MPSAccelerator.get_parallel_devices([0]) == [torch.device("mps", 0)]


# ---- availability on this machine ---------------------------------------------------------------


def test_cuda_availability_matches_torch():
    assert CUDAAccelerator.is_available() == (torch.cuda.device_count() > 0)
    assert num_cuda_devices() == (torch.cuda.device_count() if torch.backends.cuda.is_built() else 0)
    assert CUDAAccelerator.auto_device_count() == num_cuda_devices()


def test_cuda_parse_uses_the_real_count():
    if CUDAAccelerator.is_available():
        assert CUDAAccelerator.parse_devices(1) == [0]
    else:
        with pytest.raises(RuntimeError, match="CUDA"):
            CUDAAccelerator.parse_devices(1)


def test_mps_availability():
    available = MPSAccelerator.is_available()
    assert isinstance(available, bool)
    assert MPSAccelerator.auto_device_count() == (1 if available else 0)
    if not torch.backends.mps.is_available():
        assert available is False


def test_gpu_setup_device_rejects_other_device_types():
    with pytest.raises(ValueError, match="CUDAAccelerator was given the device cpu"):
        CUDAAccelerator().setup_device(torch.device("cpu"))
    with pytest.raises(ValueError, match="MPSAccelerator was given the device cpu"):
        MPSAccelerator().setup_device(torch.device("cpu"))


def test_repr():
    assert repr(CPUAccelerator()) == "CPUAccelerator()"
