"""The attention backend interface: how one forward pass's flat token batch maps onto sequences and KV slots.

The model code calls ``ForwardContext.attend`` once per layer and knows nothing else about batching or memory.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve.runtime.kv_pool import KVPool


@dataclass(frozen=True)
class ExtendSeq:
    """One sequence computing ``q_len`` new tokens (a prefill chunk), attending to ``kv_len`` tokens in all.

    ``kv_slots`` lists the KV slot of every one of the ``kv_len`` tokens (cached prefix first, new tokens last);
    it is ``None`` when nothing precedes the chunk (``kv_len == q_len``), so the backend can use the fresh K/V.
    """

    q_start: int
    q_len: int
    kv_len: int
    kv_slots: torch.Tensor | None


@dataclass(frozen=True)
class PrefixGroup:
    """Decode rows whose sequences start with the same ``prefix_slots`` (a prefix shared through the radix cache).

    Their attention over the shared prefix is computed once against one copy of its K/V; each row's own
    ``decode_slots`` then hold only the slots after the prefix.
    """

    rows: torch.Tensor  # [b] int64, indices into the decode rows
    prefix_slots: torch.Tensor  # [P] int64


# What the compiled CPU decode-attention kernel takes for a step's decode rows: whole slot rows [B, W], their lengths
# [B], and per row (its prefix group or -1, the group's prefix length) [B, 2] where groups attend their shared prefix
# together (``decode_attention``'s ``groups``), else None.
KernelRows = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


@dataclass(frozen=True)
class AttentionMetadata:
    """Layout of the ``T`` tokens of one forward pass.

    Invariants: tokens ``[0, num_decode)`` are decode tokens, one per sequence, in the row order of
    ``decode_slots``; tokens ``[num_decode, T)`` belong to ``extends`` in order, contiguous. ``out_slots[t]`` is
    the slot where token ``t``'s K/V is written before attention runs, so every sequence sees its own new tokens.
    """

    out_slots: torch.Tensor  # [T] int64
    num_decode: int
    decode_slots: torch.Tensor | None  # [Bd, Lmax] int64, padded with any valid slot
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, Lmax] bool, True where a real token sits; None: see ``mask``
    extends: tuple[ExtendSeq, ...]
    # Shared-prefix groups among the decode rows; a grouped row's decode_slots exclude its group's prefix.
    prefix_groups: tuple[PrefixGroup, ...] = ()
    # [Bd] int64: each decode row's length (decode_mask's count), where the layout had it at hand; None: count the
    # mask. With it the layout leaves decode_mask to ``mask``: the compiled CPU kernel reads lengths, and a step's
    # host work runs with cold caches (each torch op tens of microseconds after the weights went through).
    decode_lens: torch.Tensor | None = None

    def mask(self) -> torch.Tensor | None:
        """``decode_mask``, made from ``decode_lens`` where the layout left it out."""
        if self.decode_mask is not None or self.decode_lens is None or self.decode_slots is None:
            return self.decode_mask
        width = self.decode_slots.shape[1]
        return (torch.arange(width, device=self.decode_lens.device)[None, :] < self.decode_lens[:, None])[
            :, None, None, :
        ]

    def lens(self) -> torch.Tensor | None:
        """Each decode row's length: ``decode_lens``, or the mask's count."""
        if self.decode_lens is not None or self.decode_mask is None or self.decode_slots is None:
            return self.decode_lens
        return self.decode_mask.reshape(self.decode_slots.shape).sum(dim=1)


@dataclass(frozen=True)
class AttnOptions:
    """How one layer attends, when it is not plain causal attention scaled by ``head_dim ** -0.5``.

    ``window``: a query sees only the last ``window`` keys (itself included), as HF's sliding-window layers do
    (Mistral, Phi-3, Gemma's local layers); ``scale``: the score scale (Gemma's ``query_pre_attn_scalar``);
    ``softcap``: scores become ``softcap * tanh(score / softcap)`` before the softmax (Gemma 2).
    """

    window: int | None = None
    scale: float | None = None
    softcap: float | None = None

    @property
    def plain(self) -> bool:
        return self.window is None and self.scale is None and self.softcap is None


PLAIN = AttnOptions()


class AttentionBackend(ABC):
    """Stores this step's K/V into the pool and computes attention for every token of the batch."""

    # CUDA: plain decode steps may replay captured graphs (``runtime.cuda_graph``) beside this backend's steps.
    graph_capturable: bool = False

    def prepare(self, meta: AttentionMetadata, pool: KVPool) -> Any:
        """Per-step work shared by every layer (gather indices, masks), done once per forward pass; its result
        is handed to each ``forward`` call of that pass as ``state``."""
        return None

    def kernel_decode_rows(self, meta: AttentionMetadata, state: Any) -> KernelRows | None:
        """(slots [B, W], lens [B], groups [B, 2] or None) when every row of this step is a decode row that the
        compiled CPU decode kernel attends with that slot table and those prefix groups
        (``runtime.models.decode_stack`` then runs the layers in one call); else None."""
        return None

    @abstractmethod
    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, H, D], RoPE applied
        k: torch.Tensor,  # [T, Hkv, D], RoPE applied
        v: torch.Tensor,  # [T, Hkv, D]
        meta: AttentionMetadata,
        pool: KVPool,
        state: Any = None,  # what ``prepare`` returned for this meta and pool; computed on the spot when None
        options: AttnOptions = PLAIN,
    ) -> torch.Tensor:  # [T, H, D]
        ...


@dataclass
class ForwardContext:
    """What a model's attention layers need for one forward pass; built by the model runner per step."""

    meta: AttentionMetadata
    pool: KVPool
    backend: AttentionBackend
    # The step's LoRA rows (``runtime.lora.LoRABatch``), None when no row uses an adapter.
    lora: Any = None
    # The rows whose final hidden states the step reads (``ModelRunner``), None: all. A model that reads it
    # (``trims_rows``) runs its last layer's MLP for those rows only and returns theirs.
    out_rows: torch.Tensor | None = None
    _state: Any = field(default=None, init=False, repr=False)
    _prepared: bool = field(default=False, init=False, repr=False)

    def _prepare(self) -> Any:
        if not self._prepared:
            self._state, self._prepared = self.backend.prepare(self.meta, self.pool), True
        return self._state

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: AttnOptions = PLAIN
    ) -> torch.Tensor:
        return self.backend.forward(layer, q, k, v, self.meta, self.pool, self._prepare(), options)

    def kernel_decode_rows(self) -> KernelRows | None:
        """The backend's ``kernel_decode_rows`` for this step (preparing it), or None."""
        if self.meta.extends or not self.meta.num_decode:
            return None
        return self.backend.kernel_decode_rows(self.meta, self._prepare())
