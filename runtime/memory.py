"""How big the KV pool is: a share of the device's total memory, less what the weights and a reserve take.

    pool bytes = total memory x mem_fraction_static - weight bytes - reserve
    slots      = pool bytes // (KV bytes per token on every rank that shares this memory)

``total memory`` is the GPU's (``torch.cuda.mem_get_info``) or, on CPU, the machine's RAM (``MemTotal``, or the
cgroup's limit when lower). ``weight bytes`` are the loaded parameters plus any packed copy a fast path keeps (on
CPU with tensor parallelism, every rank's shard: they share the RAM). ``reserve`` is room for activations, the
front end and the grammar compiler: ``RESERVE_BYTES`` on CPU; on a single GPU it is measured, by a warm-up forward
pass at the largest prefill chunk (``activation_bytes``), plus a margin for the decode graphs. The default share
(``mem_fraction_static`` 0) is SGLang's 0.88 on a GPU and 0.5 on CPU, where the RAM is shared with the operating
system and everything else on the machine.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("radixserve.kv")

DEFAULT_FRACTION = {"cuda": 0.88, "cpu": 0.5}
RESERVE_BYTES = 1 << 30
# CUDA: beyond the measured activations, room for the decode graphs' memory pool and the sampler's logits.
GRAPH_MARGIN_BYTES = 512 << 20
# A pool larger than what the machine has free now would fail later, under load: it is cut to this share of it.
MAX_SHARE_OF_AVAILABLE = 0.9
GiB = float(1 << 30)


@dataclass(frozen=True)
class PoolSizing:
    total_bytes: int
    fraction: float
    weight_bytes: int
    reserve_bytes: int
    per_token_bytes: int  # on every rank sharing the memory together
    slots: int
    capped_by_available: bool = False

    def describe(self) -> str:
        """The formula with its exact inputs (bytes), then the same in GiB, for the log."""
        text = (
            f"({self.fraction:.2f} x {self.total_bytes} B total - {self.weight_bytes} B weights - "
            f"{self.reserve_bytes} B reserve) // {self.per_token_bytes} B per token = {self.slots} tokens "
            f"[{self.total_bytes / GiB:.2f} GiB total, {self.weight_bytes / GiB:.2f} GiB weights]"
        )
        return text + (" (cut to the memory available now)" if self.capped_by_available else "")


def total_memory_bytes(device: torch.device) -> int:
    """The device's memory: the GPU's total, or the machine's RAM (the cgroup's limit when it is lower)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    total = _meminfo("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return int(total)


def available_memory_bytes(device: torch.device) -> int:
    """Memory that could still be allocated on ``device`` (free GPU memory, or the OS's MemAvailable)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return int(_meminfo("MemAvailable") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def _meminfo(key: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_pool_fits(slots: int, per_token_bytes: int, device: torch.device) -> None:
    """A ``--max-total-tokens`` pool must fit in the memory available now (else the allocation fails with the
    allocator's own message, which names neither the flag nor the size)."""
    need, free = slots * per_token_bytes, available_memory_bytes(device)
    if need > free:
        raise ValueError(
            f"--max-total-tokens {slots} needs {need / GiB:.2f} GiB of KV cache and {free / GiB:.2f} GiB is "
            f"available: lower it (each token takes {per_token_bytes} B)"
        )


def size_pool(
    fraction: float, device: torch.device, weight_bytes: int, per_token_bytes: int, reserve_bytes: int = RESERVE_BYTES
) -> PoolSizing:
    """Slots for ``fraction`` of the device's memory (0: the default); at least one. ``reserve_bytes``: the
    activations' peak where it was measured (``activation_bytes``), else ``RESERVE_BYTES``."""
    fraction = fraction or DEFAULT_FRACTION.get(device.type, 0.5)
    total = total_memory_bytes(device)
    budget = int(total * fraction) - weight_bytes - reserve_bytes
    if budget < per_token_bytes:
        raise ValueError(
            f"--mem-fraction-static {fraction:.2f} of {total / GiB:.2f} GiB leaves no room for the KV cache after "
            f"{weight_bytes / GiB:.2f} GiB of weights and {reserve_bytes / GiB:.2f} GiB for activations: raise it, "
            "or give --max-total-tokens"
        )
    slots = budget // per_token_bytes
    ceiling = int(available_memory_bytes(device) * MAX_SHARE_OF_AVAILABLE) // per_token_bytes
    capped = slots > ceiling
    if capped:
        logger.warning(
            "--mem-fraction-static %.2f asks for %.2f GiB of KV cache, more than is free now: using %.2f GiB",
            fraction,
            slots * per_token_bytes / GiB,
            ceiling * per_token_bytes / GiB,
        )
        slots = max(1, ceiling)
    return PoolSizing(total, fraction, weight_bytes, reserve_bytes, per_token_bytes, slots, capped)


def activation_bytes(model: torch.nn.Module, make_backend: Callable[[], Any], pool_args: tuple, tokens: int) -> int:
    """CUDA: the memory a forward pass of ``tokens`` prompt tokens (the largest chunk a step computes) takes on
    top of the weights, measured by running one on a pool of that many slots (``pool_args``: ``KVPool``'s
    arguments after the slot count), plus its logits and ``GRAPH_MARGIN_BYTES`` for the decode graphs."""
    from radixserve.runtime.attention.base import ForwardContext
    from radixserve.runtime.kv_pool import KVPool
    from radixserve.runtime.step_layout import StepRow, lay_out

    device = pool_args[-1]
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # what the load left in the allocator's cache is not the activations'
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    pool = KVPool(tokens, *pool_args)
    pool_bytes = pool.nbytes
    input_ids, positions, meta = lay_out([StepRow([0] * tokens, 0, list(range(tokens)), False)], device)
    with torch.inference_mode():
        hidden = model(input_ids, positions, ForwardContext(meta, pool, make_backend()))
        model.compute_logits(hidden[-1:]).float()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base - pool_bytes
    del pool, hidden
    torch.cuda.empty_cache()
    return int(peak) + GRAPH_MARGIN_BYTES


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (shared tensors once), plus the packed copies of its layers."""
    seen: set[int] = set()
    total = 0
    for t in [*module.parameters(), *module.buffers()]:
        if t.device.type == "meta":  # a weight released for its packed copy, counted below
            continue
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.nbytes
    for m in module.modules():
        packed = getattr(m, "_packed", None)
        if isinstance(packed, torch.Tensor):
            total += packed.nbytes
    return total
