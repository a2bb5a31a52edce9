"""Every decoder layer of a decode step in one compiled call (``csrc/decode_stack.cpp``).

At one to a few rows a decode step of a small model is mostly host work: ~400 Python-level calls a step for
SmolLM2-135M's 30 layers, ~40% of a one-user step on two cores. The stack runs the same kernels as the Python layers
(``llama.py``), in the same order, from C++: its results are the Python path's to the bit, and the Python layers stay
the reference and the path for everything the stack does not cover.

It applies to a step when all of these hold, checked per step (``stack_for``):

* every row is a decode row and the compiled CPU decode-attention kernel attends them (``kernel_decode_rows``);
  rows with LoRA adapters get their updates in the stack as ``LoRABatch.apply`` adds them (``lora_groups``);
* the model is the plain shared decoder: no q/k norms, full-width RoPE, no windows, attention scales, soft-capping,
  sandwich norms, GELU or routed experts, no forward hooks (tensor parallelism's all-reduces);
* every projection runs on a kernel the stack can call at this many rows: packed GGUF blocks (``quant_packed``),
  bfloat16 weights on the AVX-512 BF16 kernels (plain: ``bf16_linear``; packed in pairs: ``bf16_packed``), oneDNN's
  packed weights (float32, AMX bfloat16; ``mkldnn::_linear_pointwise`` through the dispatcher) or a plain weight
  (``F.linear``). A weight kept plain beside
  its packed copy (``--keep-plain-weights``) keeps the Python path.

The stack holds the weight tensors, so it is built once the weights are final (at the first decode step) and dropped
when they change (``invalidate``: the weight mover's swaps).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from radixserve.runtime import envs
from radixserve.runtime.attention.base import ForwardContext, KernelRows
from radixserve.runtime.cpu_ext import load_kernels
from radixserve.runtime.models import fused, quant
from radixserve.runtime.models.bf16_kernels import bf16_kernel_max_rows, unpack_from_rows, weight_kernel
from radixserve.runtime.models.linear import Linear

logger = logging.getLogger("radixserve.model")

_ATTR = "_decode_stack"  # on the model: (stack, max rows, dtype), or None once found not to apply


class _Unsupported(Exception):
    pass


def invalidate(model: nn.Module) -> None:
    """Forget ``model``'s stack (its weights changed); the next decode step builds it again."""
    model.__dict__.pop(_ATTR, None)


def suspend(model: nn.Module) -> None:
    """No stack for ``model`` until ``invalidate``: its weights are about to change one by one (the weight
    mover), and a stack built meanwhile would hold tensors on their way out."""
    model.__dict__[_ATTR] = None


def stack_for(model: nn.Module, residual: torch.Tensor, ctx: ForwardContext) -> tuple[Any, KernelRows] | None:
    """(stack, (slots, lens, groups)) when this step (its embeddings ``residual``) can run on the stack (see the
    module doc), else None."""
    if not envs.decode_stack() or torch.is_grad_enabled() or residual.device.type != "cpu":
        return None
    built = model.__dict__.get(_ATTR, False)
    if built is False:
        built = _build(model)
        model.__dict__[_ATTR] = built
    if built is None or residual.shape[0] > built[1] or residual.dtype != built[2]:
        return None
    if ctx.pool.layers.dtype != residual.dtype:
        return None
    layout = ctx.kernel_decode_rows()
    if layout is None:
        return None
    return built[0], layout


def lora_groups(lora: Any, num_layers: int) -> Any:
    """The stack's ``LoRAGroups`` of a step's ``LoRABatch`` (each adapter's weights made once for the stack)."""
    kernels = load_kernels()
    assert kernels is not None
    weights, starts, ends, indexes = [], [], [], []
    empty = torch.empty(0)
    for adapter, rows in lora.groups:
        made = adapter.__dict__.get("_stack_weights")
        if made is None:
            pairs = [adapter.weights.get((i, p), (empty, empty)) for i in range(num_layers) for p in _PROJECTIONS]
            made = kernels.decode_stack.lora([a for a, _ in pairs], [b for _, b in pairs])
            adapter.__dict__["_stack_weights"] = made
        weights.append(made)
        span = rows if isinstance(rows, slice) else slice(0, -1)  # (-1: every row; an index tensor lists its own)
        starts.append(span.start)
        ends.append(span.stop)
        indexes.append(rows if isinstance(rows, torch.Tensor) else empty)
    return kernels.decode_stack.LoRAGroups(weights, starts, ends, indexes)


