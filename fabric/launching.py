"""What ``Fabric.launch`` checks before it starts anything, so a wrong call fails before a process exists."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

from fabric.strategies.strategy import Strategy


def check_launch_request(strategy: Strategy, function: Callable[..., Any]) -> None:
    """Raise for a ``launch(function)`` this strategy cannot run as asked (``do_nothing``: no function given)."""
    if not callable(function):
        raise TypeError(
            f"launch(function=...) takes a callable, got {function!r} ({type(function).__name__});"
            " pass the function itself, launch(train), not launch(train()), or leave it out"
        )
    launcher = strategy.launcher
    if launcher is None:
        return
    if function is do_nothing and launcher.requires_function:
        raise TypeError(
            f"The {type(strategy).__name__} with start method {strategy.start_method!r}"
            " starts new processes that need a function to run: call fabric.launch(function, *args)"
        )
    if not launcher.is_interactive_compatible and in_interactive_session():
        raise RuntimeError(
            f"{type(strategy).__name__} cannot be launched from an interactive session (notebook, REPL);"
            " use strategy='ddp_notebook' (fork) or run the code as a script"
        )


def check_takes_fabric(function: Callable[..., Any]) -> None:
    """Refuse a ``launch(function)`` whose function takes no argument: every process passes it the ``Fabric``."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):  # a callable without a signature to read (some builtins): let the call decide
        return
    if not parameters:
        name = getattr(function, "__qualname__", repr(function))
        raise TypeError(
            f"launch(function=...) calls function(fabric, *args, **kwargs), but {name}() takes no argument;"
            " give it a first parameter for the Fabric, e.g. def train(fabric): ..."
        )


def in_interactive_session() -> bool:
    """A REPL or notebook, where the user's code lives in the session and no process could import it again.

    Python's REPL and every IPython shell (the terminal one and Jupyter's kernels) set ``sys.ps1``;
    ``python -i script.py`` sets ``sys.flags.interactive`` before its REPL starts. A ``__main__`` without
    ``__file__`` alone is no sign: ``python -c`` and the workers of pytest-xdist (execnet runs
    ``python -c "exec(...)"``) have one and launch functions from importable modules. What such a
    program cannot do is refused by the launcher that needs it, naming the reason: the popen launcher
    when there is no script to run again, spawn/forkserver when the function is defined in that
    ``__main__``.
    """
    return hasattr(sys, "ps1") or bool(sys.flags.interactive)


def do_nothing(*args: Any, **kwargs: Any) -> None:
    """``launch``'s default function: each process only gets set up (popen: the script goes on)."""
    return
