"""CPU memory on transparent huge pages, for what a step streams from memory: the KV pool.

A decode step reads every running sequence's keys and values in every layer. On 4 KB pages that read takes a TLB
miss (a page walk) every 4 KB and the hardware prefetchers stop at each page boundary; on 2 MB pages neither
happens. 16 rows of SmolLM2's heads over 663 slots, 30 layers, 2-core Zen 4 (``bench/decode_attention.py``):
9.05-10.28 ms a step on 4 KB pages, 7.66-7.90 ms on huge pages (docs/benchmarks.md). Packed weights get the same
from the kernels' slabs (``huge_slabs.h``).

Linux lets a process ask for huge pages per range (``madvise(MADV_HUGEPAGE)``, honoured when
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``). Pages are still committed on first
touch, 2 MB at a time: a pool costs RAM as it fills, as on 4 KB pages, plus at most one partly used 2 MB page per
(layer, keys or values, KV head) region. Where the host backs a VM's memory on first use, a huge page the guest has
never used costs more to touch the first time (on the reference VM 0.9 GB/s against 4.5 for 4 KB pages, 20 once
reused): a fresh server pays it once per page as its pool first fills. ``RADIXSERVE_KV_HUGE_PAGES=0`` puts the pool
on ``torch.empty`` instead.
"""

from __future__ import annotations

import contextlib
import math
import mmap

import torch

HUGE_PAGE = 2 << 20


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor of ``shape`` starting on a 2 MB boundary of a private anonymous mapping advised
    for huge pages (ordinary pages where the kernel refuses the advice); ``torch.empty`` for less than one huge page
    or where ``mmap`` has no such advice. The mapping lives as long as the tensor (and its views)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    # One huge page more than needed, so that the tensor can start on a boundary whatever address mmap returns.
    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:  # no room to map it: torch's allocator tries, and fails with its own message naming the bytes
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # (holds the mapping: unmapped when the last view goes)
    start = -raw.data_ptr() % HUGE_PAGE
    with contextlib.suppress(OSError):  # a kernel without transparent huge pages: ordinary pages, nothing else changes
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    return raw[start : start + nbytes].view(dtype).view(shape)
