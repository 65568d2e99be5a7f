"""Tensors at the edge of a collective: on the device the process group serves.

NCCL accepts only tensors on the rank's GPU; gloo accepts CPU tensors (and CUDA ones). So every tensor
fabric's own code hands to a collective goes through :func:`on_collective_device` first, or, for many
tensors at once, through :func:`broadcast_tensors`, which also packs them into a few large messages
instead of one collective per tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

# one broadcast carries up to this many bytes (DDP's own start-up broadcast uses buckets of this order)
BUCKET_BYTES = 256 * 1024 * 1024


def on_collective_device(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor`` on ``device`` (the same tensor when it is already there)."""
    return tensor if tensor.device == device else tensor.to(device)


def broadcast_tensors(
    tensors: Sequence[Tensor], device: torch.device, src: int, group: Any = None, bucket_bytes: int = BUCKET_BYTES
) -> int:
    """Overwrite ``tensors`` on every rank with rank ``src``'s values, wherever each tensor lives.

    Tensors of one dtype are packed into flat buffers on ``device`` of at most ``bucket_bytes`` (a
    tensor larger than that travels alone), each buffer is broadcast once, and the values are copied
    back into the original tensors. Only one buffer exists at a time, so a model made in host memory
    never needs room for all of itself on the device. Returns the number of broadcasts issued.
    """
    import torch.distributed as dist

    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for tensor in tensors:
        if tensor.numel():
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
    count = 0
    with torch.no_grad():
        for bucket in _buckets(by_dtype, bucket_bytes):
            flat = torch.cat([t.detach().reshape(-1).to(device) for t in bucket])
            wire = flat.view(torch.uint8) if flat.dtype == torch.bool else flat  # not every backend carries bool
            dist.broadcast(wire, src=src, group=group)
            count += 1
            offset = 0
            for tensor in bucket:
                tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()
    return count


def _buckets(by_dtype: dict[torch.dtype, list[Tensor]], bucket_bytes: int) -> list[list[Tensor]]:
    buckets: list[list[Tensor]] = []
    for group in by_dtype.values():
        current: list[Tensor] = []
        size = 0
        for tensor in group:
            nbytes = tensor.numel() * tensor.element_size()
            if current and size + nbytes > bucket_bytes:
                buckets.append(current)
                current, size = [], 0
            current.append(tensor)
            size += nbytes
        if current:
            buckets.append(current)
    return buckets
