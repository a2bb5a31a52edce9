"""The pure-PyTorch reference attention backend. Runs anywhere torch runs (CPU and CUDA).

Decode tokens are attended together over one padded gather of their KV slots; when several decoding sequences
share a cached prefix, that prefix is attended once against a single copy of its K/V and merged with each row's
own suffix by log-sum-exp (cascade attention), so a 1,000-token system prompt shared by 64 requests is read once
per layer rather than 64 times. Prefill chunks go one sequence at a time (few per step and long).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.attention.base import AttentionBackend, AttentionMetadata, PrefixGroup
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
            out[:nd] = _decode_attention(
                q[:nd], k_cache, v_cache, meta.decode_slots, meta.decode_mask, meta.prefix_groups
            )
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
    groups: tuple[PrefixGroup, ...],
) -> torch.Tensor:
    """One query per sequence. The G query heads that share a KV head become G query rows against that head, so
    grouped-query attention needs no repeated K/V; one flat ``index_select`` gathers every row's own keys."""
    b, h, d = q.shape
    n_kv = k_cache.shape[1]
    length = slots.shape[1]
    flat = slots.reshape(-1)
    k = k_cache.index_select(0, flat).view(b, length, n_kv, d).permute(0, 2, 3, 1)  # [B, Hkv, D, L]
    v = v_cache.index_select(0, flat).view(b, length, n_kv, d).transpose(1, 2)  # [B, Hkv, L, D]
    qg = q.view(b, n_kv, h // n_kv, d)
    scores = torch.matmul(qg, k).float() * (d**-0.5)
    scores = scores.masked_fill(~mask, float("-inf"))
    if not groups:
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.matmul(probs, v).view(b, h, d)
    # Unnormalized partial results, merged across the suffix and each shared prefix.
    m = scores.amax(dim=-1, keepdim=True)  # [B, Hkv, G, 1]
    e = torch.exp(scores - m)
    den = e.sum(dim=-1, keepdim=True)
    num = torch.matmul(e.to(q.dtype), v).float()  # [B, Hkv, G, D]
    group = h // n_kv
    for g in groups:
        nb = g.rows.shape[0]
        kp = k_cache.index_select(0, g.prefix_slots).permute(1, 2, 0)  # [Hkv, D, P]
        vp = v_cache.index_select(0, g.prefix_slots).transpose(0, 1)  # [Hkv, P, D]
        qh = qg.index_select(0, g.rows).transpose(0, 1).reshape(n_kv, nb * group, d)  # [Hkv, b*G, D]
        sp = torch.bmm(qh, kp).float() * (d**-0.5)  # [Hkv, b*G, P]
        mp = sp.amax(dim=-1, keepdim=True)
        ep = torch.exp(sp - mp)
        denp = ep.sum(dim=-1, keepdim=True)
        nump = torch.bmm(ep.to(q.dtype), vp).float()  # [Hkv, b*G, D]

        def rows_first(x: torch.Tensor, nb: int = nb) -> torch.Tensor:
            return x.view(n_kv, nb, group, x.shape[-1]).transpose(0, 1)  # [b, Hkv, G, X]

        mp, denp, nump = rows_first(mp), rows_first(denp), rows_first(nump)
        mr = m.index_select(0, g.rows)
        new_m = torch.maximum(mr, mp)
        a, c = torch.exp(mr - new_m), torch.exp(mp - new_m)
        num.index_copy_(0, g.rows, num.index_select(0, g.rows) * a + nump * c)
        den.index_copy_(0, g.rows, den.index_select(0, g.rows) * a + denp * c)
        m.index_copy_(0, g.rows, new_m)
    return (num / den).to(q.dtype).view(b, h, d)
