"""How to install an optional part of fabric (an extra of the ``fabric-torch`` distribution), as it works today.

The distribution is not on the package index yet: from a checkout it is ``pip install -e '.[EXTRA]'``; the index
line is what it will be. One wording for every message that names an extra. Standard library only.
"""

from __future__ import annotations

__all__ = ["install_hint"]


def install_hint(extra: str) -> str:
    """``pip install 'fabric-torch[EXTRA]'`` with how to do it from a checkout, for an error message."""
    return f"pip install 'fabric-torch[{extra}]' (from a checkout of fabric: pip install -e '.[{extra}]')"
