"""GGUF's K-quant blocks (and Q5_0's) rewritten as the blocks the kernels compute with, without a float copy.

``Q4_K`` (most of a ``Q4_K_M`` file) is a super-block of 256 weights: fp16 ``d`` and ``dmin``, 8 sub-blocks of 32
with 6-bit scale ``sc`` and 6-bit minimum ``m`` each, and 4-bit quants ``q``; weight = ``d * sc * q - dmin * m``.
A ``Q4_1`` block of 32 is weight = ``d1 * q + m1`` with fp16 ``d1`` and ``m1``: each sub-block becomes one Q4_1
block with the same quants, ``d1 = d * sc`` and ``m1 = -dmin * m``, rounded once to fp16 (an error of at most
2^-11 of a scale: ~1/300 of a 4-bit step at the largest quant). 4.5 bits a weight become 5.

``Q6_K`` (the head and half the ``ffn_down`` / ``attn_v`` of a ``Q4_K_M`` file) is served as it is where the packed
kernel runs (``csrc/quant_packed.cpp``; ``q6_k_levels`` is its definition): 256 weights, fp16 ``d``, 16 int8 sub-block
scales (16 weights each) and 6-bit quants; weight = ``d * scale * (q - 32)``. ``Q5_K`` (a ``Q5_K_M`` file) is
``Q4_K`` with a fifth bit per weight, served as it is there too (``q4_k_levels(..., five=True)``). Elsewhere both
have no 32-block twin among the row kernels' types, so ``gguf_weights`` dequantizes them and re-quantizes to Q8_0,
8.5 bits a weight.

``Q5_0`` (what ``llama-quantize`` writes for the Q4_K tensors of a ``Q4_K_M`` mix whose rows are not a multiple of
256 long, e.g. every 576-wide projection of SmolLM2-135M) is a block of 32: fp16 ``d``, 32 fifth bits ``qh`` and 4-bit
``qs``; weight = ``d * (q - 16)`` with ``q`` in [0, 31]. That is a ``Q8_0`` block exactly: the same ``d`` and int8
levels ``q - 16``. 5.5 bits a weight become 8.5, with no error (a re-quantization would add up to half a Q8_0 step).

Layout of a Q4_K block (144 bytes, ggml's ``block_q4_K``): ``d`` fp16, ``dmin`` fp16, ``scales[12]``, ``qs[128]``.
The 6-bit scales and minimums are packed as ggml's ``get_scale_min_k4`` reads them: for sub-block ``j < 4``,
``sc = scales[j] & 63`` and ``m = scales[j + 4] & 63``; for ``j >= 4``, ``sc = (scales[j + 4] & 15) |
((scales[j - 4] >> 6) << 4)`` and ``m = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4)``. The quants come in 4
runs of 32 bytes: run ``r`` holds sub-block ``2r`` in its low nibbles and ``2r + 1`` in its high nibbles.
"""

from __future__ import annotations

import numpy as np
import torch

Q4_K_BYTES = 144
Q4_1_BYTES = 20
Q5_0_BYTES = 22
Q8_0_BYTES = 34
Q6_K_BYTES = 210
Q5_K_BYTES = 176


