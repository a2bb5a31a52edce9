"""The preallocated KV memory and the allocator of its slots.

A *slot* is the index of one token's keys and values in every layer. The pool's tensors are owned by the model
runner (written only inside the forward pass); the free list is owned by the ``SlotAllocator``, which only the
scheduler thread touches (through ``runtime.kv_cache.KVCacheManager``).
"""

from __future__ import annotations

import logging

import torch

from radixserve.runtime import envs, huge_pages

logger = logging.getLogger("radixserve.kv")


class KVPool:
    """The keys and values of every slot in every layer.

    ``kv[layer]`` is ``[2, num_kv_heads, num_slots, head_dim]``: keys then values, head-major, so that gathering a
    list of slots gives attention's ``[heads, tokens, head_dim]`` layout with no transpose, and one gather fetches
    both keys and values. ``k[layer]`` / ``v[layer]`` are ``[num_slots, num_kv_heads, head_dim]`` views of it.
    """

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        scratch_slots: int = 0,
        on_huge_pages: bool = True,
    ) -> None:
        """``on_huge_pages``: a CPU pool on transparent huge pages (``runtime.huge_pages``), which decode steps stream
        faster; an engine that never decodes (embeddings) keeps 4 KB pages, whose first touch costs a VM less."""
        if num_slots < 1:
            raise ValueError(f"the KV pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        # Slots ``[num_slots, num_slots + scratch_slots)`` are never handed out: the padding rows of a CUDA graph's
        # batch write and read there (``scratch_slot``).
        self.scratch_slot = num_slots
        self.slot_rows = num_slots + scratch_slots  # the slot dimension of ``kv[layer]`` (its head stride in rows)
        shape = (num_layers, 2, num_kv_heads, num_slots + scratch_slots, head_dim)
        # Uninitialized on purpose (pages are committed lazily, so start-up stays fast): a slot is always written
        # before any attention reads it, and padded gathers point at a real, written slot of the same sequence.
        # On CPU on transparent huge pages: a decode step streams the rows' keys and values (runtime.huge_pages).
        if device.type == "cpu" and on_huge_pages and envs.kv_huge_pages():
            self._kv = huge_pages.empty(shape, dtype)
        else:
            self._kv = torch.empty(shape, dtype=dtype, device=device)
        self.kv = list(self._kv.unbind(0))
        self.k = [kv[0].transpose(0, 1) for kv in self.kv]
        self.v = [kv[1].transpose(0, 1) for kv in self.kv]
        from radixserve.runtime.models import fused  # (here: the models import the pool)

        # On CPU one pass of row copies (``fused.store_kv``; ~6x index_copy_'s pair for a 2,048-token chunk).
        self._store_kv = fused.store_kv if self._kv.is_cpu else None

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write one step's keys and values ``[T, kv_heads, head_dim]`` of ``layer`` into ``slots`` [T]."""
        if slots.numel():
            kv = self.kv[layer]
            if self._store_kv is not None and self._store_kv(kv, slots, k, v):
                return
            kv[0].index_copy_(1, slots, k.transpose(0, 1))
            kv[1].index_copy_(1, slots, v.transpose(0, 1))

    @property
    def layers(self) -> torch.Tensor:
        """Every layer's keys and values, ``[num_layers, 2, num_kv_heads, num_slots, head_dim]`` (``kv`` is its
        per-layer views)."""
        return self._kv

    @property
    def nbytes(self) -> int:
        return self._kv.nbytes

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class SlotAllocator:
    """Free list of slot ids ``[0, num_slots)``.

    Invariant: a slot is either in the free list or owned by exactly one holder (a request or the radix tree).
    Freeing a slot twice, or one that was never allocated, is a bug in the caller and raises ``RuntimeError``
    when ``strict`` (tests and ``RADIXSERVE_CHECK_INTEGRITY``); otherwise the check is skipped for speed.
    """

    def __init__(self, num_slots: int, strict: bool = False) -> None:
        self.num_slots = num_slots
        # Popped from the end: the lowest slots are handed out first, which keeps gathers local.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._strict = strict
        self._is_free = [True] * num_slots if strict else None

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """``n`` slots, or ``None`` (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        if n == 0:
            return []
        out = self._free[-n:]
        del self._free[-n:]
        if self._is_free is not None:
            for s in out:
                self._is_free[s] = False
        return out

    def free(self, slots: list[int]) -> None:
        if self._is_free is not None:
            for s in slots:
                if self._is_free[s]:
                    raise RuntimeError(f"slot {s} freed twice")
                self._is_free[s] = True
        self._free.extend(slots)

    def free_slots(self) -> list[int]:
        return list(self._free)
