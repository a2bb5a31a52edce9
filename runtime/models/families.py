"""The model families served, each a configuration of the one shared decoder (``runtime.models.llama``).

``model_args(cfg)`` reads an HF config (plain attributes, ``runtime.weights.load_hf_config``) into ``ModelArgs``:
what differs between families is data (q/k norms, sliding windows per layer, attention scale and soft-capping,
norm offsets, the sandwich norms, the activation, the embedding scale, a second RoPE for local layers), never a
copy of the decoder. An architecture not listed is refused with the supported list.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from radixserve.runtime.models.args import ModelArgs

SUPPORTED_ARCHITECTURES = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "MixtralForCausalLM",
        "Phi3ForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
    }
)
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Families whose HF attention applies ``sliding_window`` to every layer when it is set (no ``layer_types``).
WINDOW_EVERYWHERE = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM")
# Checkpoint names that differ from the shared decoder's, per family: (regex, replacement), applied in order.
CHECKPOINT_RENAMES: dict[str, tuple[tuple[str, str], ...]] = {
    # Mixtral's experts: w1 = gate, w3 = up, w2 = down, under block_sparse_moe (Qwen3-MoE's names are ours).
    "MixtralForCausalLM": (
        (r"\.block_sparse_moe\.", ".mlp."),
        (r"(\.experts\.\d+)\.w1\.", r"\1.gate_proj."),
        (r"(\.experts\.\d+)\.w3\.", r"\1.up_proj."),
        (r"(\.experts\.\d+)\.w2\.", r"\1.down_proj."),
    ),
}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# A checkpoint of the bare decoder (``Qwen3Model``, ``MistralModel``: embedding models are saved so) is its
# family's, without a head; its tensors lack the ``model.`` prefix.
BARE_DECODERS = {arch.removesuffix("ForCausalLM") + "Model": arch for arch in SUPPORTED_ARCHITECTURES}
_BARE_NAMES = (re.compile(r"^(embed_tokens|layers|norm)\."), r"model.\1.")
# A sequence classifier (``Qwen3ForSequenceClassification``: a cross-encoder reranker) is its family's decoder
# with a head of ``num_labels`` outputs, ``score``, in place of the vocabulary's; the head is the loader's
# (``runtime.classifier_head``), as is the language model's own head read at tokens (vLLM's classifier_from_token).
CLASSIFIERS = {arch.removesuffix("ForCausalLM") + "ForSequenceClassification": arch for arch in SUPPORTED_ARCHITECTURES}


RopeSpec = tuple[float, dict[str, Any] | None]  # (theta, scaling)


def _rope(params: dict[str, Any], fallback_theta: float) -> RopeSpec:
    theta = float(params.get("rope_theta", fallback_theta))
    kind = params.get("rope_type", params.get("type", "default"))
    return theta, (dict(params) if kind not in (None, "default") else None)


def _ropes(cfg: Any, arch: str) -> tuple[RopeSpec, RopeSpec | None]:
    """``(global rope, local rope or None)``: (theta, scaling). transformers >= 5 folds rope_theta and rope_scaling
    into ``rope_parameters`` (per layer type for Gemma 3)."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    theta = float(getattr(cfg, "rope_theta", None) or 10000.0)
    if "full_attention" in params:  # per layer type
        full = _rope(params["full_attention"], theta)
        local = _rope(params.get("sliding_attention", {}), float(getattr(cfg, "rope_local_base_freq", 10000.0)))
        return full, local
    scaling = dict(getattr(cfg, "rope_scaling", None) or {})
    if "type" in scaling:  # the legacy key: it names the scaling that overrides rope_parameters' (default) type
        scaling.setdefault("rope_type", scaling.pop("type"))
    full = _rope({**params, **scaling}, theta)
    if arch == "Gemma3ForCausalLM":  # an older Gemma 3 config: rope_local_base_freq for the local layers
        return full, (float(getattr(cfg, "rope_local_base_freq", 10000.0)), None)
    return full, None


def _windows(cfg: Any, arch: str, layers: int) -> tuple[int | None, ...]:
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if arch == "Gemma3ForCausalLM" and not types:
        pattern = int(getattr(cfg, "sliding_window_pattern", getattr(cfg, "_sliding_window_pattern", 6)))
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    if arch == "Gemma2ForCausalLM" and not types:
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if types:
        if len(types) != layers:
            raise ValueError(f"layer_types has {len(types)} entries for {layers} layers")
        return tuple(int(window) if t == "sliding_attention" and window else None for t in types)
    if arch in WINDOW_EVERYWHERE and window:
        return (int(window),) * layers
    return (None,) * layers


