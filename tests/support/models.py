"""Small models for checkpoint tests: a two-layer net and an optimizer that has stepped once, so it has state."""

from __future__ import annotations

import torch
from torch import nn


def stepped_pair(
    seed: int, widths: tuple[int, int, int] = (64, 512, 8), optimizer_class: type[torch.optim.Optimizer] = torch.optim.Adam
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``Linear(widths[0], widths[1]), ReLU, Linear(widths[1], widths[2])`` and its optimizer after one step.

    With the default widths the first weight (128 KiB) is over ``integrity.SMALL_ARCHIVE`` and the rest under,
    so a folder's items take both read paths (straight into the new storage, or through ``torch.load``).
    """
    torch.manual_seed(seed)
    inputs, hidden, outputs = widths
    model = nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, outputs))
    optimizer = optimizer_class(model.parameters(), lr=0.1)
    model(torch.randn(4, inputs)).sum().backward()
    optimizer.step()
    return model, optimizer
