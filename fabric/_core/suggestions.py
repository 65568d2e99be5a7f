""""Did you mean ...?" for a misspelt name: the accepted name closest to what the user wrote.

Standard library only (``difflib``): the CLI checks its names before any torch import.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["did_you_mean"]


def did_you_mean(value: object, accepted: Iterable[object]) -> str:
    """``"; did you mean 'ddp'?"`` for the accepted name closest to ``value``, or ``""`` when none is close.

    Written to end a message that already names the bad value and lists the accepted ones.
    """
    names = {str(name).lower(): name for name in accepted}
    close = difflib.get_close_matches(str(value).strip().lower(), list(names), n=1, cutoff=0.6)
    return f"; did you mean {names[close[0]]!r}?" if close else ""
