"""Fused per-layer ops of the decoder (``csrc/fused_ops.cpp`` on CPU, ``triton_ops`` on CUDA) with their PyTorch
definitions.

The compiled versions run for float32 and bfloat16 tensors on CPU once they pass a check against the definitions
in that dtype; CUDA tensors of those dtypes take the Triton kernels where Triton imports; anything else (float16,
no compiler, ``RADIXSERVE_CPU_KERNELS=0``) runs the PyTorch code here, which is the reference the kernels are
tested against. In bfloat16 a kernel rounds where the definition does: the
residual add gives the same bits (checked), RMSNorm the same but for a few elements one bfloat16 step apart (its
float32 sum of squares goes in another order). RoPE and SiLU-and-mul round once per result where PyTorch rounds
every intermediate op as well: there they agree within one bfloat16 step.
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


# Per dtype, what the self-check allows between a kernel and its definition: (rtol, atol) for RoPE and
# SiLU-and-mul, whose kernels round once where PyTorch rounds each op; RMSNorm's must agree as closely.
_TOLERANCE = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (1.6e-2, 1e-2)}


def _self_check(module, dtype: torch.dtype) -> bool:  # noqa: ANN001 - the compiled module
    rtol, atol = _TOLERANCE[dtype]
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        x, r, w = (torch.randn(5, 48, generator=gen).to(dtype) for _ in range(3))
        ok = torch.allclose(module.rms_norm(x, w[0], 1e-5), ref_rms_norm(x, w[0], 1e-5), rtol=rtol, atol=atol)
        r2 = r.clone()
        y = module.add_rms_norm(x, r2, w[0], 1e-5)
        ok &= torch.equal(r2, r + x) and torch.allclose(y, ref_rms_norm(r + x, w[0], 1e-5), rtol=rtol, atol=atol)
        qkv = torch.randn(5, 7 * 16, generator=gen).to(dtype)
        cos, sin = (torch.randn(5, 1, 16, generator=gen).to(dtype) for _ in range(2))
        want = ref_rope(qkv[:, : 5 * 16].view(5, 5, 16), cos, sin)
        qk = qkv[:, : 5 * 16].view(5, 5, 16)
        module.rope(qk, cos, sin)
        ok &= torch.allclose(qk, want, rtol=rtol, atol=atol)
        gu = torch.randn(5, 64, generator=gen).to(dtype)
        ok &= torch.allclose(module.silu_mul(gu), ref_silu_mul(gu), rtol=rtol, atol=atol)
        kv, want = torch.zeros(2, 2, 9, 16, dtype=dtype), torch.zeros(2, 2, 9, 16, dtype=dtype)
        k, v = qkv[:, : 2 * 16].view(5, 2, 16), qkv[:, 2 * 16 : 4 * 16].view(5, 2, 16)
        slots = torch.tensor([7, 0, 3, 8, 2])
        module.store_kv(kv, slots, k, v)
        want[0].index_copy_(1, slots, k.transpose(0, 1))
        want[1].index_copy_(1, slots, v.transpose(0, 1))
        ok &= torch.equal(kv, want)
    return bool(ok)


@functools.cache
def _ops(dtype: torch.dtype):  # noqa: ANN202 - the compiled module or None
    kernels = load_kernels()
    if kernels is None:
        return None
    module = kernels.fused_ops
    try:
        ok = _self_check(module, dtype)
    except RuntimeError as exc:  # a kernel build without this dtype
        logger.warning("CPU fused-ops kernel failed its %s self-check (%s); using PyTorch ops", dtype, exc)
        return None
    if not ok:
        logger.warning("CPU fused-ops kernel disagrees with PyTorch in %s on this machine; using PyTorch ops", dtype)
        return None
    return module


def _fast(t: torch.Tensor, w: torch.Tensor | None = None):  # noqa: ANN202
    """The compiled ops for ``t`` (and a weight ``w`` of the same dtype), or None: PyTorch's."""
    if t.device.type != "cpu" or t.dtype not in _TOLERANCE or (w is not None and w.dtype != t.dtype):
        return None
    return _ops(t.dtype)


@functools.cache
def _triton_ops():  # noqa: ANN202 - the module or None
    try:
        from radixserve.runtime.models import triton_ops
    except ImportError:
        return None
    return triton_ops


def _gpu(t: torch.Tensor, w: torch.Tensor | None = None):  # noqa: ANN202
    """The Triton ops for a CUDA ``t`` (last dim contiguous; ``w`` of its dtype), or None."""
    if t.device.type != "cuda" or t.dtype not in _TOLERANCE or t.stride(-1) != 1 or torch.is_grad_enabled():
        return None
    if w is not None and w.dtype != t.dtype:
        return None
    return _triton_ops()


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    gpu = _gpu(x, w)
    if gpu is not None and x.dim() == 2:
        return gpu.rms_norm(x, w, eps)
    ops = _fast(x, w)
    return ops.rms_norm(x, w, eps) if ops is not None else ref_rms_norm(x, w, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += x`` (in place) and ``rms_norm(residual)``: the residual stream and the next layer's input."""
    gpu = _gpu(x, w)
    if gpu is not None and x.dim() == 2 and residual.dtype == x.dtype and residual.stride(-1) == 1:
        return gpu.rms_norm(x, w, eps, residual=residual)
    ops = _fast(x, w)
    if ops is not None and residual.is_contiguous() and residual.dtype == x.dtype:
        return ops.add_rms_norm(x, residual, w, eps)
    residual.add_(x)
    return ref_rms_norm(residual, w, eps)


def rope_(qk: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE of ``qk`` [T, heads, D] in place (a view of a fresh projection output); returns ``qk``."""
    gpu = _gpu(qk, cos)
    if gpu is not None and qk.shape[-1] % 2 == 0 and cos.shape[-1] == qk.shape[-1]:
        return gpu.rope_(qk, cos, signed_sin)
    ops = _fast(qk, cos)
    if ops is not None and qk.stride(-1) == 1 and qk.stride(1) == qk.shape[-1]:
        ops.rope(qk, cos, signed_sin)
        return qk
    qk.copy_(ref_rope(qk, cos, signed_sin))
    return qk


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gpu = _gpu(gate_up)
    if gpu is not None and gate_up.dim() == 2:
        return gpu.silu_mul(gate_up)
    ops = _fast(gate_up)
    return ops.silu_mul(gate_up) if ops is not None else ref_silu_mul(gate_up)


def store_kv(kv: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Write ``k`` and ``v`` [T, kv_heads, head_dim] into one layer of the pool ``kv`` [2, kv_heads, slots,
    head_dim] at ``slots`` [T] with the compiled row copy (``csrc/fused_ops.cpp``), where it applies (CPU, float32
    or bfloat16, each token's heads contiguous); False: the caller writes them itself."""
    if not kv.is_cpu or k.stride(-1) != 1 or k.stride(-2) != k.shape[-1] or v.stride(-1) != 1:
        return False
    if v.stride(-2) != v.shape[-1] or slots.dtype != torch.int64 or kv.dtype not in _TOLERANCE:
        return False
    ops = _ops(kv.dtype)
    if ops is None:
        return False
    ops.store_kv(kv, slots.contiguous(), k, v)
    return True
