"""GGUF's K-quant blocks rewritten as the blocks the kernels compute with, without a float copy.

``Q4_K`` (most of a ``Q4_K_M`` file) is a super-block of 256 weights: fp16 ``d`` and ``dmin``, 8 sub-blocks of 32
with 6-bit scale ``sc`` and 6-bit minimum ``m`` each, and 4-bit quants ``q``; weight = ``d * sc * q - dmin * m``.
A ``Q4_1`` block of 32 is weight = ``d1 * q + m1`` with fp16 ``d1`` and ``m1``: each sub-block becomes one Q4_1
block with the same quants, ``d1 = d * sc`` and ``m1 = -dmin * m``, rounded once to fp16 (an error of at most
2^-11 of a scale: ~1/300 of a 4-bit step at the largest quant). 4.5 bits a weight become 5.

``Q5_K`` and ``Q6_K`` (the rest of the ``_M`` mixes) have no 32-block twin among the kernels' types (Q6_K's
sub-blocks are 16 wide), so ``gguf_weights`` dequantizes them and re-quantizes to Q8_0, 8.5 bits a weight.

Layout of a Q4_K block (144 bytes, ggml's ``block_q4_K``): ``d`` fp16, ``dmin`` fp16, ``scales[12]``, ``qs[128]``.
The 6-bit scales and minimums are packed as ggml's ``get_scale_min_k4`` reads them: for sub-block ``j < 4``,
``sc = scales[j] & 63`` and ``m = scales[j + 4] & 63``; for ``j >= 4``, ``sc = (scales[j + 4] & 15) |
((scales[j - 4] >> 6) << 4)`` and ``m = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4)``. The quants come in 4
runs of 32 bytes: run ``r`` holds sub-block ``2r`` in its low nibbles and ``2r + 1`` in its high nibbles.
"""

from __future__ import annotations

import numpy as np

Q4_K_BYTES = 144
Q4_1_BYTES = 20


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
