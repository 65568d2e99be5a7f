"""Names a user writes for accelerators and precisions, readable without torch.

The accelerator registry (``fabric.accelerators``) and the precision plugins use exactly these names;
``fabric run`` offers them as choices before any torch import.
"""

from __future__ import annotations

from typing import Any

from fabric._core.suggestions import did_you_mean

__all__ = ["ACCELERATOR_CHOICES", "ACCELERATOR_NAMES", "PRECISION_ALIASES", "PRECISION_VALUES", "normalize_precision"]

#: The accelerators of the registry, one class each.
ACCELERATOR_NAMES = ("cpu", "cuda", "mps")
#: What ``accelerator=`` accepts: the registry's names, "auto" (the best available) and "gpu" (CUDA or MPS).
#: (Spelled out, in alphabetical order after "auto", as messages list them.)
ACCELERATOR_CHOICES = ("auto", "cpu", "cuda", "gpu", "mps")

#: Short spellings (Lightning's) of the precisions below.
PRECISION_ALIASES: dict[Any, str] = {
    32: "32-true",
    "32": "32-true",
    64: "64-true",
    "64": "64-true",
    16: "16-mixed",
    "16": "16-mixed",
    "bf16": "bf16-mixed",
}
PRECISION_VALUES = ("32-true", "64-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")


def normalize_precision(precision: Any) -> str:
    """Map a user's ``precision=`` (including the short aliases) to one of ``PRECISION_VALUES``."""
    if precision is None:
        return "32-true"
    if isinstance(precision, bool):
        precision = str(precision)
    canonical = PRECISION_ALIASES.get(precision, precision)
    if canonical not in PRECISION_VALUES:
        accepted = ", ".join(repr(v) for v in (*PRECISION_VALUES, 32, 64, 16, "bf16"))
        close = did_you_mean(precision, (*PRECISION_VALUES, "bf16"))
        raise ValueError(f"precision={precision!r} is not supported; accepted: {accepted}{close}")
    return canonical
