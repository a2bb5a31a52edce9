"""The AMX tile product over weights packed in pairs of K (runtime/models/csrc/bf16_tiles.cpp), and the rules that
decide, from what a first start measured, which way serves a product of each size (bf16_layout.decide).

The tiling is checked everywhere through its emulation (the same code over eight tiles in memory, with the
instruction's shape checks); on a CPU with AMX, the instructions themselves."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixserve.runtime.cpu_ext import load_kernels
from radixserve.runtime.models import bf16_kernels, bf16_layout

packed_ops = bf16_kernels.packed_ops
needs_pairs = pytest.mark.skipif(packed_ops() is None, reason="no AVX-512 BF16: nothing packs in pairs of K")
NONE = torch.empty(0, dtype=torch.bfloat16)


def _tiles():  # noqa: ANN202 - the compiled module
    return load_kernels().bf16_tiles


def _emulated(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor, gated: bool) -> torch.Tensor:
    return _tiles().emulated(x, packed, bias, gated)


@needs_pairs
def test_the_tiling_agrees_with_f_linear() -> None:
    """Units of two blocks and of one, chunks of 1-45 rows (one tile of rows, two, a partial second), a bias or none,
    gated to the bit; and x in two passes (more than ~1 MB of it: K = 2,048, 300 rows). The check that a start runs
    on the real tiles fails a product that is wrong in one unit."""
    assert bf16_kernels.agrees_with_f_linear(packed_ops(), _emulated)

    def off_in_one_unit(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor, gated: bool) -> torch.Tensor:
        y = _emulated(x, packed, bias, gated)
        y[:, 160:] *= 1.5  # the last unit: one block
        return y

    assert not bf16_kernels.agrees_with_f_linear(packed_ops(), off_in_one_unit)
    gen = torch.Generator().manual_seed(2)
    w, b = torch.randn(48, 2048, generator=gen).to(torch.bfloat16), torch.randn(48, generator=gen).to(torch.bfloat16)
    x = torch.randn(300, 2048, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        want = F.linear(x.float(), w.float(), b.float())
        got = _emulated(x, packed_ops().pack([w]), b, False).float()
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


@needs_pairs
def test_packed_products_run_on_the_tiles_from_the_row_count_set() -> None:
    """``use_from_rows`` sends bf16_packed's products (plain and gated, which the decode stack calls too) of that
    many rows or more to the tiles and leaves fewer on the pairs' kernel; on a CPU without AMX only the emulation
    can be set, and a row count under one is refused."""
    tiles, ops = _tiles(), packed_ops()
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(96, 64, generator=gen).to(torch.bfloat16), torch.randn(96, generator=gen).to(torch.bfloat16)
    packed, x = ops.pack([w]), torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        before = tiles.from_rows()  # never, or (with AMX) what a model loaded earlier in this process set
        try:
            tiles.use_from_rows(tiles.NEVER)
            kernel = [ops.linear(x, packed, b), ops.linear_silu_mul(x, packed, b)]
            emulated = [_emulated(x, packed, b, False), _emulated(x, packed, b, True)]
            tiles.use_from_rows(3, emulated=True)
            assert tiles.from_rows() == 3
            for rows, want in ((5, emulated), (3, [y[:3] for y in emulated]), (2, [y[:2] for y in kernel])):
                assert torch.equal(ops.linear(x[:rows], packed, b), want[0])
                assert torch.equal(ops.linear_silu_mul(x[:rows], packed, b), want[1])
            tiles.use_from_rows(tiles.NEVER)
            assert torch.equal(ops.linear(x, packed, b), kernel[0])
        finally:
            tiles.use_from_rows(before)
    with pytest.raises(RuntimeError, match="from at least one row"):
        tiles.use_from_rows(0, emulated=True)
    with pytest.raises(RuntimeError, match=r"bf16_tiles: packed \[N / 16, 16 K\]"):
        tiles.emulated(x[:, :32].contiguous(), packed, b)
    with pytest.raises(RuntimeError, match="bf16_packed: a gate/up weight has as many up blocks"):
        ops.linear_silu_mul(x, packed[:3].contiguous(), NONE)
    if bf16_kernels.tiles_ops() is None:
        with pytest.raises(RuntimeError, match="not usable here"):
            tiles.use_from_rows(3)
        assert tiles.from_rows() > 1 << 40


@pytest.mark.skipif(bf16_kernels.tiles_ops() is None, reason="no AMX tiles on this CPU")
def test_on_amx_the_tiles_give_the_emulated_product() -> None:
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(176, 128, generator=gen).to(torch.bfloat16)
    packed = packed_ops().pack([w])
    tiles = bf16_kernels.tiles_ops()
    for rows in (1, 16, 33, 300):
        x = torch.randn(rows, 128, generator=gen).to(torch.bfloat16)
        want = _emulated(x, packed, NONE, False).float()
        torch.testing.assert_close(tiles.linear(x, packed, NONE).float(), want, rtol=1e-2, atol=1e-2)


def _decode(**ways: tuple[float, float]) -> dict[str, dict[str, float]]:
    return {way: {"1": ms[0], "16": ms[1]} for way, ms in ways.items()}


def _many(**ways: tuple[float, float]) -> dict[str, dict[str, float]]:
    return {rows: {way: ms[i] for way, ms in ways.items()} for i, rows in enumerate(("256", "1024"))}


def test_each_way_serves_from_the_fewest_rows_where_it_was_faster() -> None:
    """The tiles serve from the first row count where they beat the pairs' kernel, unpacking from the first where it
    beat what served there otherwise; the pairs serve where, so served, they are faster at decode and their chunk is
    within ``CHUNK_SLACK`` of oneDNN's. Without tiles (no AMX), the kernel and unpacking only."""
    decode = _decode(pairs=(2.0, 6.0), tiles=(2.5, 3.0), onednn=(6.0, 8.0))
    many = _many(pairs=(5.0, 20.0), tiles=(3.0, 12.0), unpacked=(4.0, 10.0), onednn=(3.5, 9.5))
    found = bf16_layout.decide(decode, many)
    assert (found["tiles_from_rows"], found["unpack_from_rows"]) == (16, 1024)
    assert found["served_ms"] == {"1": 2.0, "16": 3.0, "256": 3.0, "1024": 10.0}
    assert found["chunk_ratio"] == pytest.approx(10.0 / 9.5) and found["pairs"]

    slow_chunk = _many(pairs=(5.0, 20.0), tiles=(3.0, 12.0), unpacked=(4.0, 13.0), onednn=(3.5, 10.0))
    found = bf16_layout.decide(decode, slow_chunk)  # 12 ms on the tiles: 1.2x oneDNN's
    assert found["unpack_from_rows"] == bf16_layout.NEVER and not found["pairs"]

    no_tiles = _many(pairs=(5.0, 20.0), unpacked=(4.0, 10.0), onednn=(3.5, 9.5))
    found = bf16_layout.decide(_decode(pairs=(2.0, 6.0), onednn=(6.0, 8.0)), no_tiles)
    assert (found["tiles_from_rows"], found["unpack_from_rows"]) == (bf16_layout.NEVER, 256)
    assert found["served_ms"] == {"1": 2.0, "16": 6.0, "256": 4.0, "1024": 10.0} and found["pairs"]

    slow_decode = _decode(pairs=(7.0, 9.0), onednn=(6.0, 8.0))
    assert not bf16_layout.decide(slow_decode, no_tiles)["pairs"]
