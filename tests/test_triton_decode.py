"""The CUDA-graph decode kernel (``runtime/attention/triton_decode.py``) against the PyTorch reference, under
Triton's interpreter on the CPU: rows of different lengths read through a slot table (one longer than the splits'
runs, one shorter than the splits), grouped-query heads, a head size that is not a power of two, windows, scales
and soft-capping, in float32 and bfloat16."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton decorates the kernel: interpret it on the CPU
triton = pytest.importorskip("triton")

from radixserve.runtime.attention.base import AttnOptions  # noqa: E402
from radixserve.runtime.attention.torch_ref import TorchReferenceBackend  # noqa: E402
from radixserve.runtime.attention.triton_decode import decode_attention  # noqa: E402
from radixserve.runtime.kv_pool import KVPool  # noqa: E402
from radixserve.runtime.step_layout import StepRow, lay_out  # noqa: E402

NUM_SLOTS = 600


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "options"),
    [
        (4, 2, 32, AttnOptions()),
        (3, 3, 24, AttnOptions(window=7)),
        (8, 1, 16, AttnOptions(scale=0.3, softcap=5.0)),
    ],
)
def test_decode_kernel_matches_the_reference(
    dtype: torch.dtype, heads: int, kv_heads: int, dim: int, options: AttnOptions
) -> None:
    gen = torch.Generator().manual_seed(heads * 10 + dim)
    lens = [1, 3, 45, 200]
    perm = torch.randperm(NUM_SLOTS, generator=gen).tolist()
    tables, at = [], 0
    for n in lens:
        tables.append(perm[at : at + n])
        at += n
    # The rows sit in table rows 2, 0, 3, 1 of a wider table, as a request's row is wherever it was given one.
    where = [2, 0, 3, 1]
    table = torch.zeros(5, 256, dtype=torch.int32)
    for r, t in zip(where, tables, strict=True):
        table[r, : len(t)] = torch.tensor(t, dtype=torch.int32)
    rows = [StepRow([1], n - 1, t, True) for n, t in zip(lens, tables, strict=True)]
    _, _, meta = lay_out(rows, torch.device("cpu"))
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    k = torch.randn(len(lens), kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(len(lens), kv_heads, dim, generator=gen).to(dtype)
    pool = KVPool(NUM_SLOTS, 1, kv_heads, dim, dtype, torch.device("cpu"))
    pool.kv[0].copy_(torch.randn(pool.kv[0].shape, generator=gen).to(dtype))
    ref = TorchReferenceBackend(cpu_kernels=False)
    want = ref.forward(0, q, k, v, meta, pool, ref.prepare(meta, pool), options).float()
    # The reference stored this step's K/V into the pool; the kernel reads them from there.
    scale = options.scale if options.scale is not None else dim**-0.5
    got = decode_attention(
        q, pool.kv[0], table, torch.tensor(where), torch.tensor(lens, dtype=torch.int32), 4, scale,
        options.softcap or 0.0, options.window or 0,
    )  # fmt: skip
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_one_split_and_more_splits_than_keys_agree() -> None:
    gen = torch.Generator().manual_seed(1)
    pool = KVPool(64, 1, 2, 16, torch.float32, torch.device("cpu"))
    pool.kv[0].copy_(torch.randn(pool.kv[0].shape, generator=gen))
    table = torch.randperm(64, generator=gen)[None, :].to(torch.int32)
    q = torch.randn(2, 4, 16, generator=gen)
    rows, lens = torch.tensor([0, 0]), torch.tensor([5, 64], dtype=torch.int32)
    one = decode_attention(q, pool.kv[0], table, rows, lens, 1, 0.25)
    many = decode_attention(q, pool.kv[0], table, rows, lens, 16, 0.25)
    torch.testing.assert_close(many, one, rtol=1e-5, atol=1e-5)
