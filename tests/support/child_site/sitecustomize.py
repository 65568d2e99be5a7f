"""Loaded by every Python process the tests start (this folder is on their PYTHONPATH).

It installs the collective device guard (support/device_guard.py) and, where the test asked for warm ranks,
hands the process's program over to a warm worker (support/warm_ranks.py).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
try:
    import device_guard

    if os.environ.get("TEST_WARM_RANKS", "0") != "0":
        import warm_ranks
    else:
        warm_ranks = None
finally:
    del sys.path[0]

device_guard.install()
if warm_ranks is not None:
    warm_ranks.hand_over()
