"""Rotary position embeddings (the rotate-half layout HF Llama checkpoints use), with llama3, linear and Phi-3's
longrope scaling."""

from __future__ import annotations

import math
from typing import Any

import torch


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths are slowed by ``factor``, short ones kept, a smooth band
    in between."""
    factor = float(params["factor"])
    low = float(params.get("low_freq_factor", 1.0))
    high = float(params.get("high_freq_factor", 4.0))
    original = float(params.get("original_max_position_embeddings", 8192))
    low_wavelen = original / low
    high_wavelen = original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _longrope_freqs(
    t: torch.Tensor, exponents: torch.Tensor, theta: float, params: dict[str, Any], max_positions: int
) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: per-frequency stretch factors, ``short_factor`` for positions within the original context
    and ``long_factor`` past it (as vLLM does; HF switches all positions once a sequence outgrows the original),
    and cos/sin scaled by the attention factor."""
    original = int(params["original_max_position_embeddings"])
    short = torch.tensor(params["short_factor"], dtype=torch.float64)
    long = torch.tensor(params["long_factor"], dtype=torch.float64)
    base = theta**exponents
    freqs = torch.outer(t, 1.0 / (short * base))
    past = t >= original
    if past.any():
        freqs[past] = torch.outer(t[past], 1.0 / (long * base))
    factor = max_positions / original  # what HF takes when the config has the original length (Phi-3 does)
    magnitude = params.get("attention_factor")
    if magnitude is None:
        magnitude = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return freqs, float(magnitude)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables for positions ``[0, max_positions)``. Tables are float32 and cast to the
    activations' dtype once. ``forward`` looks up the rows of a batch's positions once per forward pass;
    ``apply_rope`` rotates with them in every layer."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self._spec = (head_dim, max_positions, theta, scaling)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("signed_sin", torch.empty(0), persistent=False)
        if self.cos.device.type != "meta":  # on meta (ops there run as slow Python decompositions) wait for storage
            self.reset_tables(dtype)

    def reset_tables(self, dtype: torch.dtype, device: torch.device | None = None) -> None:
        """(Re)compute the tables, on ``device`` (default: where they are). A model built on the meta device calls
        this with its real device: the tables are not in the checkpoint."""
        head_dim, max_positions, theta, scaling = self._spec
        device = device if device is not None else self.cos.device
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
        inv_freq = 1.0 / (theta**exponents)
        params = scaling or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        t = torch.arange(max_positions, dtype=torch.float64)
        magnitude = 1.0
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        elif rope_type == "linear":
            inv_freq = inv_freq / float(params["factor"])
        elif rope_type == "longrope":
            freqs, magnitude = _longrope_freqs(t, exponents, theta, params, max_positions)
        elif rope_type not in ("default", None):
            raise ValueError(
                f"unsupported rope scaling type {rope_type!r} (supported: default, linear, llama3, longrope)"
            )
        if rope_type != "longrope":
            freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        # sin with its first half negated: rotate_half(x) * sin == swap_halves(x) * signed_sin, bit for bit
        # (negating is exact), which saves the negation of x in every layer.
        signed_sin = emb.sin() * magnitude
        signed_sin[:, : head_dim // 2].neg_()
        self.cos = (emb.cos() * magnitude).to(dtype=dtype, device=device)
        self.signed_sin = signed_sin.to(dtype=dtype, device=device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, signed_sin)`` rows of ``positions`` [T], shaped [T, 1, D] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half RoPE, ``x * cos + rotate_half(x) * sin``, on ``x`` [T, heads, D]; returns a new tensor."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin
