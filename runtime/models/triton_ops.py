"""The decoder's per-layer elementwise ops as Triton kernels, for CUDA (``fused`` picks them for CUDA tensors).

In PyTorch each of these is several kernels (RMSNorm alone: a square, a mean, an rsqrt and two products); at a
small decode batch every kernel costs its launch and a pass over memory whatever its size, and ~30 of them per
layer were a third of an 8B model's batch-1 step on an H200 (``bench/gpu_check.py --only profile``). One kernel
per op instead, each reading its input once.

Each op computes in float32 and rounds once where the PyTorch definition (``fused.ref_*``) rounds at the same
points for RMSNorm and the residual add, so those give the definition's bits in bfloat16 but for the order of the
sum of squares; RoPE and SiLU-and-mul round once where PyTorch rounds every intermediate op, so they agree within
one bfloat16 step. ``tests/test_triton_ops.py`` checks them against the definitions under Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x, res, w, out, stride_x, stride_r, stride_o, n, eps, ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    v = tl.load(x + row * stride_x + cols, mask=ok, other=0.0)
    if ADD:  # residual += x, rounded to the residual's dtype, then the norm of what was stored
        v = (v.to(tl.float32) + tl.load(res + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)).to(v.dtype)
        tl.store(res + row * stride_r + cols, v, mask=ok)
    vf = v.to(tl.float32)
    inv = tl.rsqrt(tl.sum(vf * vf, 0) / n + eps)
    normed = (vf * inv).to(v.dtype).to(tl.float32)  # HF rounds the normalized row before the weight
    wf = tl.load(w + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out + row * stride_o + cols, (normed * wf).to(out.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of the rows of ``x`` [T, n]; with ``residual``, first ``residual += x`` in place and the norm of
    the sum."""
    t, n = x.shape
    out = torch.empty_like(x)
    if t:
        res = residual if residual is not None else x
        _rms_norm_kernel[(t,)](x, res, w, out, x.stride(0), res.stride(0), out.stride(0), n, eps,
                               ADD=residual is not None, BLOCK=triton.next_power_of_2(n))  # fmt: skip
    return out


@triton.jit
def _rope_kernel(qk, cos, sin, stride_t, stride_h, stride_c, HALF: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    ok = i < HALF
    base = qk + t * stride_t + h * stride_h
    x1 = tl.load(base + i, mask=ok, other=0.0)
    x2 = tl.load(base + HALF + i, mask=ok, other=0.0)
    c1 = tl.load(cos + t * stride_c + i, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos + t * stride_c + HALF + i, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin + t * stride_c + i, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin + t * stride_c + HALF + i, mask=ok, other=0.0).to(tl.float32)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    # x * cos + swap_halves(x) * signed_sin (the table's first half is -sin)
    tl.store(base + i, (a * c1 + b * s1).to(x1.dtype), mask=ok)
    tl.store(base + HALF + i, (b * c2 + a * s2).to(x1.dtype), mask=ok)


def rope_(qk: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``qk`` [T, heads, D] (last dim contiguous) in place with ``[T, 1, D]`` tables."""
    t, heads, d = qk.shape
    if t:
        cos2, sin2 = cos.reshape(t, d), signed_sin.reshape(t, d)
        _rope_kernel[(t, heads)](qk, cos2, sin2, qk.stride(0), qk.stride(1), cos2.stride(0), HALF=d // 2,
                                 BLOCK=triton.next_power_of_2(d // 2))  # fmt: skip
    return qk


@triton.jit
def _silu_mul_kernel(gu, out, stride_g, stride_o, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    g = tl.load(gu + row * stride_g + cols, mask=ok, other=0.0)
    u = tl.load(gu + row * stride_g + n + cols, mask=ok, other=0.0).to(tl.float32)
    gf = g.to(tl.float32)
    tl.store(out + row * stride_o + cols, (gf / (1.0 + tl.exp(-gf)) * u).to(g.dtype), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` [T, 2n] (gate first)."""
    t, n2 = gate_up.shape
    n = n2 // 2
    out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    if t:
        block = 1024
        _silu_mul_kernel[(t, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block)
    return out
