"""Slot tables of the decode kernel and row indices of the PyTorch gathers, as the reference backend
(``torch_ref``) lays them out for a step: whole rows with a shared prefix put back in front, the prefix groups the
kernel attends together, a chunk's queries as kernel rows, windowed rows, and the pool rows a gather reads."""

from __future__ import annotations

import torch

from radixserve.runtime.attention.base import PrefixGroup
from radixserve.runtime.kv_pool import KVPool


def query_rows(kv_slots: torch.Tensor, q_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's queries as kernel decode rows: the chunk's slot table, one row the kernel shares among them (a
    table per query would be q_len x kv_len slots: 512 MB for a 2,048-token chunk after 32K cached tokens), and the
    length each sees (the query at offset ``i`` of ``q_len`` sees ``kv_len - q_len + i + 1`` keys)."""
    kv_len = kv_slots.shape[0]
    lens = torch.arange(kv_len - q_len + 1, kv_len + 1, device=kv_slots.device)
    return kv_slots.reshape(1, kv_len).contiguous(), lens


def windowed(slots: torch.Tensor, lens: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's last ``window`` slots (a decode query sees exactly those), left-aligned, and their count."""
    width = min(window, slots.shape[1])
    start = (lens - window).clamp(min=0)
    index = (start[:, None] + torch.arange(width, device=slots.device)[None, :]).clamp(max=slots.shape[1] - 1)
    return slots.gather(1, index).contiguous(), torch.clamp(lens, max=window)


def kv_rows(slots: torch.Tensor, pool: KVPool) -> torch.Tensor:
    """Rows of ``pool.kv[layer].view(-1, head_dim)`` holding the keys, then the values, of ``slots``, head by head:
    gathered, they read as ``[2, Hkv, len(slots), D]``."""
    starts = torch.arange(2 * pool.num_kv_heads, device=slots.device) * pool.slot_rows
    return (starts[:, None] + slots.reshape(1, -1)).reshape(-1)


def full_rows(
    slots: torch.Tensor, lens: torch.Tensor, groups: tuple[PrefixGroup, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode slot tables with each group's shared prefix put back in front of its rows' own slots.

    The compiled kernel reads a row's keys in place, so a shared prefix costs it no gather; read by the rows of a
    group one after another, the prefix comes from cache after the first (1,300 tokens of SmolLM2's K and V are
    ~1 MB a layer in bfloat16). Attending to whole rows in one kernel call beat the cascade's per-layer chain of
    gather, small matmuls and log-sum-exp merges on the 2-core Xeon with AMX (48 requests sharing a 1,300-token
    prompt, 16 at a time, bfloat16: 79 -> 57 ms a decode step). Padding past a row's length is slot 0, never read."""
    if not groups:
        return slots, lens
    b, width = slots.shape
    extra = torch.zeros(b, dtype=lens.dtype, device=lens.device)
    for group in groups:
        extra[group.rows] = group.prefix_slots.shape[0]
    full_lens = lens + extra
    longest = max(group.prefix_slots.shape[0] for group in groups)
    full = torch.zeros(b, longest + width, dtype=slots.dtype, device=slots.device)
    grouped = torch.zeros(b, dtype=torch.bool, device=slots.device)
    for group in groups:
        p = group.prefix_slots.shape[0]
        full[group.rows, :p] = group.prefix_slots
        full[group.rows, p : p + width] = slots[group.rows]
        grouped[group.rows] = True
    alone = (~grouped).nonzero().squeeze(1)
    full[alone, :width] = slots[alone]
    return full, full_lens


def group_table(rows: int, groups: tuple[PrefixGroup, ...]) -> torch.Tensor:
    """Per decode row, (its prefix group or -1, the group's prefix length): the compiled kernel's ``groups``, for
    the whole rows of ``full_rows``, whose first keys are the group's prefix."""
    table = torch.full((rows, 2), -1, dtype=torch.int64)
    table[:, 1] = 0
    for i, group in enumerate(groups):
        table[group.rows, 0] = i
        table[group.rows, 1] = group.prefix_slots.shape[0]
    return table
