"""The CPU KV pool on memory advised for transparent huge pages (``runtime.huge_pages``), and its switch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from radixserve.runtime import huge_pages
from radixserve.runtime.kv_pool import KVPool

CPU = torch.device("cpu")


def _smaps_of(address: int) -> dict[str, str]:
    """The fields of the /proc/self/smaps entry of the mapping that holds ``address``."""
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):  # a mapping's first line: "start-end perms ..."
                start, end = (int(v, 16) for v in head[0].split("-"))
                inside = start <= address < end
            elif inside:
                fields[head[0].rstrip(":")] = " ".join(head[1:])
    return fields


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is Linux's")
def test_a_large_tensor_starts_on_a_huge_page_of_an_advised_mapping() -> None:
    t = huge_pages.empty((3, 1 << 20), torch.bfloat16)  # 6 MB
    assert t.shape == (3, 1 << 20) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    t.fill_(2.0)  # writable, and every byte of it is there
    assert float(t.float().sum()) == 2.0 * t.numel()
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    smaps = _smaps_of(t.data_ptr())
    if thp.is_file() and "[never]" not in thp.read_text() and "THPeligible" in smaps:  # (smaps says so since 4.15)
        assert smaps["THPeligible"] == "1"  # advised: the kernel may back it with 2 MB pages


def test_views_keep_the_mapping_alive() -> None:
    view = huge_pages.empty((1 << 20,), torch.float32)[7:9]  # the tensor itself is gone, a view of it is not
    view.copy_(torch.tensor([1.0, 2.0]))
    assert view.tolist() == [1.0, 2.0]


def test_small_tensors_are_ordinary_allocations() -> None:
    t = huge_pages.empty((16, 16), torch.float32)
    assert t.shape == (16, 16) and t.untyped_storage().nbytes() == 16 * 16 * 4


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is Linux's")
def test_the_cpu_kv_pool_is_on_huge_pages_unless_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = KVPool(8192, 2, 2, 64, torch.bfloat16, CPU)  # 8 MB
    assert pool.layers.data_ptr() % huge_pages.HUGE_PAGE == 0
    k, v = torch.ones(2, 2, 64, dtype=torch.bfloat16), torch.full((2, 2, 64), 3.0, dtype=torch.bfloat16)
    pool.store(1, torch.tensor([5, 8191]), k, v)
    assert pool.kv[1][0, :, 8191].eq(1).all() and pool.v[1][5].eq(3).all() and pool.kv[0].shape == (2, 2, 8192, 64)

    def refused(*args: object) -> torch.Tensor:
        raise AssertionError("RADIXSERVE_KV_HUGE_PAGES=0 allocates with torch.empty")

    monkeypatch.setattr(huge_pages, "empty", refused)
    monkeypatch.setenv("RADIXSERVE_KV_HUGE_PAGES", "0")
    assert KVPool(8192, 2, 2, 64, torch.bfloat16, CPU).layers.shape == (2, 2, 2, 8192, 64)


def test_a_mapping_that_cannot_be_made_fails_as_torch_empty_does() -> None:
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        huge_pages.empty((1 << 46,), torch.float32)  # 256 TiB: more than any address space will map