_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # the stack's order (``LoRAGroups.apply``)


def _build(model: nn.Module) -> tuple[Any, int, torch.dtype] | None:
    try:
        return _make(model)
    except _Unsupported as why:
        logger.debug("decode steps run layer by layer: %s", why)
        return None


def _make(model: nn.Module) -> tuple[Any, int, torch.dtype]:
    args = model.args  # type: ignore[attr-defined]
    kernels = load_kernels()
    if kernels is None or not hasattr(kernels, "decode_stack"):
        raise _Unsupported("no compiled kernels")
    if args.qk_norm or (args.rotary_dim or args.head_dim) != args.head_dim or args.sandwich_norms:
        raise _Unsupported("q/k norms, partial RoPE or sandwich norms")
    if args.hidden_act == "gelu_pytorch_tanh" or args.attn_scale is not None or args.attn_softcap is not None:
        raise _Unsupported("GELU, an attention scale or soft-capping")
    if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
        raise _Unsupported("forward hooks (tensor parallelism)")
    layers = model.model.layers  # type: ignore[attr-defined]
    stack = kernels.decode_stack.Stack(args.num_heads, args.num_kv_heads, args.head_dim, args.rms_norm_eps)
    max_rows = 1 << 30
    for i, layer in enumerate(layers):
        if args.window(i) is not None or args.sparse(i):
            raise _Unsupported("sliding windows or routed experts")
        attn, mlp = layer.self_attn, layer.mlp
        ops = []
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            op, rows = _linear_op(kernels.decode_stack, linear, gated=linear is mlp.gate_up_proj and linear.gated)
            ops.append(op)
            max_rows = min(max_rows, rows)
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if fused._fast(norms[0], norms[0]) is None:
            raise _Unsupported("no fused norm kernel for this dtype")
        stack.add_layer(norms[0].detach(), norms[1].detach(), *ops)
    return stack, max_rows, layers[0].input_layernorm.weight.dtype


def _linear_op(ds: Any, linear: Linear, gated: bool = False) -> tuple[Any, int]:
    """The stack's op for ``linear`` and the most rows at which the Python ``Linear`` takes that same kernel;
    ``gated``: the MLP's gate/up projection that ``MergedLinear.silu_mul`` multiplies gated (kind 5, SiLU-and-mul
    included, as the Python MLP runs it)."""
    if type(linear).forward is not Linear.forward:
        raise _Unsupported(f"a {type(linear).__name__} of its own")
    bias = linear.bias.detach() if linear.bias is not None else None
    quantized = linear.quant
    if quantized is not None:
        parts = quantized.parts if isinstance(quantized, quant.QuantParts) else (quantized,)
        if not all(p.packed for p in parts) or quant.packed_ops() is None:
            raise _Unsupported("blocks without the packed kernel")
        # A packed weight's bfloat16 rows unpack for oneDNN's GEMM from BF16_UNPACK_FROM_ROWS rows (with AMX).
        rows = quant.BF16_UNPACK_FROM_ROWS - 1 if quant.amx() else 1 << 30
        op = ds.linear(
            0, [p.data for p in parts], [quant.QTYPES[p.qtype] for p in parts], [p.shape[0] for p in parts],
            quantized.shape[1], bias,
        )  # fmt: skip
        return op, rows
    if linear._released:  # only the packed copy: Linear calls its kernel (the pairs: below unpack_from_rows)
        kind = (5 if gated else 4) if linear._bf16_packed else 3
        rows = unpack_from_rows() - 1 if linear._bf16_packed else 1 << 30
        return ds.linear(kind, [linear._packed], [], [], linear.in_features, bias), rows
    weights = list(linear._plain_parts) or [linear.weight]
    if weights[0].dtype == torch.bfloat16 and weight_kernel(tuple(weights)) is not None:
        return ds.linear(1, [w.detach() for w in weights], [], [], weights[0].shape[1], bias), bf16_kernel_max_rows()
    if linear._plain_parts or linear._eligible():
        raise _Unsupported("a weight that would be packed for oneDNN, or in parts")
    return ds.linear(2, [linear.weight.detach()], [], [], linear.weight.shape[1], bias), 1 << 30
