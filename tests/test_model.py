"""Our model code against HuggingFace's on the same weights: full prefill, chunked prefill and decode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from runtime.attention import AttentionMetadata, ExtendSeq, ForwardContext, TorchReferenceBackend
from runtime.kv_pool import KVPool
from runtime.models import LlamaForCausalLM, ModelArgs
from runtime.weights import iter_weights, load_hf_config


def _load(folder: Path) -> LlamaForCausalLM:
    args = ModelArgs.from_hf_config(load_hf_config(folder))
    model = LlamaForCausalLM(args)
    model.load_weights(iter_weights(folder, progress=False))
    return model.eval()


def _ctx(pool: KVPool, out_slots: list[int], extends: list[ExtendSeq], decode: list[list[int]] | None = None):
    decode_slots = decode_mask = None
    if decode:
        width = max(len(t) for t in decode)
        decode_slots = torch.tensor([t + [t[0]] * (width - len(t)) for t in decode])
        lens = torch.tensor([len(t) for t in decode])
        decode_mask = (torch.arange(width)[None, :] < lens[:, None])[:, None, None, :]
    meta = AttentionMetadata(
        out_slots=torch.tensor(out_slots),
        num_decode=len(decode or []),
        decode_slots=decode_slots,
        decode_mask=decode_mask,
        extends=tuple(extends),
    )
    return ForwardContext(meta, pool, TorchReferenceBackend())


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_qwen_dir"])
@torch.inference_mode()
def test_prefill_chunked_and_decode_match_hf(fixture: str, request: pytest.FixtureRequest) -> None:
    folder = request.getfixturevalue(fixture)
    ours = _load(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    args = ours.args
    torch.manual_seed(0)
    ids = torch.randint(0, args.vocab_size, (23,))
    ref = hf(ids[None]).logits[0]

    pool = KVPool(64, args.num_layers, args.num_kv_heads, args.head_dim, torch.float32, torch.device("cpu"))
    # Whole prompt at once, into slots 0..22.
    n = len(ids)
    h = ours(ids, torch.arange(n), _ctx(pool, list(range(n)), [ExtendSeq(0, n, n, None)]))
    torch.testing.assert_close(ours.compute_logits(h), ref, atol=1e-4, rtol=1e-4)

    # Same prompt in two chunks into scattered slots, then the last token as a decode.
    slots = list(range(63, 63 - n, -1))
    h1 = ours(ids[:10], torch.arange(10), _ctx(pool, slots[:10], [ExtendSeq(0, 10, 10, None)]))
    kv = torch.tensor(slots[:22])
    h2 = ours(ids[10:22], torch.arange(10, 22), _ctx(pool, slots[10:22], [ExtendSeq(0, 12, 22, kv)]))
    h3 = ours(ids[22:], torch.arange(22, 23), _ctx(pool, slots[22:], [], decode=[slots]))
    got = ours.compute_logits(torch.cat([h1, h2, h3]))
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_shared_prefix_decode_attention_equals_plain(dtype: torch.dtype) -> None:
    """Cascade decode attention (shared prefix once, merged by log-sum-exp) equals attention over full rows."""
    from runtime.attention import PrefixGroup

    torch.manual_seed(0)
    n_kv, heads, d = 2, 6, 16
    pool = KVPool(400, 1, n_kv, d, dtype, torch.device("cpu"))
    pool.k[0].copy_(torch.randn(400, n_kv, d))
    pool.v[0].copy_(torch.randn(400, n_kv, d))
    prefix = list(range(100, 180))
    rows = [prefix + list(range(200 + 10 * i, 200 + 10 * i + 1 + i)) for i in range(4)]
    rows.append(list(range(300, 350)))  # not in the group
    q = torch.randn(len(rows), heads, d, dtype=dtype)

    def pad(tables: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(t) for t in tables)
        slots = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables])
        lens = torch.tensor([len(t) for t in tables])
        return slots, (torch.arange(width)[None, :] < lens[:, None])[:, None, None, :]

    backend = TorchReferenceBackend()
    outs = []
    for grouped in (False, True):
        tables = [r[len(prefix):] if grouped and i < 4 else r for i, r in enumerate(rows)]
        groups = (PrefixGroup(torch.arange(4), torch.tensor(prefix)),) if grouped else ()
        slots, mask = pad(tables)
        meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), len(rows), slots, mask, (), groups)
        # Write nothing new: out_slots is empty, k/v for this step are empty tensors.
        empty = torch.zeros(0, n_kv, d, dtype=dtype)
        outs.append(backend.forward(0, q, empty, empty, meta, pool))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)
