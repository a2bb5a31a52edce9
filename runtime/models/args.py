"""``ModelArgs``: the shape and the family options of the shared decoder, read from an HF config by
``runtime.models.families``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
    # Family options; the defaults are plain Llama.
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    rotary_dim: int = 0  # RoPE rotates the first rotary_dim dims of each head, 0: all (partial_rotary_factor)
    layer_windows: tuple[int | None, ...] = ()  # per layer: the sliding window, or None (empty: none anywhere)
    local_rope: tuple[float, dict[str, Any] | None] | None = None  # (theta, scaling) of windowed layers (Gemma 3)
    attn_scale: float | None = None  # score scale instead of head_dim ** -0.5 (Gemma)
    attn_softcap: float | None = None  # attention logit soft-capping (Gemma 2)
    final_softcap: float | None = None  # final logit soft-capping (Gemma 2)
    embed_scale: float | None = None  # embeddings times this (Gemma: sqrt(hidden_size))
    norm_offset: float = 0.0  # norms multiply by (offset + weight) (Gemma: 1)
    sandwich_norms: bool = False  # norms after attention and MLP too (Gemma 2 and 3)
    hidden_act: str = "silu"
    # Mixture of experts (Qwen3-MoE): layers whose MLP is ``num_experts`` experts, ``experts_per_token`` per token.
    moe_layers: tuple[bool, ...] = ()
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False

    @classmethod
    def from_hf_config(cls, cfg: Any) -> ModelArgs:
        from radixserve.runtime.models.families import model_args

        return model_args(cfg)

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    def sparse(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]
