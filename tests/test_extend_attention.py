"""The compiled bfloat16 prefill-attention kernel against the same attention in plain PyTorch, alone and inside the
reference backend's step (decode rows, fresh chunks, chunks after a cached prefix, short chunks, windowed layers)."""

from __future__ import annotations

import functools

import pytest
import torch

from radixserve.runtime.attention import AttentionMetadata, AttnOptions, ExtendSeq, TorchReferenceBackend
from radixserve.runtime.attention.cpu_kernels import extend_attention_op, reference_extend_attention
from radixserve.runtime.cpu_ext import load_kernels
from radixserve.runtime.cpu_features import cpu_flags
from radixserve.runtime.kv_pool import KVPool


def _expected_op() -> bool:
    """Where the kernel must be in use: a build with AVX-512 BF16 and a CPU without AMX (with AMX, where it measured
    faster than SDPA: see test_with_amx_the_faster_of_the_kernel_and_sdpa_serves)."""
    module = load_kernels()
    return module is not None and module.extend_attention.available() and "amx_bf16" not in cpu_flags()


@pytest.fixture(scope="module")
def op():
    kernel = extend_attention_op()
    if kernel is None:
        assert not _expected_op(), "the prefill-attention kernel built but failed its self-check (see the log)"
        pytest.skip("no AVX-512 BF16, or AMX where SDPA measured faster: prefill attention stays on SDPA")
    return kernel


