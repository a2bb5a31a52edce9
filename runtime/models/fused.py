"""Fused per-layer ops of the decoder (``csrc/fused_ops.cpp``) with their PyTorch definitions.

The compiled versions run for float32 tensors on CPU once they pass a check against the definitions; anything
else (CUDA, bfloat16, no compiler, ``RADIXSERVE_CPU_KERNELS=0``) runs the PyTorch code here, which is the
reference the kernels are tested against.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from radixserve.runtime.cpu_ext import load_kernels

logger = logging.getLogger("radixserve.kernels")



def ref_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalized in float32, scaled in the input's dtype."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, w.shape, w, eps)  # one kernel, the same bits as the formula below in float32
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def ref_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x`` [T, heads, D] with [T, 1, D] tables (a new tensor)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin


def ref_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@functools.cache
def _ops():  # noqa: ANN202 - the compiled module or None
    kernels = load_kernels()
    if kernels is None:
        return None
    module = kernels.fused_ops
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        x, r, w = (torch.randn(5, 48, generator=gen) for _ in range(3))
        ok = torch.allclose(module.rms_norm(x, w[0], 1e-5), ref_rms_norm(x, w[0], 1e-5), rtol=1e-5, atol=1e-6)
        r2 = r.clone()
        y = module.add_rms_norm(x, r2, w[0], 1e-5)
        ok &= torch.equal(r2, r + x) and torch.allclose(y, ref_rms_norm(r + x, w[0], 1e-5), rtol=1e-5, atol=1e-6)
        qkv = torch.randn(5, 7 * 16, generator=gen)
        cos, sin = torch.randn(5, 1, 16, generator=gen), torch.randn(5, 1, 16, generator=gen)
        want = ref_rope(qkv[:, : 5 * 16].view(5, 5, 16), cos, sin)
        qk = qkv[:, : 5 * 16].view(5, 5, 16)
        module.rope(qk, cos, sin)
        ok &= torch.allclose(qk, want, rtol=1e-6, atol=1e-6)
        gu = torch.randn(5, 64, generator=gen)
        ok &= torch.allclose(module.silu_mul(gu), ref_silu_mul(gu), rtol=1e-5, atol=1e-6)
    if not ok:
        logger.warning("CPU fused-ops kernel disagrees with PyTorch on this machine; using PyTorch ops")
        return None
    return module


def _fast(t: torch.Tensor):  # noqa: ANN202
    return _ops() if t.device.type == "cpu" and t.dtype == torch.float32 else None


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    ops = _fast(x)
    return ops.rms_norm(x, w, eps) if ops is not None else ref_rms_norm(x, w, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += x`` (in place) and ``rms_norm(residual)``: the residual stream and the next layer's input."""
    ops = _fast(x)
    if ops is not None and residual.is_contiguous():
        return ops.add_rms_norm(x, residual, w, eps)
    residual.add_(x)
    return ref_rms_norm(residual, w, eps)


def rope_(qk: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE of ``qk`` [T, heads, D] in place (a view of a fresh projection output); returns ``qk``."""
    ops = _fast(qk)
    if ops is not None and qk.stride(-1) == 1 and qk.stride(1) == qk.shape[-1]:
        ops.rope(qk, cos, signed_sin)
        return qk
    qk.copy_(ref_rope(qk, cos, signed_sin))
    return qk


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    ops = _fast(gate_up)
    return ops.silu_mul(gate_up) if ops is not None else ref_silu_mul(gate_up)
