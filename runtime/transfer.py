"""Host-to-device copies that do not stall the step.

``torch.tensor(data, device="cuda")`` and ``.to("cuda")`` from pageable memory copy synchronously: the host waits
for everything queued on the stream (a decode step's whole forward pass) before the copy. Through pinned memory
with ``non_blocking`` the copy is queued like a kernel; the caching host allocator keeps the pinned block until the
copy has run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (a CPU tensor) on ``device``, queued without waiting when ``device`` is a GPU."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def tensor_on(data: Sequence, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype)`` on ``device``, through ``to_device``."""
    return to_device(torch.tensor(data, dtype=dtype), device)
