"""``LightningEnum``: a ``str`` Enum whose members equal their value in any letter case (``Mode.TRAIN == "Train"``).

It is lightning-utilities' ``StrEnum`` (a dependency of ours), the class Lightning Fabric exports under this name, so
enums written against Lightning behave the same here: ``from_str``/``try_from_str`` look a member up by name or value
ignoring case, and a member hashes like its value.
"""

from __future__ import annotations

from lightning_utilities.core.enums import StrEnum as LightningEnum

__all__ = ["LightningEnum"]
