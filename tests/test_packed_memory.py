"""Where packed weights live (``csrc/huge_slabs.h``): back to back in 2 MB-aligned slabs, a slab unmapped once its
last weight is freed and new weights go elsewhere."""

from __future__ import annotations

import sys

import pytest
import torch

from radixserve.runtime.models import quant
from radixserve.runtime.models.quant import QTYPES

pytestmark = pytest.mark.skipif(
    quant.packed_ops() is None or not sys.platform.startswith("linux"), reason="packed kernel on Linux only"
)
Q8_0_BLOCK = 34  # bytes of 32 weights


def _mapping_of(address: int) -> tuple[int, int] | None:
    """The start and end of the mapping of this process that holds ``address`` (/proc/self/maps), or None."""
    with open("/proc/self/maps") as f:
        for line in f:
            start, end = (int(v, 16) for v in line.split()[0].split("-"))
            if start <= address < end:
                return start, end
    return None


def _packed_q8_0(n: int, k: int) -> torch.Tensor:
    blocks = torch.randint(0, 256, (n, k // 32 * Q8_0_BLOCK), dtype=torch.uint8)
    blocks.view(n, -1, Q8_0_BLOCK)[:, :, 1] = 0  # fp16 scales of modest size (the high byte's exponent bits)
    return quant.packed_ops().pack(blocks, QTYPES["Q8_0"], k)


def test_packed_weights_sit_back_to_back_on_2_mb_aligned_slabs() -> None:
    a, b = _packed_q8_0(64, 256), _packed_q8_0(48, 512)
    slab = _mapping_of(a.data_ptr())
    assert slab is not None and slab[0] % (2 << 20) == 0
    assert _mapping_of(b.data_ptr()) == slab  # the next weight in the same slab...
    assert b.data_ptr() - a.data_ptr() == -(-a.numel() // 64) * 64  # ...right after the first, on a cache line


def test_a_slab_is_unmapped_once_its_weights_are_freed_and_it_is_no_longer_filled() -> None:
    big = 16384 * 4096 // 32 * Q8_0_BLOCK  # 71 MB: more than a slab of 64 MB holds, so a slab of its own
    first = _packed_q8_0(16384, 4096)
    assert first.numel() == big
    start = _mapping_of(first.data_ptr())
    assert start is not None
    second = _packed_q8_0(16384, 4096)  # does not fit the rest of the first's slab: a new one
    assert _mapping_of(second.data_ptr()) != start
    address = first.data_ptr()
    del first
    assert _mapping_of(address) is None or _mapping_of(address) != start
    del second
