"""The pure-PyTorch reference attention backend. Runs anywhere torch runs (CPU and CUDA).

Decode tokens are attended in one batched ``scaled_dot_product_attention`` call over a padded gather of their KV
slots; prefill chunks go one sequence at a time (they are few per step and long, so the loop costs little).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.attention.base import AttentionBackend, AttentionMetadata
from runtime.kv_pool import KVPool


class TorchReferenceBackend(AttentionBackend):
    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        pool: KVPool,
    ) -> torch.Tensor:
        k_cache, v_cache = pool.k[layer], pool.v[layer]
        k_cache[meta.out_slots] = k
        v_cache[meta.out_slots] = v
        out = torch.empty_like(q)
        nd = meta.num_decode
        if nd:
            assert meta.decode_slots is not None and meta.decode_mask is not None
            out[:nd] = _decode_attention(q[:nd], k_cache, v_cache, meta.decode_slots, meta.decode_mask)
        for seq in meta.extends:
            s, e = seq.q_start, seq.q_start + seq.q_len
            qs = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
            if seq.kv_slots is None:
                ks = k[s:e].transpose(0, 1).unsqueeze(0)
                vs = v[s:e].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            else:
                ks = k_cache.index_select(0, seq.kv_slots).transpose(0, 1).unsqueeze(0)
                vs = v_cache.index_select(0, seq.kv_slots).transpose(0, 1).unsqueeze(0)
                # Query i sits at absolute position kv_len - q_len + i and sees keys up to there.
                mask = torch.ones(seq.q_len, seq.kv_len, dtype=torch.bool, device=q.device).tril(
                    seq.kv_len - seq.q_len
                )
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
            out[s:e] = o.squeeze(0).transpose(0, 1)
        return out


def _decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [N, Hkv, D]
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [B, L]
    mask: torch.Tensor,  # [B, 1, 1, L]
) -> torch.Tensor:
    """One query per sequence. The G query heads that share a KV head become G query rows against that head, so
    grouped-query attention needs no repeated K/V; one flat ``index_select`` gathers every sequence's keys."""
    b, h, d = q.shape
    n_kv = k_cache.shape[1]
    length = slots.shape[1]
    flat = slots.reshape(-1)
    k = k_cache.index_select(0, flat).view(b, length, n_kv, d).permute(0, 2, 3, 1)  # [B, Hkv, D, L]
    v = v_cache.index_select(0, flat).view(b, length, n_kv, d).transpose(1, 2)  # [B, Hkv, L, D]
    qg = q.view(b, n_kv, h // n_kv, d)
    scores = torch.matmul(qg, k) * (d**-0.5)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v).view(b, h, d)
