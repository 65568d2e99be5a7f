"""The accelerator contract: which devices exist, how a user's ``devices=`` names them, and device set-up."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class Accelerator(ABC):
    """Knows one kind of hardware. It knows nothing of processes: strategies decide who uses which device."""

    name: str = ""

    @abstractmethod
    def setup_device(self, device: torch.device) -> None:
        """Make ``device`` the current device of this process."""

    def teardown(self) -> None:
        """Release what ``setup_device`` took."""

    @staticmethod
    @abstractmethod
    def parse_devices(devices: Any) -> Any:
        """Check a user's ``devices=`` value and return it in this accelerator's canonical form."""

    @staticmethod
    @abstractmethod
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        """The ``torch.device`` of each process, from the parsed ``devices``."""

    @staticmethod
    @abstractmethod
    def auto_device_count() -> int:
        """How many devices ``devices="auto"`` means."""

    @staticmethod
    @abstractmethod
    def is_available() -> bool:
        """Whether this hardware can be used in this process."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
