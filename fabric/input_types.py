"""Named types of what a user passes to ``Fabric(...)`` (and so to the ``Connector``).

They document the accepted forms for a type checker; the ``Connector`` and ``fabric.callbacks`` still
check every value at runtime, and their error messages list the same forms. The classes are imported
for the type checker only (the aliases are strings at runtime), so importing this module imports no
torch and nothing of fabric.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeAlias

if TYPE_CHECKING:
    from fabric.accelerators import Accelerator
    from fabric.plugins.environments import ClusterEnvironment
    from fabric.plugins.io import CheckpointIO
    from fabric.plugins.precision import Precision
    from fabric.strategies.strategy import Strategy

__all__ = [
    "AcceleratorInput",
    "CallbacksInput",
    "DevicesInput",
    "LoggersInput",
    "MetricsLogger",
    "Plugin",
    "PluginInput",
    "PrecisionInput",
    "StrategyInput",
]

# The names spelled out for readers and editors; a plain ``str``/``int`` stays accepted (the check is at
# runtime, and a name read from a command line or a config file is typed ``str``). The names are those of
# ``fabric._core.names`` (ACCELERATOR_CHOICES, PRECISION_VALUES and PRECISION_ALIASES).
AcceleratorInput: TypeAlias = "Literal['auto', 'cpu', 'cuda', 'gpu', 'mps'] | str | Accelerator"
StrategyInput: TypeAlias = "str | Strategy"
#: a count per node, -1 or "auto" (all), indices as a list/tuple, or a string of either ("2", "0,1", "[0, 1]")
DevicesInput: TypeAlias = "int | str | list[int] | tuple[int, ...]"
PrecisionInput: TypeAlias = (
    "Literal['64-true', '32-true', '16-mixed', 'bf16-mixed', '16-true', 'bf16-true', '64', '32', '16', 'bf16']"
    " | Literal[64, 32, 16] | int | str | None"
)

#: one plugin: each kind may be given at most once
Plugin: TypeAlias = "Precision | CheckpointIO | ClusterEnvironment"
#: one plugin, a list or tuple of them, or None (Sequence: a ``list[MixedPrecision]`` is accepted too)
PluginInput: TypeAlias = "Plugin | Sequence[Plugin] | None"


class MetricsLogger(Protocol):
    """What ``Fabric(loggers=...)`` accepts: anything with ``log_metrics``, e.g. ``fabric.loggers.Logger``."""

    # (*args: Any, **kwargs: Any) matches every signature, as the runtime check (a callable attribute) does
    def log_metrics(self, *args: Any, **kwargs: Any) -> Any: ...


#: one logger, a list or tuple of them, or None
LoggersInput: TypeAlias = "MetricsLogger | Sequence[MetricsLogger] | None"
#: any object whose methods are hooks (``fabric.call`` finds them by name), a list or tuple of them, or None
CallbacksInput: TypeAlias = "object | list[Any] | tuple[Any, ...] | None"
