"""Property test: ``Fabric.all_reduce`` in 2 real processes agrees with NumPy on random nested inputs.

Starting 2 processes per example would cost seconds each, so the examples are drawn first, in this
process, by Hypothesis (``derandomize=True``: a fixed seed, the same examples on every run), and then
all of them go through ONE 2-process spawn job, which all-reduces rank r's half of each example with
every reduce op and returns the results. The test compares each result with NumPy computing the same
reduction on both halves. (No shrinking across processes: a failure names the example instead.)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from fabric import Fabric
from support.environment import isolate
from support.scripts.ddp import checks

NUM_EXAMPLES = 60


class Pair:
    """One leaf of an example: rank 0's value and rank 1's value, of the same kind and shape."""

    def __init__(self, values: tuple[Any, Any]) -> None:
        self.values = values

    def __repr__(self) -> str:
        return f"Pair{self.values!r}"


_ints = st.integers(min_value=-(10**6), max_value=10**6)
# float32-representable values, so a Python float becomes a float32 tensor without rounding
_floats = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, width=32)


@st.composite
def _leaf(draw: Any) -> Pair:
    kind = draw(st.sampled_from(["int", "float", "bool", "tensor"]))
    if kind == "int":
        return Pair((draw(_ints), draw(_ints)))
    if kind == "float":
        return Pair((draw(_floats), draw(_floats)))
    if kind == "bool":
        return Pair((draw(st.booleans()), draw(st.booleans())))
    dtype = draw(st.sampled_from([torch.int64, torch.int32, torch.float32, torch.float64, torch.bool]))
    shape = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    size = int(np.prod(shape)) if shape else 1
    elements = st.booleans() if dtype == torch.bool else (_floats if dtype.is_floating_point else _ints)
    halves = [torch.tensor(draw(st.lists(elements, min_size=size, max_size=size)), dtype=dtype).reshape(shape) for _ in range(2)]
    return Pair((halves[0], halves[1]))


_keys = st.text(alphabet="abcxyz", min_size=1, max_size=3)
pair_trees = st.recursive(
    _leaf(),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.tuples(children, children),
        st.dictionaries(_keys, children, max_size=3),
    ),
    max_leaves=6,
)


def half(tree: Any, rank: int) -> Any:
    """Rank ``rank``'s input: the tree with every Pair replaced by that rank's value."""
    if isinstance(tree, Pair):
        return tree.values[rank]
    if isinstance(tree, dict):
        return {key: half(value, rank) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(half(value, rank) for value in tree)
    raise TypeError(tree)


def draw_examples(n: int) -> list[Any]:
    """``n`` examples, the same ones on every run (Hypothesis with a fixed seed, nothing from a database)."""
    examples: list[Any] = []

    @settings(max_examples=n, derandomize=True, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), deadline=None)
    @given(pair_trees)
    def collect(tree: Any) -> None:
        examples.append(tree)

    collect()
    return examples


def _as_array(value: Any) -> np.ndarray:
    """How the facade turns a rank's value into a tensor (Python floats become float32, torch's default)."""
    if isinstance(value, torch.Tensor):
        return value.numpy()
    if isinstance(value, bool):
        return np.array(value)
    if isinstance(value, int):
        return np.array(value, dtype=np.int64)
    return np.array(value, dtype=np.float32)


def expected(pair: Pair, op: str) -> np.ndarray:
    a, b = (_as_array(v) for v in pair.values)
    if op == "max":
        return np.maximum(a, b)
    if op == "min":
        return np.minimum(a, b)
    if a.dtype == np.bool_:  # booleans are counted
        a, b = a.astype(np.int64), b.astype(np.int64)
    total = a + b
    if op == "sum":
        return total
    if not np.issubdtype(total.dtype, np.floating):
        total = total.astype(np.float32)  # an integer mean is a float (torch's default dtype)
    return total / total.dtype.type(2)


def compare(tree: Any, result: Any, op: str, where: str = "") -> None:
    if isinstance(tree, Pair):
        want = expected(tree, op)
        assert isinstance(result, torch.Tensor), f"{where}: {result!r}"
        got = result.numpy()
        assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} != {want.dtype} for {tree!r} ({op})"
        np.testing.assert_array_equal(got, want, err_msg=f"{where}: {tree!r} ({op})")
        return
    assert type(result) is type(tree), f"{where}: {type(result).__name__} != {type(tree).__name__}"
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    assert len(result) == len(tree)
    for key, value in items:
        compare(value, result[key], op, f"{where}[{key!r}]")


@pytest.fixture(scope="module")
def reduced():
    examples = draw_examples(NUM_EXAMPLES)
    with pytest.MonkeyPatch.context() as mp:
        isolate(mp)
        fabric = Fabric(accelerator="cpu", strategy="ddp_spawn", devices=2)
        results = fabric.launch(checks.property_job, [(half(t, 0), half(t, 1)) for t in examples])
    return examples, results


def test_examples_are_fixed_and_varied():
    first, second = draw_examples(NUM_EXAMPLES), draw_examples(NUM_EXAMPLES)
    assert repr(first) == repr(second)
    text = repr(first)
    assert all(word in text for word in ("{", "[", "(", "tensor", "True", "."))


@pytest.mark.procs
@pytest.mark.timeout(120)
@pytest.mark.parametrize("op", checks.REDUCE_OPS)
def test_all_reduce_matches_numpy(reduced, op):
    examples, results = reduced
    assert len(results[op]) == len(examples)
    for index, (tree, result) in enumerate(zip(examples, results[op])):
        compare(tree, result, op, where=f"example {index}")
