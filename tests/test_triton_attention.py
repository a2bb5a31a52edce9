"""The Triton paged-attention backend (``runtime/attention/triton_attention.py``) against the PyTorch reference,
under Triton's interpreter on the CPU: decode rows (one split across its context), prefill chunks fresh and over a
cached prefix, a shared-prefix group (cascade), grouped-query heads, a head size that is not a power of two,
windows, scales and soft-capping, in float32 and bfloat16."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton decorates the kernel: interpret it on the CPU
triton = pytest.importorskip("triton")

from radixserve.runtime.attention.base import AttnOptions  # noqa: E402
from radixserve.runtime.attention.torch_ref import TorchReferenceBackend  # noqa: E402
from radixserve.runtime.attention.triton_attention import SPLIT_KEYS, TritonBackend, plan_step  # noqa: E402
from radixserve.runtime.kv_pool import KVPool  # noqa: E402
from radixserve.runtime.step_layout import StepRow, lay_out  # noqa: E402

NUM_SLOTS = 1200


def _step(gen: torch.Generator, grouped: bool):
    """A step's rows over random slot tables: 3 decode rows (one longer than a split), a fresh chunk, a chunk over
    a cached prefix, a short one and one longer than an item; with ``grouped``, the decode rows share their first
    40 slots."""
    perm = torch.randperm(NUM_SLOTS, generator=gen).tolist()
    taken = iter(perm)

    def table(n: int) -> list[int]:
        return [next(taken) for _ in range(n)]

    prefix = table(40)
    decode_lens = [45, 9 + 40, SPLIT_KEYS + 70]
    rows, shared = [], []
    for n in decode_lens:
        t = (prefix + table(n - 40)) if grouped else table(n)
        rows.append(StepRow([1], n - 1, t, True))
        shared.append((7, 40) if grouped else None)
    for q_len, kv_len in ((20, 20), (18, 50), (3, 40), (70, 90)):
        rows.append(StepRow([1] * q_len, kv_len - q_len, table(kv_len), False))
    return rows, shared


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "options"),
    [
        (4, 2, 32, AttnOptions()),
        (3, 3, 24, AttnOptions(window=7)),
        (4, 1, 16, AttnOptions(scale=0.3, softcap=5.0)),
    ],
)
@pytest.mark.parametrize("grouped", [False, True])
def test_triton_backend_matches_the_reference(
    dtype: torch.dtype, heads: int, kv_heads: int, dim: int, options: AttnOptions, grouped: bool
) -> None:
    gen = torch.Generator().manual_seed(heads * 100 + dim + grouped)
    rows, shared = _step(gen, grouped)
    _, _, meta = lay_out(rows, torch.device("cpu"), shared)
    assert bool(meta.prefix_groups) == grouped
    t = meta.out_slots.numel()
    q = torch.randn(t, heads, dim, generator=gen).to(dtype)
    k = torch.randn(t, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(t, kv_heads, dim, generator=gen).to(dtype)
    outs = []
    for backend in (TorchReferenceBackend(cpu_kernels=False), TritonBackend()):
        pool = KVPool(NUM_SLOTS, 1, kv_heads, dim, dtype, torch.device("cpu"))
        pool.kv[0].copy_(torch.randn(pool.kv[0].shape, generator=torch.Generator().manual_seed(5)).to(dtype))
        outs.append(backend.forward(0, q, k, v, meta, pool, backend.prepare(meta, pool), options).float())
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(outs[1], outs[0], rtol=tol, atol=tol)


def test_long_decode_rows_are_split_and_groups_share_their_prefix_items() -> None:
    rows, shared = _step(torch.Generator().manual_seed(0), grouped=True)
    _, _, meta = lay_out(rows, torch.device("cpu"), shared)
    plan = plan_step(meta, torch.device("cpu"))
    items = plan.items.tolist()
    # One item for the group's 3 rows over the 40-slot prefix; each row's own keys (the long one in two splits);
    # the prefill chunks (20, 18, 3 and 70 queries) in items of up to 64 queries, launched apart.
    assert items[0][1:4] == [3, 0, 40]
    assert [it[1] for it in items] == [3, 1, 1, 1, 1]
    assert [it[1] for it in plan.extend_items.tolist()] == [20, 18, 3, 64, 6]
    assert not plan.single and sorted(set(plan.dest.tolist())) == list(range(meta.out_slots.numel()))


def test_the_tiny_model_decodes_the_same_tokens_on_the_triton_backend(tiny_model_dir) -> None:  # noqa: ANN001
    """The whole engine (radix cache, chunked prefill, batched decode) with its attention swapped for the Triton
    backend, interpreted: float32 greedy tokens equal the reference backend's."""
    from radixserve.runtime.sampling_params import SamplingParams
    from tests.test_engine import make_engine

    prompts = ["The quick brown fox jumps over", "One, two, three,", "The quick brown fox"]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = []
    for swap in (False, True):
        eng = make_engine(tiny_model_dir, dtype="float32", chunked_prefill_size=16)
        try:
            if swap:
                eng.call(lambda core: setattr(core.runner, "backend", TritonBackend()))
            outputs.append([r["output_ids"] for r in eng.generate(prompts, params)])
        finally:
            eng.shutdown()
    assert outputs[1] == outputs[0]
