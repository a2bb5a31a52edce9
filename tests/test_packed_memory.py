"""Where packed weights live (``csrc/huge_slabs.h``): quantized and bfloat16 ones back to back in 2 MB-aligned slabs,
a slab unmapped once its last weight is freed and new weights go elsewhere, the slab new weights go to filled again
from its start once its weights are freed."""

from __future__ import annotations

import sys

import pytest
import torch

from radixserve.runtime.models import bf16_kernels, quant
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


def _packed_bf16(n: int, k: int) -> torch.Tensor:
    return bf16_kernels.packed_ops().pack([torch.randn(n, k).to(torch.bfloat16)], 1)


@pytest.mark.skipif(bf16_kernels.packed_ops() is None, reason="the bfloat16 pairs' kernel needs AVX-512 BF16")
def test_bf16_weights_packed_in_pairs_sit_on_the_slabs_too() -> None:
    a, b = _packed_bf16(64, 256), _packed_bf16(32, 512)
    assert a.dtype == torch.bfloat16 and a.shape == (4, 256 * 16)
    slab = _mapping_of(a.data_ptr())
    assert slab is not None and slab[0] % (2 << 20) == 0
    assert _mapping_of(b.data_ptr()) == slab and b.data_ptr() - a.data_ptr() == a.numel() * 2


@pytest.mark.skipif(bf16_kernels.packed_ops() is None, reason="the bfloat16 pairs' kernel needs AVX-512 BF16")
def test_the_slab_new_weights_go_to_is_filled_from_its_start_again_once_emptied() -> None:
    # What a start-up measurement packs and frees must not leave a hole that the model's weights then skip.
    whole = _packed_bf16(17408, 2048)  # 71 MB: a slab of its own, full, so the next weight opens a fresh one
    first = _packed_bf16(64, 256)
    address = first.data_ptr()
    assert _mapping_of(address) != _mapping_of(whole.data_ptr())
    del first
    again = _packed_bf16(64, 256)
    assert again.data_ptr() == address  # the fresh slab emptied: handed out from its start again
    kept = _packed_bf16(64, 256)
    assert kept.data_ptr() == address + again.numel() * 2  # ...and back to back while a weight lives in it
    del whole
