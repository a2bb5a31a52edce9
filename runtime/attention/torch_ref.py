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
            # [Bd, Lmax, Hkv, D] -> [Bd, Hkv, Lmax, D]
            kd = k_cache[meta.decode_slots].transpose(1, 2)
            vd = v_cache[meta.decode_slots].transpose(1, 2)
            qd = q[:nd].unsqueeze(2)  # [Bd, H, 1, D]
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, enable_gqa=True)
            out[:nd] = od.squeeze(2)
        for seq in meta.extends:
            s, e = seq.q_start, seq.q_start + seq.q_len
            qs = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
            if seq.kv_slots is None:
                ks = k[s:e].transpose(0, 1).unsqueeze(0)
                vs = v[s:e].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            else:
                ks = k_cache[seq.kv_slots].transpose(0, 1).unsqueeze(0)
                vs = v_cache[seq.kv_slots].transpose(0, 1).unsqueeze(0)
                # Query i sits at absolute position kv_len - q_len + i and sees keys up to there.
                mask = torch.ones(seq.q_len, seq.kv_len, dtype=torch.bool, device=q.device).tril(
                    seq.kv_len - seq.q_len
                )
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
            out[s:e] = o.squeeze(0).transpose(0, 1)
        return out