def _chunks(
    chunks: list[tuple[int, int]], n_slots: int, before: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot tables (scattered, one after another) and the (q_start, q_len, kv_len, offset) rows of ``chunks``
    [(q_len, kv_len)], their queries starting at row ``before``."""
    slots = torch.cat([torch.randperm(n_slots, generator=gen)[:kv_len] for _, kv_len in chunks])
    rows, q_start, offset = [], before, 0
    for q_len, kv_len in chunks:
        rows.append([q_start, q_len, kv_len, offset])
        q_start, offset = q_start + q_len, offset + kv_len
    return slots, torch.tensor(rows)


# (query heads, KV heads, head size, window): group sizes 1-16 (a task takes at most 8 query heads), every head
# size with code (64, 96, 128, 256), windows shorter than a key block, longer than one, and none.
SHAPES = [(9, 3, 64, 0), (32, 8, 64, 0), (8, 1, 64, 0), (8, 8, 128, 0), (12, 2, 128, 24), (9, 3, 64, 100)]
SHAPES += [(4, 4, 64, 1), (12, 4, 96, 0), (8, 4, 256, 30), (20, 2, 64, 0), (16, 1, 128, 0)]


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "window"), SHAPES)
@torch.inference_mode()
def test_kernel_equals_reference(op, heads: int, kv_heads: int, dim: int, window: int) -> None:
    """Chunks of lengths around the kernel's blocks (1, 15-17, 63-65, 300) with and without a cached prefix, in one
    call, against float32 attention over the same bfloat16 values: within bfloat16's rounding of the output and of
    the probabilities."""
    gen = torch.Generator().manual_seed(heads * dim + window)
    chunks = [(1, 1), (17, 17), (300, 300), (1, 700), (15, 80), (65, 65), (63, 640), (16, 16)]
    kv = (torch.randn(2, kv_heads, 900, dim, generator=gen) * 2).bfloat16()
    slots, seqs = _chunks(chunks, 900, 3, gen)
    q = (torch.randn(3 + sum(c[0] for c in chunks), heads, dim, generator=gen) * 2).bfloat16()
    out = op(q, kv, slots, seqs, dim**-0.5, window)
    want = reference_extend_attention(q, kv, slots, seqs, dim**-0.5, window)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out[3:].float(), want[3:], rtol=2e-2, atol=2e-2)
    # Mean error well under the tolerance: the bfloat16 rounding of the output (2^-9 relative) dominates it.
    assert (out[3:].float() - want[3:]).abs().mean() < 4e-3


@torch.inference_mode()
def test_kernel_refuses_what_would_read_outside_its_inputs(op) -> None:
    kv = torch.randn(2, 3, 50, 64).bfloat16()
    q = torch.randn(8, 9, 64).bfloat16()
    slots = torch.arange(8)
    with pytest.raises(RuntimeError, match="slot out of range"):
        op(q, kv, torch.tensor([0, 1, 2, 3, 4, 5, 6, 50]), torch.tensor([[0, 8, 8, 0]]), 0.125, 0)
    with pytest.raises(RuntimeError, match="out of range"):
        op(q, kv, slots, torch.tensor([[1, 8, 8, 0]]), 0.125, 0)  # queries past q
    with pytest.raises(RuntimeError, match="out of range"):
        op(q, kv, slots, torch.tensor([[0, 8, 9, 0]]), 0.125, 0)  # keys past the slot list
    with pytest.raises(RuntimeError, match="head_dim"):
        small = torch.randn(8, 9, 32).bfloat16(), torch.randn(2, 3, 50, 32).bfloat16()
        op(*small, slots, torch.tensor([[0, 8, 8, 0]]), 0.1, 0)
    with pytest.raises(RuntimeError, match="bfloat16"):
        op(q.float(), kv.float(), slots, torch.tensor([[0, 8, 8, 0]]), 0.125, 0)


@pytest.mark.parametrize("options", [AttnOptions(), AttnOptions(window=40, scale=0.1)])
@pytest.mark.parametrize("with_short", [True, False])
@torch.inference_mode()
def test_backend_step_on_the_kernel_equals_sdpa(op, options: AttnOptions, with_short: bool) -> None:
    """One step of two decode rows, a fresh 120-token chunk, a 90-token chunk after a 200-token cached prefix and
    maybe an 8-token chunk after a cached prefix (a short one, on the decode kernel): the backend with the kernels
    equals the PyTorch path (SDPA and masks), and the long chunks went to the prefill kernel in one call (a windowed
    layer takes it when every chunk of the step does)."""
    gen = torch.Generator().manual_seed(0)
    n_kv, heads, d, n_slots = 3, 9, 64, 1000
    pools = [KVPool(n_slots, 1, n_kv, d, torch.bfloat16, torch.device("cpu")) for _ in range(2)]
    keys, values = torch.randn(n_slots, n_kv, d, generator=gen), torch.randn(n_slots, n_kv, d, generator=gen)
    for pool in pools:
        pool.k[0].copy_(keys)
        pool.v[0].copy_(values)
    perm = torch.randperm(n_slots, generator=gen)
    decode = [perm[:50], perm[50:61]]
    fresh, prefixed, short = perm[61:181], perm[181:471], perm[471:571]
    out_slots = torch.cat([decode[0][-1:], decode[1][-1:], fresh, prefixed[-90:], short[-8:]])
    extends = (ExtendSeq(2, 120, 120, None), ExtendSeq(122, 90, 290, prefixed), ExtendSeq(212, 8, 100, short))
    if not with_short:
        out_slots, extends = out_slots[:-8], extends[:2]
    t = out_slots.numel()
    width = 50
    decode_slots = torch.stack([torch.cat([r, r[:1].expand(width - len(r))]) for r in decode])
    mask = (torch.arange(width)[None, :] < torch.tensor([50, 11])[:, None])[:, None, None, :]
    meta = AttentionMetadata(out_slots, 2, decode_slots, mask, extends)
    q = torch.randn(t, heads, d, generator=gen).bfloat16()
    k, v = torch.randn(t, n_kv, d, generator=gen).bfloat16(), torch.randn(t, n_kv, d, generator=gen).bfloat16()
    fast, plain = TorchReferenceBackend(cpu_kernels=True), TorchReferenceBackend(cpu_kernels=False)
    state = fast.prepare(meta, pools[0])
    assert state.kernel_extends is not None and state.kernel_extends[1][:, 1].tolist() == [120, 90]
    assert (state.kernel_extends[1].shape[0] == len(extends)) == (not with_short)
    got = fast.forward(0, q, k, v, meta, pools[0], state, options)
    want = plain.forward(0, q, k, v, meta, pools[1], None, options)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("window", [0, 40])
@torch.inference_mode()
def test_a_tokens_result_does_not_depend_on_its_chunk(op, window: int) -> None:
    """A 300-token prompt prefilled whole, or in chunks of 1, 37 and 262 tokens after what came before (read back
    from the pool), gives every token the same bits: key blocks sit at fixed positions and blocks past a query add
    exact zeros, whatever the chunk's length or the block of queries a token shares."""
    gen = torch.Generator().manual_seed(11)
    kv = torch.randn(2, 3, 400, 64, generator=gen).bfloat16()
    slots = torch.randperm(400, generator=gen)[:300]
    q = torch.randn(300, 9, 64, generator=gen).bfloat16()
    whole = op(q, kv, slots, torch.tensor([[0, 300, 300, 0]]), 0.125, window)
    pieces, start = [], 0
    for n in (1, 37, 262):
        chunk = q[start : start + n].contiguous()
        pieces.append(op(chunk, kv, slots, torch.tensor([[0, n, start + n, 0]]), 0.125, window))
        start += n
    assert torch.equal(torch.cat(pieces), whole)


def test_with_amx_the_fastest_of_the_kernels_and_sdpa_serves(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """On a CPU with AMX the first start times the kernel (and its form on AMX tiles, where they serve) against SDPA
    and keeps what it found beside the compiled kernels; the fastest serves, and a later start reads the file instead
    of timing again. The timing itself (small here) gives each chunk's medians for each."""
    from radixserve.runtime.attention import cpu_kernels
    from radixserve.runtime.threads import on_a_thread_of_its_own

    module = load_kernels()
    if module is None or not module.extend_attention.available():
        pytest.skip("no AVX-512 BF16 build: there is no kernel to time")
    kernel = module.extend_attention.extend_attention
    small = on_a_thread_of_its_own(
        lambda: cpu_kernels.prefill_timings(
            {"kernel": kernel}, heads=(4, 2, 64), chunks=((64, 64), (16, 80)), rounds=1
        ),
        2,
    )
    assert set(small) == {"kernel_ms", "sdpa_ms"}
    for path in ("kernel_ms", "sdpa_ms"):
        assert set(small[path]) == {"64/64", "16/80"} and all(ms > 0 for ms in small[path].values())

    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"avx512_bf16", "amx_bf16"}))
    timed: list[dict] = []
    monkeypatch.setattr(cpu_kernels, "prefill_timings", lambda ops: timed[-1])
    monkeypatch.setattr(cpu_kernels, "prefill_ops", lambda: {"kernel": kernel})  # (on any CPU: no tiles yet)
    try:
        timed.append({"kernel_ms": {"1024/1024": 10.0}, "sdpa_ms": {"1024/1024": 20.0}})
        cpu_kernels.extend_attention_op.cache_clear()
        assert cpu_kernels.extend_attention_op() is kernel
        timed.append({"kernel_ms": {"1024/1024": 20.0}, "sdpa_ms": {"1024/1024": 10.0}})
        cpu_kernels.extend_attention_op.cache_clear()
        assert cpu_kernels.extend_attention_op() is kernel  # the file: not timed again
        for kept in tmp_path.rglob(cpu_kernels.PREFILL_TIMINGS):
            kept.unlink()
        cpu_kernels.extend_attention_op.cache_clear()
        assert cpu_kernels.extend_attention_op() is None
        for kept in tmp_path.rglob(cpu_kernels.PREFILL_TIMINGS):
            kept.unlink()
        fastest = {"kernel_ms": {"1024/1024": 9.0}, "tiles_ms": {"1024/1024": 3.0}, "sdpa_ms": {"1024/1024": 6.0}}
        timed.append(fastest)  # with the tiles serving too, the fastest of the three
        monkeypatch.setattr(cpu_kernels, "prefill_ops", lambda: {"kernel": kernel, "tiles": reference_extend_attention})
        cpu_kernels.extend_attention_op.cache_clear()
        assert cpu_kernels.extend_attention_op() is reference_extend_attention
    finally:
        cpu_kernels.extend_attention_op.cache_clear()  # (decided again for this machine when next asked)


