"""The shared decoder in plain PyTorch: Llama 2/3, Mistral, Qwen2/3, Qwen3-MoE, Phi-3, Gemma 2/3, SmolLM.

The forward pass takes a flat, unpadded batch of tokens from many sequences (prefill chunks and decode tokens
mixed) with their positions; everything about batching and KV memory hides behind ``ForwardContext.attend``.
Parameter names match HuggingFace checkpoints, so weights load by name. What differs between families is data in
``ModelArgs`` (``runtime.models.families``): q/k norms, per-layer sliding windows and RoPE, attention scale and
soft-capping, Gemma's norm offset, sandwich norms, activation and embedding scale, routed experts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.runtime.attention.base import AttnOptions, ForwardContext
from radixserve.runtime.cpu_ext import load_kernels
from radixserve.runtime.greedy import argmax_checked, top_indices
from radixserve.runtime.models import decode_stack, fused, loading, quant
from radixserve.runtime.models.args import ModelArgs
from radixserve.runtime.models.families import SUPPORTED_ARCHITECTURES, checkpoint_names
from radixserve.runtime.models.linear import Embedding, Linear
from radixserve.runtime.models.rope import RotaryEmbedding

__all__ = ["SUPPORTED_ARCHITECTURES", "LlamaForCausalLM", "ModelArgs"]
Rope = tuple[torch.Tensor, torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual += x`` in place, then the norm of the new residual (one pass where the fused op runs)."""
        return fused.add_rms_norm(x, residual, self.weight, self.eps)


class MergedLinear(Linear):
    """Several projections of the same input in one matmul (q/k/v, gate/up): fewer, larger matmuls per layer,
    which is most of a small decode batch's time. ``parts`` maps each projection's HF name to its output size,
    in output order, so checkpoints with one tensor per projection load into row slices (``part_rows``) and
    tensor parallelism can cut each projection separately."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = dict(parts)

    def part_rows(self, name: str) -> slice:
        start = 0
        for part, size in self.parts.items():
            if part == name:
                return slice(start, start + size)
            start += size
        raise KeyError(name)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The output ``y`` cut into the parts' outputs (views)."""
        return y.split(list(self.parts.values()), dim=-1)

    @property
    def gated(self) -> bool:
        """Whether ``silu_mul`` runs in one kernel: a [gate; up] pair of whole 16-row blocks packed in pairs of K,
        with no forward hooks (the gated call does not go through ``forward``)."""
        sizes = list(self.parts.values())
        if self._forward_hooks or self._forward_pre_hooks:
            return False
        return self._bf16_packed and len(sizes) == 2 and sizes[0] == sizes[1] and sizes[0] % 16 == 0

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a [gate; up] projection: ``fused.silu_mul`` over its output, in one kernel with the
        linear where ``gated`` (its widest output is then never written)."""
        return self.silu_mul_packed(x) if self.gated else fused.silu_mul(self(x))


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        h, d = args.hidden_size, args.head_dim
        parts = {"q_proj": args.num_heads * d, "k_proj": args.num_kv_heads * d, "v_proj": args.num_kv_heads * d}
        self.qkv_proj = MergedLinear(h, parts, bias=args.qkv_bias)
        self.o_proj = Linear(args.num_heads * d, h, bias=args.o_bias)
        if args.qk_norm:
            self.q_norm = RMSNorm(d, args.rms_norm_eps)
            self.k_norm = RMSNorm(d, args.rms_norm_eps)
        self.qk_norm = args.qk_norm
        self.rotary_dim = args.rotary_dim or d
        self.options = AttnOptions(window=args.window(layer), scale=args.attn_scale, softcap=args.attn_softcap)

    def forward(self, x: torch.Tensor, rope: Rope, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        if ctx.lora is not None:
            qkv = ctx.lora.apply(self.layer, "qkv_proj", x, qkv)
        qk = qkv[:, : (h + hkv) * d].view(t, h + hkv, d)
        if self.qk_norm:  # per head, before RoPE (Qwen3, Gemma 3)
            qk = torch.cat([self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])], dim=1)
        # q and k sit side by side: RoPE rotates both in one go, in place (with a partial rotary factor, the first
        # rotary_dim dims of each head, the rest passing through).
        if self.rotary_dim == d:
            qk = fused.rope_(qk, *rope)
        else:
            fused.rope_(qk[..., : self.rotary_dim], *rope)
        v = qkv[:, (h + hkv) * d :].view(t, hkv, d)
        o = ctx.attend(self.layer, qk[:, :h], qk[:, h:], v, self.options).reshape(t, h * d)
        if ctx.lora is not None:
            return ctx.lora.apply(self.layer, "o_proj", o, self.o_proj(o))
        return self.o_proj(o)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, width: int | None = None, layer: int = -1) -> None:
        super().__init__()
        self.layer = layer  # (-1: a routed expert, which no adapter reaches)
        width = width or args.intermediate_size
        self.gate_up_proj = MergedLinear(args.hidden_size, {"gate_proj": width, "up_proj": width}, bias=False)
        self.down_proj = Linear(width, args.hidden_size, bias=False)
        self.gelu = args.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor, lora: Any = None) -> torch.Tensor:
        """``lora``: the step's ``LoRABatch`` (None: no row uses an adapter)."""
        if lora is not None:
            gate_up = lora.apply(self.layer, "gate_up_proj", x, self.gate_up_proj(x))
            if self.gelu:
                gate, up = gate_up.chunk(2, dim=-1)
                h = F.gelu(gate, approximate="tanh") * up
            else:
                h = fused.silu_mul(gate_up)
            return lora.apply(self.layer, "down_proj", h, self.down_proj(h))
        if self.gelu:  # Gemma
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        return self.down_proj(self.gate_up_proj.silu_mul(x))


