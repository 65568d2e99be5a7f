"""Warning categories with Lightning Fabric's names, so filters written for them keep working."""

from __future__ import annotations

import warnings


class PossibleUserWarning(UserWarning):
    """A warning about something that is often, but not always, a mistake (silence it once you know)."""


def disable_possible_user_warnings(module: str = "") -> None:
    """Ignore ``PossibleUserWarning`` from ``module`` (a module name prefix; default: from everywhere)."""
    warnings.filterwarnings("ignore", category=PossibleUserWarning, module=module)


__all__ = ["PossibleUserWarning", "disable_possible_user_warnings"]
