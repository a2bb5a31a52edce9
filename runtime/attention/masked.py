"""Attention with per-layer options (``AttnOptions``: a sliding window, a score scale, soft-capping), in plain
PyTorch over the paged pool.

The layers that need it (Mistral's and Phi-3's windows, Gemma's local layers, scale and soft-cap) take this path;
plain layers keep the fast paths of ``torch_ref``. Decode rows are attended together over one gather of their
whole rows (a shared prefix put back in front, ``slot_rows.full_rows``), each query masked to its own keys and window;
prefill chunks one sequence at a time, with an explicit mask. Without soft-capping the work goes to SDPA with that
mask; with it, scores are formed, capped and normalized here.

Window semantics are HF's: the query at position ``i`` sees key ``j`` when ``j <= i`` and ``i - j < window``. The
pool keeps every token's K/V (the radix cache shares prefixes across requests of any length, so tokens that fall
out of one request's window are still another's prefix); the window is a mask, not an eviction.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.runtime.attention.base import AttentionMetadata, AttnOptions


def _attend(
    q: torch.Tensor,  # [Hkv, G * n, D]
    keys: torch.Tensor,  # [Hkv, L, D] or [Hkv, n?, L, D] broadcastable
    values: torch.Tensor,
    visible: torch.Tensor,  # [G * n, L] or broadcastable bool
    opts: AttnOptions,
    scale: float,
) -> torch.Tensor:
    if opts.softcap is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=scale)
    scores = torch.matmul(q.float() * scale, keys.float().transpose(-1, -2))
    scores = torch.tanh(scores / opts.softcap) * opts.softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, lens: torch.Tensor | None, window: int | None) -> torch.Tensor:
    """``[..., Q, L]`` bool: which keys each query sees (causal, within ``lens`` and the window)."""
    diff = q_pos[..., :, None] - k_pos[..., None, :]
    ok = diff >= 0
    if window is not None:
        ok &= diff < window
    if lens is not None:
        ok &= k_pos[..., None, :] < lens[..., None, None]
    return ok


def masked_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,
    v: torch.Tensor,
    kv: torch.Tensor,  # this layer's pool tensor [2, Hkv, N, D], this step's K/V already written
    meta: AttentionMetadata,
    full_rows: tuple[torch.Tensor, torch.Tensor] | None,  # decode rows' whole slot tables and lengths, or None
    opts: AttnOptions,
) -> torch.Tensor:
    t, h, d = q.shape
    n_kv = kv.shape[1]
    g = h // n_kv
    scale = opts.scale if opts.scale is not None else d**-0.5
    out = torch.empty_like(q)
    nd = meta.num_decode
    if nd and full_rows is not None:  # (None: the caller attends the decode rows itself)
        slots, lens = full_rows  # [B, L], [B]
        b, width = slots.shape
        keys = kv[0][:, slots]  # [Hkv, B, L, D]
        values = kv[1][:, slots]
        qd = q[:nd].reshape(b, n_kv, g, d).permute(1, 0, 2, 3)  # [Hkv, B, G, D]
        k_pos = torch.arange(width, device=q.device)
        visible = _visible((lens - 1)[:, None], k_pos[None, :], lens, opts.window)  # [B, 1, L]
        o = _attend(qd, keys, values, visible[None], opts, scale)  # [Hkv, B, G, D]
        out[:nd] = o.permute(1, 0, 2, 3).reshape(b, h, d)
    for seq in meta.extends:
        s, e = seq.q_start, seq.q_start + seq.q_len
        if seq.kv_slots is None:
            ks, vs = k[s:e].transpose(0, 1), v[s:e].transpose(0, 1)  # [Hkv, n, D]
        else:
            ks, vs = kv[0][:, seq.kv_slots], kv[1][:, seq.kv_slots]
        qs = q[s:e].reshape(seq.q_len, n_kv, g, d).permute(1, 2, 0, 3).reshape(n_kv, g * seq.q_len, d)
        q_pos = torch.arange(seq.kv_len - seq.q_len, seq.kv_len, device=q.device).repeat(g)
        visible = _visible(q_pos, torch.arange(seq.kv_len, device=q.device), None, opts.window)
        o = _attend(qs, ks, vs, visible, opts, scale)  # [Hkv, G * n, D]
        out[s:e] = o.reshape(n_kv, g, seq.q_len, d).permute(2, 0, 1, 3).reshape(seq.q_len, h, d)
    return out