# What every family's config gives (the rest have defaults, or are read by some families only).
_REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def model_args(cfg: Any) -> ModelArgs:
    archs = list(getattr(cfg, "architectures", None) or ["LlamaForCausalLM"])
    arch = BARE_DECODERS.get(archs[0], CLASSIFIERS.get(archs[0], archs[0]))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"architecture {arch!r} is not supported; supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    missing = [name for name in _REQUIRED_FIELDS if not isinstance(getattr(cfg, name, None), int)]
    if missing:
        raise ValueError(f"the model's config.json lacks {', '.join(missing)} (integers): the model cannot be built")
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    partial = float((getattr(cfg, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0) or 1.0)
    partial = float(getattr(cfg, "partial_rotary_factor", partial) or partial)
    rotary_dim = int(head_dim * partial)  # HF's rounding (Phi-4-mini: 0.75 of 128)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(f"partial_rotary_factor {partial} gives {rotary_dim} rotary dims of {head_dim}")
    # HF Llama's attention_bias puts a bias on q, k, v and o; Qwen2 has q/k/v biases only.
    llama_bias = arch not in ("Qwen2ForCausalLM",) and bool(getattr(cfg, "attention_bias", False))
    (theta, scaling), local = _ropes(cfg, arch)
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "longrope":
        scaling = {**scaling, "original_max_position_embeddings": _original_positions(cfg, scaling)}
    gemma = arch in GEMMA
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ValueError(f"activation {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    layers = cfg.num_hidden_layers
    windows = _windows(cfg, arch, layers)
    return ModelArgs(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", gemma)),
        qkv_bias=arch == "Qwen2ForCausalLM" or llama_bias,
        o_bias=llama_bias,
        architecture=arch,
        rotary_dim=rotary_dim if rotary_dim != head_dim else 0,
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
        layer_windows=windows if any(w is not None for w in windows) else (),
        local_rope=local if local is not None and any(w is not None for w in windows) else None,
        attn_scale=float(cfg.query_pre_attn_scalar) ** -0.5 if gemma else None,
        attn_softcap=_cap(getattr(cfg, "attn_logit_softcapping", None)) if gemma else None,
        final_softcap=_cap(getattr(cfg, "final_logit_softcapping", None)) if gemma else None,
        embed_scale=math.sqrt(cfg.hidden_size) if gemma else None,
        norm_offset=1.0 if gemma else 0.0,
        sandwich_norms=gemma,
        hidden_act=act,
        **_moe(cfg, arch, layers),
    )


def classifier_head(cfg: Any) -> int:
    """A sequence classifier's outputs, as transformers counts them: ``num_labels`` where the config (or
    ``--hf-overrides``) sets it, else ``id2label``'s entries, else 2."""
    if isinstance(getattr(cfg, "num_labels", None), int):
        return int(cfg.num_labels)
    id2label = getattr(cfg, "id2label", None)
    return len(id2label) if isinstance(id2label, dict) and id2label else 2


def _moe(cfg: Any, arch: str, layers: int) -> dict[str, Any]:
    """Qwen3-MoE: layer ``i`` is sparse unless listed in ``mlp_only_layers``, every ``decoder_sparse_step``-th.
    Mixtral: every layer is sparse, each expert as wide as ``intermediate_size``, the top-k weights renormalized."""
    # transformers >= 5 writes num_experts as num_local_experts.
    experts = int(getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", 0) or 0)
    if arch == "MixtralForCausalLM" and experts:
        return {
            "moe_layers": (True,) * layers,
            "num_experts": experts,
            "experts_per_token": int(cfg.num_experts_per_tok),
            "moe_intermediate_size": int(cfg.intermediate_size),
            "norm_topk_prob": True,
        }
    if arch != "Qwen3MoeForCausalLM":
        experts = 0
    if not experts:
        return {}
    step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(cfg, "mlp_only_layers", None) or [])
    return {
        "moe_layers": tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)),
        "num_experts": experts,
        "experts_per_token": int(cfg.num_experts_per_tok),
        "moe_intermediate_size": int(cfg.moe_intermediate_size),
        "norm_topk_prob": bool(getattr(cfg, "norm_topk_prob", False)),
    }


def renamer(arch: str) -> Callable[[str], str]:
    """A checkpoint tensor's name -> the shared decoder's (``CHECKPOINT_RENAMES``)."""
    renames = [_BARE_NAMES]
    renames += [(re.compile(pattern), repl) for pattern, repl in CHECKPOINT_RENAMES.get(arch, ())]

    def rename(name: str) -> str:
        for pattern, repl in renames:
            name = pattern.sub(repl, name)
        return name

    return rename


def checkpoint_names(arch: str, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors under the shared decoder's names (``CHECKPOINT_RENAMES``)."""
    rename = renamer(arch)
    for name, tensor in weights:
        yield rename(name), tensor


def _cap(value: Any) -> float | None:
    return float(value) if value else None


def _original_positions(cfg: Any, scaling: dict[str, Any]) -> int:
    found = scaling.get("original_max_position_embeddings") or getattr(cfg, "original_max_position_embeddings", None)
    if not found:
        raise ValueError("longrope scaling needs original_max_position_embeddings")
    return int(found)
