"""Rotary position embeddings (the rotate-half layout HF Llama checkpoints use), with llama3 and linear scaling."""

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
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling or {})
        elif rope_type == "linear":
            inv_freq = inv_freq / float((scaling or {})["factor"])
        elif rope_type not in ("default", None):
            raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, linear, llama3)")
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        # sin with its first half negated: rotate_half(x) * sin == swap_halves(x) * signed_sin, bit for bit
        # (negating is exact), which saves the negation of x in every layer.
        signed_sin = emb.sin()
        signed_sin[:, : head_dim // 2].neg_()
        self.cos = emb.cos().to(dtype=dtype, device=device)
        self.signed_sin = signed_sin.to(dtype=dtype, device=device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, signed_sin)`` rows of ``positions`` [T], shaped [T, 1, D] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half RoPE, ``x * cos + rotate_half(x) * sin``, on ``x`` [T, heads, D]; returns a new tensor."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin
