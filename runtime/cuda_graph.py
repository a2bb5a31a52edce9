"""Decode steps on CUDA as graph replays: a step's launches (every layer's, ~10 each) replayed in one call.

A decode step of a small batch launches a few hundred kernels that each run for microseconds, so launching them
from Python costs more than running them. ``DecodeGraphs`` captures the model's forward once per batch-size
bucket and replays the graph of the smallest bucket that holds the step; rows past the step's batch are padding
that writes and reads the pool's scratch slot.

A captured graph reads fixed addresses, so every input a step changes lives in persistent device buffers:

* ``io`` ([5, max_bs] int64): token ids, positions, the slot each row's new K/V goes to, its row of the slot
  table and its length; one non-blocking copy from pinned host memory fills it per step;
* ``SlotTable``: every request's slots by position (SGLang's req_to_token), on the device, written only where
  a request's slots are new, so a decode step copies a few bytes per row, not its whole context.

The attention of a graph step is ``triton_decode.decode_attention``, whose grid depends on the batch size
only. Everything else is the model's ordinary forward; sampling stays outside the graph.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.runtime.attention.base import PLAIN, AttentionBackend, AttentionMetadata, AttnOptions, ForwardContext
from radixserve.runtime.attention.triton_decode import decode_attention, num_splits
from radixserve.runtime.batch import BatchPlan
from radixserve.runtime.kv_pool import KVPool
from radixserve.runtime.request import Req

logger = logging.getLogger("radixserve.engine")

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


@dataclass
class _Entry:
    req: Req
    slots: list[int]  # the list object whose entries were copied: a request given a new list is copied anew
    row: int
    synced: int  # entries [0, synced) of the row hold slots[0:synced]


class SlotTable:
    """``table[row, p]``: the KV slot of position ``p`` of the request that holds ``row``; row ``pad_row`` is the
    padding rows', all scratch slot.

    Invariant it relies on (``runtime.kv_cache``): the first ``num_computed`` entries of one ``req.slots`` list
    never change; a request whose slots move (a cached prefix replacing its own copies, a release, a readmission)
    gets a new list object. So an entry stays valid while the request keeps the same list, and only the positions
    past ``synced`` are copied."""

    def __init__(self, rows: int, width: int, scratch_slot: int, device: torch.device) -> None:
        self.width = width
        self.pad_row = rows
        self.table = torch.full((rows + 1, width), scratch_slot, dtype=torch.int32, device=device)
        self._free = list(range(rows - 1, -1, -1))
        self._entries: dict[str, _Entry] = {}
        # Pinned staging for new slots, two buffers used in turn (see ``DecodeGraphs``: a buffer is written again
        # only after the step that copied out of it was read back).
        self._staging = [torch.empty(3, 4096, dtype=torch.int64, pin_memory=self.table.is_cuda) for _ in range(2)]
        self._turn = 0

    def sync(self, reqs: list[tuple[Req, int]], last_on_device: bool = False) -> list[int]:
        """Make each request's row hold its slots up to ``end`` (exclusive); returns the rows, in order. With
        ``last_on_device`` the entry at ``end - 1`` is left to the caller, who writes it on the device (a decode
        step's new slot, which the graph writes from its inputs): a steady decode step copies nothing here."""
        last = 1 if last_on_device else 0
        live = {req.rid for req, _ in reqs}
        out: list[int] = []
        at_row: list[int] = []
        at_pos: list[int] = []
        values: list[int] = []
        for req, end in reqs:
            entry = self._entries.get(req.rid)
            if entry is None or entry.req is not req or entry.slots is not req.slots:
                row = entry.row if entry is not None else self._take_row(live)
                entry = self._entries[req.rid] = _Entry(req, req.slots, row, 0)
            if entry.synced < end:
                if end > self.width:
                    raise ValueError(f"position {end - 1} is past the slot table's {self.width} columns")
                new = req.slots[entry.synced : end - last]
                at_row.extend([entry.row] * len(new))
                at_pos.extend(range(entry.synced, end - last))
                values.extend(new)
                entry.synced = end
            out.append(entry.row)
        if values:
            n = len(values)
            self._turn ^= 1
            if self._staging[self._turn].shape[1] < n:  # grown, never shrunk: new requests' rows pass through
                size = max(n, 2 * self._staging[self._turn].shape[1])
                self._staging[self._turn] = torch.empty(3, size, dtype=torch.int64, pin_memory=self.table.is_cuda)
            staged = self._staging[self._turn][:, :n]
            staged.numpy()[:] = (at_row, at_pos, values)
            update = staged.to(self.table.device, non_blocking=True)
            self.table[update[0], update[1]] = update[2].to(torch.int32)
        return out

    def _take_row(self, live: set[str]) -> int:
        if not self._free:
            # Rows of requests that are not in this step (finished, waiting, retracted) are copied again if they
            # come back: their entries go.
            for rid in [rid for rid in self._entries if rid not in live]:
                self._free.append(self._entries.pop(rid).row)
        if not self._free:
            raise RuntimeError("more requests in one step than the slot table has rows")
        return self._free.pop()


class GraphDecodeBackend(AttentionBackend):
    """Attention of a graph step: K/V stored into the pool at ``out_slots``, then ``decode_attention`` over the
    slot table (the buffers are the graph's, set per step before the replay)."""

    def __init__(self, table: SlotTable, rows: torch.Tensor, lens: torch.Tensor, splits: int) -> None:
        self.table, self.rows, self.lens, self.splits = table, rows, lens, splits

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        pool: KVPool,
        state: Any = None,
        options: AttnOptions = PLAIN,
    ) -> torch.Tensor:
        pool.store(layer, meta.out_slots, k, v)
        scale = options.scale if options.scale is not None else q.shape[-1] ** -0.5
        return decode_attention(
            q if q.stride(-1) == 1 else q.contiguous(), pool.kv[layer], self.table.table, self.rows, self.lens,
            self.splits, scale, options.softcap or 0.0, options.window or 0,
        )  # fmt: skip


