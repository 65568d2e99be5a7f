"""The one way a test gets at a job script: its path, or the script imported as a module."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

from support import SCRIPTS


def script_path(topic: str, name: str) -> Path:
    """``support/scripts/<topic>/<name>`` (``name`` with its suffix: ``.py``, ``.txt``, ...)."""
    path = SCRIPTS / topic / name
    if not path.exists():
        raise FileNotFoundError(f"no job script {name!r} in {path.parent}")
    return path


def load_script(topic: str, name: str) -> ModuleType:
    """Import ``support/scripts/<topic>/<name>.py`` by its package name, as spawned workers and pickles see it."""
    return importlib.import_module(f"support.scripts.{topic}.{name}")
