"""``Fabric(callbacks=...)`` and ``fabric.call(hook_name, *args, **kwargs)``."""

from __future__ import annotations

from typing import Any

import pytest

from fabric import Fabric


class Recorder:
    def __init__(self, name: str, log: list[tuple[str, str, tuple, dict]]) -> None:
        self.name = name
        self.log = log

    def on_train_epoch_end(self, *args: Any, **kwargs: Any) -> str:
        self.log.append((self.name, "on_train_epoch_end", args, kwargs))
        return "ignored"


class OnlyStart:
    def __init__(self, log: list) -> None:
        self.log = log

    def on_train_start(self) -> None:
        self.log.append(("only_start", "on_train_start", (), {}))


def _fabric(callbacks: Any) -> Fabric:
    return Fabric(accelerator="cpu", devices=1, callbacks=callbacks)


@pytest.mark.timeout(10)
def test_call_reaches_every_callback_with_the_hook_in_order_with_arguments() -> None:
    log: list = []
    fabric = _fabric([Recorder("a", log), OnlyStart(log), Recorder("b", log)])
    assert fabric.call("on_train_epoch_end", 1, 2, results={"loss": 0.5}) is None
    assert log == [
        ("a", "on_train_epoch_end", (1, 2), {"results": {"loss": 0.5}}),
        ("b", "on_train_epoch_end", (1, 2), {"results": {"loss": 0.5}}),
    ]
    log.clear()
    fabric.call("on_train_start")
    assert log == [("only_start", "on_train_start", (), {})]


@pytest.mark.timeout(10)
def test_a_hook_no_callback_has_is_skipped() -> None:
    log: list = []
    fabric = _fabric([Recorder("a", log)])
    fabric.call("on_something_else", 1)
    assert log == []
    _fabric(None).call("on_train_start")  # no callbacks at all


@pytest.mark.timeout(10)
def test_a_non_callable_attribute_is_skipped_with_a_warning() -> None:
    class Broken:
        on_train_start = 3

    # as in Lightning Fabric: the other callbacks still run (see also test_dropin.py)
    with pytest.warns(UserWarning, match=r"Broken.on_train_start: it is not callable"):
        _fabric([Broken()]).call("on_train_start")


@pytest.mark.timeout(10)
def test_a_single_callback_and_plain_functions_in_objects() -> None:
    log: list = []
    single = Recorder("solo", log)
    fabric = _fabric(single)
    fabric.call("on_train_epoch_end", x=1)
    assert log == [("solo", "on_train_epoch_end", (), {"x": 1})]

    class Namespace:
        pass

    holder = Namespace()
    holder.on_validation_end = lambda value: log.append(("lambda", value))  # type: ignore[attr-defined]
    _fabric([holder]).call("on_validation_end", 42)
    assert log[-1] == ("lambda", 42)


@pytest.mark.timeout(10)
def test_an_exception_in_a_callback_propagates_and_stops_the_rest() -> None:
    log: list = []

    class Failing:
        def on_train_start(self) -> None:
            raise ValueError("callback failed")

    fabric = _fabric([Failing(), OnlyStart(log)])
    with pytest.raises(ValueError, match="callback failed"):
        fabric.call("on_train_start")
    assert log == []


@pytest.mark.timeout(10)
def test_setup_calls_on_after_setup() -> None:
    import torch

    seen: list = []

    class AfterSetup:
        def on_after_setup(self, fabric: Fabric, module: Any) -> None:
            seen.append((fabric, module))

    fabric = _fabric([AfterSetup()])
    model = fabric.setup(torch.nn.Linear(2, 2))
    assert seen == [(fabric, model)]