class DecodeGraphs:
    """The captured decode graphs of one model and pool, by batch size."""

    def __init__(self, model: Any, pool: KVPool, max_bs: int, max_context: int, device: torch.device) -> None:
        self.model, self.pool, self.device = model, pool, device
        self.buckets = sorted({b for b in BUCKETS if b < max_bs} | {max_bs})
        self.max_bs = max_bs
        self.table = SlotTable(max_bs, max_context + 1, pool.scratch_slot, device)
        self.io = torch.zeros(5, max_bs, dtype=torch.int64, device=device)
        # Two pinned staging buffers for ``io``, used in turn. With the overlap a step is launched before the one
        # before it is read back, so that one's copy out of its buffer may still be pending; the step before
        # that was read back before this launch, and its copy, queued ahead of it, is done.
        self._hosts = [torch.zeros(5, max_bs, dtype=torch.int64, pin_memory=device.type == "cuda") for _ in range(2)]
        self._turn = 0
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def capture(self) -> None:
        """Capture every bucket, largest first (the others reuse its memory pool)."""
        start = time.perf_counter()
        mempool = None
        for bs in reversed(self.buckets):
            host, h = self._next_host()
            self._pad(h, 0, bs)
            self.io[:, :bs].copy_(host[:, :bs])
            with torch.inference_mode():
                stream = torch.cuda.Stream(self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    for _ in range(2):  # Triton compiles, cuBLAS picks its kernels: none of that may be captured
                        self._forward(bs)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=mempool):
                    out = self._forward(bs)
            mempool = graph.pool()
            self._graphs[bs] = (graph, out)
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured CUDA graphs for decode batches of %s in %.1fs",
            ", ".join(map(str, self.buckets)),
            time.perf_counter() - start,
        )

    def _forward(self, bs: int) -> torch.Tensor:
        io = self.io
        # Each row's new slot into its table row, on the device (``SlotTable.sync(last_on_device=True)``); the
        # padding rows write the scratch slot into the padding row.
        self.table.table[io[3, :bs], io[1, :bs]] = io[2, :bs].to(torch.int32)
        meta = AttentionMetadata(
            out_slots=io[2, :bs], num_decode=bs, decode_slots=None, decode_mask=None, extends=()
        )
        splits = num_splits(bs, self.pool.num_kv_heads, self.device)
        backend = GraphDecodeBackend(self.table, io[3, :bs], io[4, :bs], splits)
        return self.model(io[0, :bs], io[1, :bs], ForwardContext(meta, self.pool, backend))

    def fits(self, plan: BatchPlan) -> bool:
        """Whether the step is plain decode (one token per request, no drafts) of at most ``max_bs`` rows."""
        return len(plan.chunks) <= self.max_bs and all(c.is_decode and not c.draft for c in plan.chunks)

    def run(self, plan: BatchPlan, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The step's final hidden states [B, hidden] (a view of the graph's output: read it before the next).
        ``tokens``: the rows' input ids on the device, when they are the step before's output, not read back yet
        (``EngineCore``'s overlap); else they are read from the requests."""
        b = len(plan.chunks)
        bs = next(x for x in self.buckets if x >= b)
        rows = self.table.sync([(c.req, c.end) for c in plan.chunks], last_on_device=True)
        host, h = self._next_host()
        for i, c in enumerate(plan.chunks):
            req, p = c.req, c.start
            if tokens is None:
                n = len(req.prompt_ids)
                h[0, i] = req.prompt_ids[p] if p < n else req.output_ids[p - n]  # all_ids[p], without copying it
            h[1, i] = c.start
            h[2, i] = c.req.slots[c.start]
            h[3, i] = rows[i]
            h[4, i] = c.end
        self._pad(h, b, bs)
        self.io[:, :bs].copy_(host[:, :bs], non_blocking=True)
        if tokens is not None:
            self.io[0, :b].copy_(tokens)
        if not self._graphs:  # not captured (the CPU tests): the same forward, run eagerly
            return self._forward(bs)[:b]
        graph, out = self._graphs[bs]
        graph.replay()
        return out[:b]

    def _next_host(self) -> tuple[torch.Tensor, Any]:
        """The staging buffer whose turn it is, and its numpy view."""
        self._turn ^= 1
        host = self._hosts[self._turn]
        return host, host.numpy()

    def _pad(self, h: Any, start: int, end: int) -> None:
        """Rows ``[start, end)`` of the staging buffer ``h`` (numpy) as padding: token 0 at position 0 into the
        scratch slot."""
        h[0:2, start:end] = 0
        h[2, start:end] = self.pool.scratch_slot
        h[3, start:end] = self.table.pad_row
        h[4, start:end] = 1
