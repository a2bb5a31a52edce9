"""A Llama-family decoder in plain PyTorch: Llama 2/3, Mistral, Qwen2, SmolLM.

The forward pass takes a flat, unpadded batch of tokens from many sequences (prefill chunks and decode tokens
mixed) with their positions; everything about batching and KV memory hides behind ``ForwardContext.attend``.
Parameter names match HuggingFace checkpoints, so weights load by name.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from radixserve.runtime.attention.base import ForwardContext
from radixserve.runtime.models import fused, loading
from radixserve.runtime.models.linear import Embedding, Linear
from radixserve.runtime.models.rope import RotaryEmbedding


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    architecture: str

    @classmethod
    def from_hf_config(cls, cfg: Any) -> ModelArgs:
        archs = list(getattr(cfg, "architectures", None) or ["LlamaForCausalLM"])
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {arch!r} is not supported; supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        # transformers >= 5 folds rope_theta and rope_scaling into rope_parameters.
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        scaling = getattr(cfg, "rope_scaling", None) or rope or None
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        # HF Llama's attention_bias puts a bias on q, k, v and o; Qwen2 has q/k/v biases only.
        llama_bias = arch != "Qwen2ForCausalLM" and bool(getattr(cfg, "attention_bias", False))
        qkv_bias = arch == "Qwen2ForCausalLM" or llama_bias
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=llama_bias,
            architecture=arch,
        )


SUPPORTED_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"})


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


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        h, d = args.hidden_size, args.head_dim
        parts = {"q_proj": args.num_heads * d, "k_proj": args.num_kv_heads * d, "v_proj": args.num_kv_heads * d}
        self.qkv_proj = MergedLinear(h, parts, bias=args.qkv_bias)
        self.o_proj = Linear(args.num_heads * d, h, bias=args.o_bias)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        # q and k sit side by side in the fused output: RoPE rotates both in one go, in place.
        qk = fused.rope_(qkv[:, : (h + hkv) * d].view(t, h + hkv, d), *rope)
        v = qkv[:, (h + hkv) * d :].view(t, hkv, d)
        o = ctx.attend(self.layer, qk[:, :h], qk[:, h:], v)
        return self.o_proj(o.reshape(t, h * d))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        parts = {"gate_proj": args.intermediate_size, "up_proj": args.intermediate_size}
        self.gate_up_proj = MergedLinear(args.hidden_size, parts, bias=False)
        self.down_proj = Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(args, layer)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor | None,
        residual: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """``x`` is the previous layer's MLP output, still to be added to ``residual`` (the residual stream, updated
        in place; the same sums, in the same order, as ``x = x + attn(...)``); ``None`` for the first layer, whose
        residual is the embeddings. Returns this layer's MLP output."""
        norm = self.input_layernorm
        h = norm(residual) if x is None else norm.add_forward(x, residual)
        h = self.post_attention_layernorm.add_forward(self.self_attn(h, rope, ctx), residual)
        return self.mlp(h)


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.rope = RotaryEmbedding(
            args.head_dim, args.max_position_embeddings, args.rope_theta, args.rope_scaling, dtype
        )
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


# HF projection name -> the merged module that holds it.
MERGED = {
    **dict.fromkeys(("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    **dict.fromkeys(("gate_proj", "up_proj"), "gate_up_proj"),
}


class LlamaForCausalLM(nn.Module):
    """``forward`` returns final hidden states ``[T, hidden]``; ``compute_logits`` projects only the rows the
    caller needs (the last token of each sampled sequence), which saves the vocabulary matmul on prompt tokens."""

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
        quantized = embed.quant
        if quantized is not None:
            self.lm_head.set_quantized(quantized)
        else:
            self.lm_head.weight = embed.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        rope = self.model.rope(positions)  # looked up once for all layers, in the activations' dtype
        # An embedding kept in GGUF blocks unpacks its rows to float32: the residual stream is in the activations'.
        residual = self.model.embed_tokens(input_ids).to(rope[0].dtype)
        x = None
        for layer in self.model.layers:
            x = layer(x, residual, rope, ctx)
        return self.model.norm.add_forward(x, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, Any]], device: torch.device | None = None) -> None:
        """Put HF-named tensors (or ``QuantTensor`` blocks) into the parameters, q/k/v and gate/up into their
        merged projections (``runtime.models.loading``); raises ``ValueError`` naming any missing or unknown
        tensor. On a model built on the meta device each parameter is created here, on ``device``."""
        params = dict(self.named_parameters())
        merged = {name: m for name, m in self.named_modules() if isinstance(m, MergedLinear)}
        skip = {"lm_head.weight"} if self.args.tie_word_embeddings else set()
        seen = loading.load_weights(self, weights, merged, _merged_target, device=device, skip=skip)
        self.tie_weights()
        expected: set[str] = set()
        for name in params:
            owner, _, leaf = name.rpartition(".")
            module = merged.get(owner)
            if module is None:
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