def test_the_tile_products_agree_with_the_reference() -> None:
    """``extend_attention_tiles`` (the kernel with its scores and weighted values on AMX tiles) passes the check a
    start runs, with the tiles emulated in memory on any CPU with AVX-512 BF16 and on the tile units with AMX; and it
    gives what the vdpbf16ps kernel gives on a longer chunk after a cached prefix, with a window and two slices of
    query heads."""
    from radixserve.runtime.attention import cpu_kernels

    module = load_kernels()
    if module is None or not module.extend_attention.available():
        pytest.skip("no AVX-512 BF16 build")
    tiles = module.extend_attention.extend_attention_tiles
    emulated = functools.partial(tiles, emulated=True)
    assert cpu_kernels._self_check_extend(emulated)
    gen = torch.Generator().manual_seed(6)
    kv = torch.randn(2, 2, 500, 64, generator=gen).bfloat16()
    q = torch.randn(150, 20, 64, generator=gen).bfloat16()
    slots, seqs = torch.randperm(500, generator=gen)[:400], torch.tensor([[0, 150, 400, 0]])
    want = module.extend_attention.extend_attention(q, kv, slots, seqs, 0.125, 100)
    torch.testing.assert_close(emulated(q, kv, slots, seqs, 0.125, 100), want, rtol=2e-2, atol=2e-2)
    if "tiles" in cpu_kernels.prefill_ops():  # AMX, built for it, allowed by Linux, passing its check
        torch.testing.assert_close(tiles(q, kv, slots, seqs, 0.125, 100), want, rtol=2e-2, atol=2e-2)
    elif not (module.extend_attention.tiles_available and "amx_bf16" in cpu_kernels.cpu_flags()):
        with pytest.raises(RuntimeError, match="AMX tiles are not usable here"):
            tiles(q, kv, slots, seqs, 0.125, 100)