class SparseMoE(nn.Module):
    """Top-k routed experts (Qwen3-MoE, Mixtral), over the flat token batch: the router picks ``experts_per_token``
    experts per token; each expert hit runs once on all of its tokens (one gather, one MLP, one scatter-add), so
    the cost follows the tokens routed, not tokens times experts."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate = Linear(args.hidden_size, args.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(args, args.moe_intermediate_size) for _ in range(args.num_experts))
        self.top_k, self.normalize = args.experts_per_token, args.norm_topk_prob

    def forward(self, x: torch.Tensor, lora: Any = None) -> torch.Tensor:
        del lora  # (adapters for routed experts are refused when they load)
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype).reshape(-1)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tokens = torch.arange(x.shape[0], device=x.device).repeat_interleave(self.top_k)[order]
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, n in zip(self.experts, counts, strict=True):
            if n:
                sel, w = tokens[start : start + n], weights[order[start : start + n]]
                out.index_add_(0, sel, expert(x[sel]) * w[:, None])
            start += n
        return out


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(args, layer)
        self.mlp = SparseMoE(args) if args.sparse(layer) else MLP(args, layer=layer)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.sandwich = args.sandwich_norms
        if args.sandwich_norms:  # Gemma 2/3: post_attention_layernorm normalizes the attention output
            self.pre_feedforward_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor | None, residual: torch.Tensor, rope: Rope, ctx: ForwardContext) -> torch.Tensor:
        """``x`` is the previous layer's MLP output, still to be added to ``residual`` (the residual stream, updated
        in place; the same sums, in the same order, as ``x = x + attn(...)``); ``None`` for the first layer, whose
        residual is the embeddings. Returns this layer's MLP output."""
        norm = self.input_layernorm
        h = norm(residual) if x is None else norm.add_forward(x, residual)
        if self.sandwich:
            a = self.post_attention_layernorm(self.self_attn(h, rope, ctx))
            h = self.pre_feedforward_layernorm.add_forward(a, residual)
            return self.post_feedforward_layernorm(self.mlp(h, ctx.lora))
        h = self.post_attention_layernorm.add_forward(self.self_attn(h, rope, ctx), residual)
        return self.mlp(h, ctx.lora)

    def forward_kept(
        self, x: torch.Tensor | None, residual: torch.Tensor, rope: Rope, ctx: ForwardContext, keep: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` for a last layer whose output is read at the rows ``keep`` only: attention runs for every
        row (their keys and values go into the pool), the rest of the layer for those rows. Returns their MLP
        output and residual stream."""
        norm = self.input_layernorm
        h = norm(residual) if x is None else norm.add_forward(x, residual)
        a = self.self_attn(h, rope, ctx)[keep]
        residual = residual[keep]
        if self.sandwich:
            h = self.pre_feedforward_layernorm.add_forward(self.post_attention_layernorm(a), residual)
            return self.post_feedforward_layernorm(self.mlp(h, ctx.lora)), residual
        h = self.post_attention_layernorm.add_forward(a, residual)
        return self.mlp(h, ctx.lora), residual


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        rotary = args.rotary_dim or args.head_dim
        self.rope = RotaryEmbedding(
            rotary, args.max_position_embeddings, args.rope_theta, args.rope_scaling, dtype
        )
        # Gemma 3's local (windowed) layers rotate with a RoPE of their own.
        self.local_rope = None
        if args.local_rope is not None:
            theta, scaling = args.local_rope
            self.local_rope = RotaryEmbedding(rotary, args.max_position_embeddings, theta, scaling, dtype)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def rotaries(self) -> list[RotaryEmbedding]:
        return [self.rope] + ([self.local_rope] if self.local_rope is not None else [])


# HF projection name -> the merged module that holds it.
MERGED = {
    **dict.fromkeys(("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    **dict.fromkeys(("gate_proj", "up_proj"), "gate_up_proj"),
}


# Logits of a head in blocks that are recomputed exactly, per row (see ``exact_leaders``).
HEAD_LEADERS = 8


def exact_leaders(
    logits: torch.Tensor, hidden: torch.Tensor, w: quant.QuantTensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``logits`` (``hidden`` through the block kernel's head ``w``) with each row's ``HEAD_LEADERS`` largest
    replaced by the float32 products of ``hidden`` and those dequantized rows of ``w``; in place.

    The block kernel rounds its activations to int8 per block of 32, which moves a logit by ~0.5% of its size:
    enough to swap two near-tied leaders, and a greedy token then differs from the dequantized weights' own
    argmax. The true leader is among the kernel's first ``HEAD_LEADERS`` unless that many logits lie within that
    error of it, so recomputing those few gives the exact argmax (and exact leading logits) for ``HEAD_LEADERS``
    x K multiply-adds a row, against V x K for the whole head. SmolLM2's Q4_1 file, 512 prompts x 32 greedy tokens
    against its float32 dequantization (``bench.quant_agreement``): 0.41 -> 0.47-0.48 of the prompts identical."""
    k = min(HEAD_LEADERS, logits.shape[-1])
    flat, x = logits.reshape(-1, logits.shape[-1]), hidden.reshape(-1, hidden.shape[-1])
    ops = _packed_head_ops(x, w, bias) if flat.dtype == x.dtype and flat.stride(-1) == 1 else None
    if ops is not None:  # the same sums in one compiled call (csrc/greedy.cpp)
        ops.exact_leaders(flat, x, w.data, quant.QTYPES[w.qtype], w.shape[1], w.shape[0], k, bias)
        return flat.reshape(logits.shape)
    x = x.double()
    top = top_indices(flat, k)  # [rows, k]
    rows = quant.embedding(top, w)  # [rows, k, K] float32, only these rows unpacked
    # Summed in float64, each row on its own: the float32 result then never depends on what shares the batch
    # (a batched GEMM may block the sums differently for different batch sizes).
    exact = (rows.double() * x.unsqueeze(1)).sum(-1)
    if bias is not None:
        exact = exact + bias.double()[top]
    flat.scatter_(-1, top, exact.to(flat.dtype))
    return flat.reshape(logits.shape)


def _packed_head_ops(  # noqa: ANN202 - the compiled module, or None
    hidden: torch.Tensor, w: quant.QuantTensor, bias: torch.Tensor | None
):
    """The compiled greedy ops (``csrc/greedy.cpp``) where they take this head's rows: packed blocks on the CPU,
    ``hidden`` 2-D float32 or bfloat16 rows (the head's logits are then of the same dtype); else None."""
    ok = (
        w.packed
        and hidden.dim() == 2
        and hidden.device.type == "cpu"
        and hidden.dtype in (torch.float32, torch.bfloat16)
        and hidden.stride(-1) == 1
        and w.shape[1] % 8 == 0
        and (bias is None or bias.device.type == "cpu")
    )
    kernels = load_kernels() if ok else None
    return None if kernels is None else kernels.greedy


class LlamaForCausalLM(nn.Module):
    """``forward`` returns final hidden states ``[T, hidden]`` (only the rows ``ctx.out_rows`` names, where it names
    some: the last layer's MLP, its biggest product, then runs for those); ``compute_logits`` projects only the rows
    the caller needs (the last token of each sampled sequence), which saves the vocabulary matmul on prompt tokens."""

    trims_rows = True  # reads ``ForwardContext.out_rows`` (a tensor-parallel handle does not)

    def __init__(self, args: ModelArgs, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.args = args
        self.model = LlamaModel(args, dtype)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the output projection when the checkpoint ties them (again once the embedding
        is loaded: loading gives it a parameter, or blocks, of its own)."""
        if not self.args.tie_word_embeddings:
            return
        embed = self.model.embed_tokens
        quantized = getattr(embed, "quant", None)  # a tensor-parallel embedding has no blocks
        if quantized is not None:
            self.lm_head.set_quantized(quantized)  # packed for the CPU kernel where it runs
            embed.set_quantized(self.lm_head.quant)  # then both read that one copy
        else:
            self.lm_head.weight = embed.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        rope = self.model.rope(positions)  # looked up once for all layers, in the activations' dtype
        local = self.model.local_rope(positions) if self.model.local_rope is not None else rope
        # An embedding kept in GGUF blocks unpacks its rows to float32: the residual stream is in the activations'.
        residual = self.model.embed_tokens(input_ids).to(rope[0].dtype)
        if self.args.embed_scale is not None:  # Gemma: the scale rounded to the activations' dtype, as HF does
            residual = residual * torch.tensor(self.args.embed_scale, dtype=residual.dtype)
        stack = decode_stack.stack_for(self, residual, ctx)
        if stack is not None:  # every layer in one compiled call: the same kernels, the same bits
            kernel, (slots, lens, groups) = stack
            lora = decode_stack.lora_groups(ctx.lora, self.args.num_layers) if ctx.lora is not None else None
            x = kernel.forward(residual, *rope, ctx.pool.layers, ctx.meta.out_slots, slots, lens, groups,
                               **({"lora": lora} if lora is not None else {}))  # fmt: skip
            return self.model.norm.add_forward(x, residual)
        x = None
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            layer_rope = local if self.args.window(i) is not None else rope
            if i == last and ctx.out_rows is not None:  # only some rows are read: the MLP runs for those
                x, residual = layer.forward_kept(x, residual, layer_rope, ctx, ctx.out_rows)
            else:
                x = layer(x, residual, layer_rope, ctx)
        return self.model.norm.add_forward(x, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        head = self._head_blocks()
        if head is not None:
            logits = exact_leaders(logits, hidden, head, self.lm_head.bias)
        cap = self.args.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _head_blocks(self) -> quant.QuantTensor | None:
        """The head's blocks where it is kept in them (its logits then get ``exact_leaders``)."""
        head = self.lm_head.quant if self.lm_head.qtype is not None else None
        return head if isinstance(head, quant.QuantTensor) else None

    def greedy_tokens(self, hidden: torch.Tensor, vocab: int) -> torch.Tensor:
        """``argmax_checked(compute_logits(hidden), vocab)`` (int64 ``[2 B]``: the logits' finiteness flags, then
        the tokens). With a packed head on the CPU, its exact leaders and the pick are one compiled call after the
        head's product: a step's tail runs with caches the weights just went through, where each torch op costs
        tens of microseconds. (Not under soft-capping, whose tanh can make ties.)"""
        head = self._head_blocks()
        ops = None
        if head is not None and self.args.final_softcap is None:
            ops = _packed_head_ops(hidden, head, self.lm_head.bias)
        if ops is None:
            return argmax_checked(self.compute_logits(hidden), vocab)
        logits = self.lm_head(hidden)  # the head's product is in hidden's dtype, rows contiguous
        k = min(HEAD_LEADERS, logits.shape[-1])
        code = quant.QTYPES[head.qtype]
        return ops.exact_argmax_checked(logits, hidden, head.data, code, head.shape[1], head.shape[0], k,
                                        self.lm_head.bias, vocab)  # fmt: skip

    def load_weights(
        self,
        weights: Iterable[tuple[str, Any]],
        device: torch.device | None = None,
        on_weight: Callable[[nn.Module], None] | None = None,
        transform: Callable[[Iterable[tuple[str, Any]]], Iterable[tuple[str, Any]]] | None = None,
    ) -> None:
        """Put HF-named tensors (or ``QuantTensor`` blocks) into the parameters, q/k/v and gate/up into their
        merged projections (``runtime.models.loading``); raises ``ValueError`` naming any missing or unknown
        tensor. On a model built on the meta device each parameter is created here, on ``device``. The names are
        the family's checkpoint names; ``transform`` (a tensor-parallel rank's cuts) sees the decoder's."""
        params = dict(self.named_parameters())
        merged = {name: m for name, m in self.named_modules() if isinstance(m, MergedLinear)}
        skip = {"lm_head.weight"} if self.args.tie_word_embeddings else set()
        weights = checkpoint_names(self.args.architecture, weights)
        if transform is not None:
            weights = transform(weights)
        if self.args.norm_offset:
            weights = _offset_norms(weights, self.args.norm_offset)
        seen = loading.load_weights(
            self, weights, merged, _merged_target, device=device, skip=skip, on_weight=on_weight
        )
        self.tie_weights()
        expected: set[str] = set()
        for name in params:
            owner, _, leaf = name.rpartition(".")
            module = merged.get(owner)
            if module is None or name in seen:  # a checkpoint may hold a merged projection whole (Phi-3)
                expected.add(name)
            else:
                expected.update(f"{owner.rpartition('.')[0]}.{part}.{leaf}" for part in module.parts)
        if self.args.tie_word_embeddings:
            expected.discard("lm_head.weight")
        missing = expected - seen
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


def _merged_target(name: str, merged: dict[str, MergedLinear]) -> tuple[str, slice | None]:
    """``model.layers.0.self_attn.k_proj.weight`` -> (``model.layers.0.self_attn.qkv_proj.weight``, k's rows)."""
    prefix, _, leaf = name.rpartition(".")
    owner, _, proj = prefix.rpartition(".")
    fused = f"{owner}.{MERGED.get(proj, '')}"
    if proj not in MERGED or fused not in merged:
        return name, None
    return f"{fused}.{leaf}", merged[fused].part_rows(proj)


def _offset_norms(weights: Iterable[tuple[str, Any]], offset: float) -> Iterable[tuple[str, Any]]:
    """Gemma's norms scale by ``1 + weight``: store that sum, so every norm runs the same kernel. In float32 the
    product ``x * (1 + w)`` is the bits HF computes."""
    for name, tensor in weights:
        if name.endswith("norm.weight") and isinstance(tensor, torch.Tensor):
            tensor = tensor.float() + offset
        yield name, tensor
