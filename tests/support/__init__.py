"""What the tests share: where things are, a clean job environment, starting and watching processes.

``tests/`` is on ``sys.path`` (see ``tests/conftest.py``, and ``PYTHONPATH`` of every job that
``clean_env`` builds), so this package imports as ``support`` in the test process, in spawned workers
and in the job scripts under ``support/scripts/<topic>/``.
"""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
SCRIPTS = TESTS / "support" / "scripts"
PYTHON = sys.executable
