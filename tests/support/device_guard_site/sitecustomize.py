"""Loaded by every Python process the tests start (this folder is on their PYTHONPATH): see support/device_guard.py."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
try:
    import device_guard
finally:
    del sys.path[0]

device_guard.install()
