"""The one way a test gets at a job script: its path, or the script imported as a module."""

from __future__ import annotations

import importlib
import importlib.util
import sys
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


def load_file(path: Path, name: str) -> ModuleType:
    """Import the Python file ``path`` (a benchmark or a tool outside the package) as the module ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
