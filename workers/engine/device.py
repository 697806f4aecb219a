"""Host data to the device without waiting for the GPU."""

from __future__ import annotations

from typing import Any

import torch


def to_device(data: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``data`` (nested lists of numbers) as a tensor on ``device``, copied without a sync.

    ``torch.tensor(data, device="cuda")`` copies from pageable memory and waits for the stream:
    in the middle of a step, that stalls the host until the GPU has run everything queued so far.
    On CUDA the data goes through pinned memory (PyTorch's caching host allocator keeps the block
    until the copy is done) and a non-blocking copy instead.
    """
    if device.type == "cpu":
        return torch.tensor(data, dtype=dtype)
    host = torch.tensor(data, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)
