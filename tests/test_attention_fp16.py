"""Half-precision decode attention must not overflow where the scaled scores are in range, nor lose their precision.

q.k of two vectors with entries around 40 in 64 dimensions is ~1e5, past float16's largest value (65,504), while
the scaled score (q.k / 8) is ~1.3e4. A float16 q.k gives inf, then NaN out of the softmax; the scores must be
accumulated in float32 (and q scaled first), which also keeps their precision (float16's step at 1e4 is 8).
"""

from __future__ import annotations

import pytest
import torch

from radixserve.runtime.attention import AttentionMetadata, PrefixGroup, TorchReferenceBackend
from radixserve.runtime.kv_pool import KVPool


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """float32 attention of one query row [H, D] over [L, Hkv, D]."""
    heads, d = q.shape
    g = heads // keys.shape[1]
    k = keys.float().repeat_interleave(g, dim=1)
    v = values.float().repeat_interleave(g, dim=1)
    probs = torch.softmax(torch.einsum("hd,lhd->hl", q.float(), k) * d**-0.5, dim=-1)
    return torch.einsum("hl,lhd->hd", probs, v)


def _decode(
    backend: TorchReferenceBackend, q: torch.Tensor, pool: KVPool, tables: list[list[int]], shared: int
) -> torch.Tensor:
    """One decode row per table over layer 0 of ``pool``; with ``shared`` > 0 the tables' first ``shared`` slots
    (the same in each) are one prefix group, attended once (cascade)."""
    rows = [t[shared:] for t in tables]
    width = max(len(t) for t in rows)
    slots = torch.tensor([t + [t[0]] * (width - len(t)) for t in rows])
    lens = torch.tensor([len(t) for t in rows])
    mask = (torch.arange(width)[None, :] < lens[:, None])[:, None, None, :]
    n = len(tables)
    groups = (PrefixGroup(torch.arange(n), torch.tensor(tables[0][:shared])),) if shared else ()
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), n, slots, mask, (), groups)
    empty = torch.zeros(0, pool.k[0].shape[1], pool.k[0].shape[2], dtype=q.dtype)
    return backend.forward(0, q, empty, empty, meta, pool)


@pytest.mark.parametrize("grouped", [False, True], ids=["plain", "cascade"])
@torch.inference_mode()
def test_fp16_decode_with_large_activations_stays_finite(grouped: bool) -> None:
    torch.manual_seed(0)
    n_kv, heads, d, n_slots = 2, 4, 64, 200
    dtype = torch.float16
    pool = KVPool(n_slots, 1, n_kv, d, dtype, torch.device("cpu"))
    # Keys all near the same large vector, so q.k is large for every slot (not only for a few).
    base = torch.full((d,), 40.0)
    pool.k[0].copy_((base + torch.randn(n_slots, n_kv, d)).to(dtype))
    pool.v[0].copy_(torch.randn(n_slots, n_kv, d).to(dtype))
    q = (base + torch.randn(3, heads, d)).to(dtype)
    assert float((q[0, 0].float() * pool.k[0][0, 0].float()).sum()) > 65504, "the unscaled score must overflow"
    prefix = list(range(0, 120))
    tables = [prefix + list(range(120 + 10 * i, 125 + 10 * i)) for i in range(3)]
    out = _decode(TorchReferenceBackend(), q, pool, tables, len(prefix) if grouped else 0)

    assert torch.isfinite(out).all(), "float16 decode attention overflowed"
    for i, table in enumerate(tables):
        idx = torch.tensor(table)
        want = _reference(q[i], pool.k[0][idx], pool.v[0][idx])
        torch.testing.assert_close(out[i].float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("grouped", [False, True], ids=["plain", "cascade"])
@torch.inference_mode()
def test_bf16_decode_scores_are_not_rounded_to_bf16(grouped: bool) -> None:
    """The PyTorch path (what the compiled kernels are checked against, and what serves without them) kept bfloat16
    scores: a score near 16 moves in steps of 0.125, ~6% of its probability, and the rows came out 4-8x less
    accurate than the kernel's (max error 0.08 here against 0.015)."""
    torch.manual_seed(0)
    n_kv, heads, d, n_slots = 4, 12, 128, 400
    dtype = torch.bfloat16
    pool = KVPool(n_slots, 1, n_kv, d, dtype, torch.device("cpu"))
    pool.k[0].copy_((2 * torch.randn(n_slots, n_kv, d)).to(dtype))
    pool.v[0].copy_((2 * torch.randn(n_slots, n_kv, d)).to(dtype))
    q = (2 * torch.randn(3, heads, d)).to(dtype)
    prefix = list(range(0, 200))
    tables = [prefix + list(range(200 + 50 * i, 240 + 50 * i)) for i in range(3)]
    out = _decode(TorchReferenceBackend(cpu_kernels=False), q, pool, tables, len(prefix) if grouped else 0)
    for i, table in enumerate(tables):
        idx = torch.tensor(table)
        want = _reference(q[i], pool.k[0][idx], pool.v[0][idx])
        assert float((out[i].float() - want).abs().max()) < 0.04