def q4_k_levels(
    data: torch.Tensor, n: int, k: int, *, five: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K rows (uint8 ``[n, k // 256 * 144]``) as their quants (int16 ``[n, k]``) and each sub-block of 32's
    scale ``d * sc`` and offset ``dmin * m`` (float32 ``[n, k // 32]``, exact): weight = q * scale - offset.
    ``five``: Q5_K rows (``[n, k // 256 * 176]``, ggml's ``block_q5_K``: Q4_K's with ``qh[32]`` before the
    nibbles, bit ``j`` of ``qh[l]`` the fifth bit of weight ``l`` of sub-block ``j``), 5-bit quants."""
    blocks = data.reshape(n, k // 256, Q5_K_BYTES if five else Q4_K_BYTES)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()
    dmin = blocks[..., 2:4].contiguous().view(torch.float16).float()
    sc, m = (torch.from_numpy(v.astype(np.float32)) for v in _scale_min(blocks[..., 4:16].cpu().numpy()))
    sc, m = sc.to(data.device), m.to(data.device)
    qs = blocks[..., 48 if five else 16 :].to(torch.int16).reshape(n, -1, 4, 32)
    quants = torch.stack([qs & 15, qs >> 4], dim=3)  # [n, ns, 4, 2, 32]: sub-block 2r low nibbles, 2r + 1 high
    if five:
        qh = blocks[..., 16:48].to(torch.int16)  # [n, ns, 32]
        fifth = torch.stack([(qh >> j) & 1 for j in range(8)], dim=2)  # [n, ns, 8, 32]
        quants = quants | (fifth.reshape(quants.shape) << 4)
    return quants.reshape(n, k), (d * sc).reshape(n, -1), (dmin * m).reshape(n, -1)


def q6_k_levels(data: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K rows (uint8 ``[n, k // 256 * 210]``, ggml's ``block_q6_K``: ``ql[128]``, ``qh[64]``, int8
    ``scales[16]``, fp16 ``d``) as their levels ``q - 32`` (int16 ``[n, k]``) and each 16 weights' scale
    ``d * scale`` (float32 ``[n, k // 16]``, exact): weight = level * scale, exactly as ggml dequantizes.

    In each half of 128 weights, weight ``32 t + l`` (``t < 4``, ``l < 32``) has its low 4 bits in
    ``ql[l + 32 (t & 1)]`` (the high nibble for ``t >= 2``) and its top 2 bits at bit ``2 t`` of ``qh[l]``."""
    blocks = data.reshape(n, k // 256, Q6_K_BYTES)
    ql = blocks[..., :128].to(torch.int16).reshape(n, -1, 2, 64)
    qh = blocks[..., 128:192].to(torch.int16).reshape(n, -1, 2, 32)
    low = torch.cat([ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4], dim=-1)
    top = torch.cat([(qh >> (2 * t)) & 3 for t in range(4)], dim=-1)
    levels = (low | (top << 4)) - 32
    scales = blocks[..., 192:208].contiguous().view(torch.int8).float()
    d = blocks[..., 208:210].contiguous().view(torch.float16).float()
    return levels.reshape(n, k), (d * scales).reshape(n, k // 16)


def _scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 sub-blocks' 6-bit (scale, min) of every super-block: ``scales`` is uint8 ``[..., 12]``."""
    s = scales.astype(np.uint16)
    sc = np.empty((*s.shape[:-1], 8), np.uint16)
    m = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    m[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    m[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, m


def q4_k_to_q4_1(raw: np.ndarray) -> np.ndarray:
    """``raw``: uint8 ``[rows, n_super * 144]`` Q4_K bytes; returns uint8 ``[rows, n_super * 8 * 20]`` Q4_1 bytes
    of the same weights (sub-block scales rounded to fp16)."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, Q4_K_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # [rows, ns, 1]
    dmin = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = _scale_min(blocks[..., 4:16])  # [rows, ns, 8]
    scale = (d * sc).astype(np.float16)
    offset = (-(dmin * m)).astype(np.float16)
    qs = blocks[..., 16:].reshape(rows, -1, 4, 32)  # 4 runs of 32 bytes
    values = np.stack([qs & 15, qs >> 4], axis=3).reshape(rows, -1, 8, 32)  # sub-block 2r: low, 2r+1: high
    packed = values[..., :16] | (values[..., 16:] << 4)  # Q4_1: byte i holds weights i and i + 16
    out = np.empty((rows, blocks.shape[1], 8, Q4_1_BYTES), np.uint8)
    out[..., 0:2] = scale[..., None].view(np.uint8).reshape(*scale.shape, 2)
    out[..., 2:4] = offset[..., None].view(np.uint8).reshape(*offset.shape, 2)
    out[..., 4:] = packed.astype(np.uint8)
    return out.reshape(rows, -1)


def nibble_levels(blocks: torch.Tensor, at: int, five: bool) -> torch.Tensor:
    """The int16 levels ``[..., 32]`` in weight order of ggml's blocks of 32 4-bit or 5-bit weights (uint8 ``[...,
    bytes]``; their nibbles from byte ``at``, or from ``at + 4`` after the fifth bits), before any offset: byte i of
    the nibbles holds weight i low and weight i + 16 high; with ``five``, bit i of the little-endian word at ``at``
    is weight i's bit 4 (Q5_0, Q5_1)."""
    qs = blocks[..., at + 4 if five else at :].to(torch.int16)
    levels = torch.cat([qs & 15, qs >> 4], dim=-1)
    if five:  # weight i's bit: bit i % 8 of byte i // 8 (little-endian), in uint8 throughout
        i = torch.arange(32, device=blocks.device)
        bits = (blocks[..., at : at + 4][..., i // 8] >> (i % 8).to(torch.uint8)) & 1
        levels = levels | (bits.to(torch.int16) << 4)
    return levels


def q5_0_to_q8_0(raw: np.ndarray) -> np.ndarray:
    """``raw``: uint8 ``[rows, n_blocks * 22]`` Q5_0 bytes (ggml's ``block_q5_0``: ``d`` fp16, ``qh``, ``qs[16]``;
    see ``nibble_levels``); returns uint8 ``[rows, n_blocks * 34]`` Q8_0 bytes of exactly the same weights."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, Q5_0_BYTES)
    out = np.empty((rows, blocks.shape[1], Q8_0_BYTES), np.uint8)
    out[..., 0:2] = blocks[..., 0:2]
    levels = nibble_levels(torch.from_numpy(blocks), 2, five=True) - 16  # q in [0, 31] -> [-16, 15]
    out[..., 2:] = levels.to(torch.int8).numpy().view(np.uint8)
    return out.reshape(rows, -1)
