"""The decoder's Triton elementwise ops (``runtime/models/triton_ops.py``, CUDA) against their PyTorch
definitions in ``fused``, under Triton's interpreter on the CPU: RMSNorm with and without the residual add (the
residual gets exactly ``residual + x``), RoPE in place on a strided q/k view (whole and partial rotary), and
SiLU-and-mul, in float32 and bfloat16."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from radixserve.runtime.models import triton_ops  # noqa: E402
from radixserve.runtime.models.fused import ref_rms_norm, ref_rope, ref_silu_mul  # noqa: E402

# RoPE and SiLU-and-mul round once where PyTorch rounds each op: within a bfloat16 step of the definition.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_the_residual_add(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(5, 120, generator=gen).to(dtype)
    x = wide[:, :72]  # rows with a stride wider than the row
    w = torch.randn(72, generator=gen).to(dtype)
    r = torch.randn(5, 72, generator=gen).to(dtype)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(triton_ops.rms_norm(x, w, 1e-5), ref_rms_norm(x, w, 1e-5), rtol=rtol, atol=atol)
    res = r.clone()
    y = triton_ops.rms_norm(x, w, 1e-6, residual=res)
    if dtype == torch.float32:
        assert torch.equal(res, r + x)
    else:  # the interpreter truncates float32 to bfloat16 where a GPU rounds to nearest (gpu_check checks the bits)
        torch.testing.assert_close(res, r + x, rtol=1e-2, atol=0)
    torch.testing.assert_close(y, ref_rms_norm(r + x, w, 1e-6), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary", [16, 8])
def test_rope_in_place_on_a_qk_view(dtype: torch.dtype, rotary: int) -> None:
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(4, 7 * 16, generator=gen).to(dtype)  # 3 q heads, 2 k heads, 2 v heads of 16
    qk = qkv[:, : 5 * 16].view(4, 5, 16)
    cos, sin = (torch.randn(4, 1, rotary, generator=gen).to(dtype) for _ in range(2))
    want = qk.clone()
    want[..., :rotary] = ref_rope(qk[..., :rotary], cos, sin)
    v_before = qkv[:, 5 * 16 :].clone()
    triton_ops.rope_(qk[..., :rotary], cos, sin)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(qk, want, rtol=rtol, atol=atol)
    assert torch.equal(qkv[:, 5 * 16 :], v_before)  # the values are left alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(dtype: torch.dtype) -> None:
    gu = torch.randn(3, 2 * 1100, generator=torch.Generator().manual_seed(2)).to(dtype)  # more than one block
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(triton_ops.silu_mul(gu), ref_silu_mul(gu), rtol=rtol, atol=atol)
