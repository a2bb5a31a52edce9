"""Paged attention in Triton, for CUDA (``--attention-backend triton``; the default on a GPU where Triton imports).

One kernel does every kind of attention a step needs, over the KV pool in place (no gather, no mask tensor):

* A **work item** is a set of query rows against a run of keys: ``n_q`` partial rows from ``p0`` (each names its
  query row and position through ``q_row`` / ``q_pos``) against ``n_k`` keys whose slots are
  ``slots[slot_off : slot_off + n_k]`` at positions ``k_pos0, k_pos0 + 1, ...``. Causality and windows are
  masks on those positions, so prefill chunks over a cached prefix, decode rows and shared prefixes are one code
  path.
* Each item writes each of its rows' output, normalized over the item's keys, and its log-sum-exp (a
  *partial*). ``_merge`` combines a row's partials exactly, as flash-decoding does.
* **Decode rows** are split along their context into items of ``SPLIT_KEYS`` keys, so a long row keeps many
  programs busy.
* **Prefill chunks** are items of ``EXTEND_BLOCK_M`` queries over the whole sequence, launched apart from the
  decode rows' items with larger tiles (``EXTEND_BLOCK_M`` x ``EXTEND_BLOCK_N``): a prefill item is bound by its
  matmuls, a decode item by reading its keys.
* **Cascade:** the decode rows of a prefix group (``PrefixGroup``: one radix-tree node's slots) share items over
  that prefix, ``BLOCK_M`` rows to an item, so the prefix's K/V is read once per item instead of once per row.
  Their own slots follow as items of their own.

The grid is (items, query heads). A program loops over its keys in blocks of ``BLOCK_N`` with an online softmax
in float32. ``tests/test_triton_attention.py`` checks it against ``TorchReferenceBackend`` under Triton's
interpreter (``TRITON_INTERPRET=1``), on the CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixserve.runtime.attention.base import PLAIN, AttentionBackend, AttentionMetadata, AttnOptions
from radixserve.runtime.kv_pool import KVPool

# Triton's interpreter (the tests, on the CPU) computes 16-bit dot products wrongly: there they run in float32.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_M = 16  # query rows per item of decode rows (a cascade item takes up to this many rows)
BLOCK_N = 32  # keys per inner step
EXTEND_BLOCK_M = 64  # query rows per item of a prefill chunk
EXTEND_BLOCK_N = 64
SPLIT_KEYS = 256  # keys per item of a decode row


@triton.jit
def _paged_attention_kernel(
    q, kv, slots, q_row, q_pos, items, out, lse,
    stride_qt, stride_qh, stride_kv2, stride_kvh, stride_kvs, stride_ot, stride_oh, stride_lp,
    scale, softcap, window, G,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EXACT: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    item = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // G
    p0 = tl.load(items + item * 5 + 0)
    n_q = tl.load(items + item * 5 + 1)
    slot_off = tl.load(items + item * 5 + 2)
    n_k = tl.load(items + item * 5 + 3)
    k_pos0 = tl.load(items + item * 5 + 4)

    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < n_q
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < D
    qr = tl.load(q_row + p0 + rows, mask=row_ok, other=0).to(tl.int64)
    qp = tl.load(q_pos + p0 + rows, mask=row_ok, other=-1)
    qv = tl.load(q + qr[:, None] * stride_qt + h * stride_qh + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :],
                 other=0.0)  # fmt: skip
    if UPCAST:
        qv = qv.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys past the item's last query are masked anyway: stop there.
    last = tl.minimum(n_k, tl.max(qp) - k_pos0 + 1)
    for start in range(0, last, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < n_k
        slot = tl.load(slots + slot_off + cols, mask=col_ok, other=0).to(tl.int64)
        base = kv + hk * stride_kvh + slot[:, None] * stride_kvs + dims[None, :]
        kk = tl.load(base, mask=col_ok[:, None] & dim_ok[None, :], other=0.0)
        vv = tl.load(base + stride_kv2, mask=col_ok[:, None] & dim_ok[None, :], other=0.0)
        if UPCAST:
            kk, vv = kk.to(tl.float32), vv.to(tl.float32)
        # float32 models multiply in IEEE float32 (the parity with transformers); 16-bit ones in their dtype, summed
        # in float32
        if EXACT:  # noqa: SIM108 - a compile-time branch of the kernel
            s = tl.dot(qv, tl.trans(kk), input_precision="ieee") * scale
        else:
            s = tl.dot(qv, tl.trans(kk)) * scale
        if softcap > 0:
            s = softcap * (2.0 / (1.0 + tl.exp(-2.0 * s / softcap)) - 1.0)  # softcap * tanh(s / softcap)
        kp = k_pos0 + cols
        visible = col_ok[None, :] & (kp[None, :] <= qp[:, None]) & row_ok[:, None]
        if window > 0:
            visible = visible & (kp[None, :] > qp[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays empty
        p = tl.exp(s - safe[:, None])
        alpha = tl.exp(m_i - safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if EXACT:
            acc = acc * alpha[:, None] + tl.dot(p, vv, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv)
        m_i = m_new
    norm = tl.where(l_i > 0, l_i, 1.0)
    o = acc / norm[:, None]
    pr = (p0 + rows).to(tl.int64)
    tl.store(out + pr[:, None] * stride_ot + h * stride_oh + dims[None, :], o, mask=row_ok[:, None] & dim_ok[None, :])
    tl.store(lse + pr * stride_lp + h, tl.where(l_i > 0, m_i + tl.log(norm), float("-inf")), mask=row_ok)


@dataclass
class _Plan:
    """One step's work items (shared by every layer), on the device."""

    q_row: torch.Tensor  # [P] int32: the query row of each partial row
    q_pos: torch.Tensor  # [P] int32: its position
    dest: torch.Tensor  # [P] int64: the output row it contributes to
    items: torch.Tensor  # [I, 5] int32: (p0, n_q, slot_off, n_k, k_pos0), of decode rows (BLOCK_M)
    extend_items: torch.Tensor  # [J, 5] int32: the same, of prefill chunks (EXTEND_BLOCK_M)
    slots: torch.Tensor  # [S] int32: every item's key slots, one run after another
    single: bool  # every output row has exactly one partial row, in order (no merge needed)


class _PlanBuilder:
    def __init__(self) -> None:
        self.q_row: list[int] = []
        self.q_pos: list[int] = []
        self.dest: list[int] = []
        self.items: list[tuple[int, int, int, int, int]] = []
        self.extend_items: list[tuple[int, int, int, int, int]] = []
        self.slots: list[torch.Tensor] = []
        self.n_slots = 0

    def key_run(self, slots: torch.Tensor) -> int:
        off = self.n_slots
        self.slots.append(slots.reshape(-1))
        self.n_slots += slots.numel()
        return off

    def item(self, rows: list[tuple[int, int]], slot_off: int, n_k: int, k_pos0: int, extend: bool = False) -> None:
        """Query rows ``(row, position)`` against ``n_k`` keys from ``slot_off`` at positions ``k_pos0...``."""
        p0 = len(self.q_row)
        for row, pos in rows:
            self.q_row.append(row)
            self.q_pos.append(pos)
            self.dest.append(row)
        (self.extend_items if extend else self.items).append((p0, len(rows), slot_off, n_k, k_pos0))

    def build(self, device: torch.device, num_rows: int) -> _Plan:
        i32 = dict(dtype=torch.int32, device=device)
        dest = torch.tensor(self.dest, dtype=torch.int64, device=device)
        single = self.dest == list(range(num_rows))
        slots = torch.cat(self.slots).to(**i32) if self.slots else torch.zeros(1, **i32)
        return _Plan(torch.tensor(self.q_row, **i32), torch.tensor(self.q_pos, **i32), dest,
                     torch.tensor(self.items, **i32).reshape(-1, 5),
                     torch.tensor(self.extend_items, **i32).reshape(-1, 5), slots, single)  # fmt: skip


def plan_step(meta: AttentionMetadata, device: torch.device, cascade: bool = True) -> _Plan:
    """The work items of one step (see the module docstring)."""
    b = _PlanBuilder()
    num_rows = meta.num_decode + sum(s.q_len for s in meta.extends)
    if meta.num_decode:
        row_lens = meta.lens()
        assert meta.decode_slots is not None and row_lens is not None
        lens = row_lens.tolist()
        prefix_len = [0] * meta.num_decode
        for group in meta.prefix_groups if cascade else ():
            rows = group.rows.tolist()
            plen = group.prefix_slots.numel()
            off = b.key_run(group.prefix_slots)
            for i in range(0, len(rows), BLOCK_M):
                # A grouped row's position is past its whole prefix: every prefix key is visible to it.
                b.item([(r, plen + lens[r] - 1) for r in rows[i : i + BLOCK_M]], off, plen, 0)
            for r in rows:
                prefix_len[r] = plen
        for r in range(meta.num_decode):
            n, p = lens[r], prefix_len[r]
            off = b.key_run(meta.decode_slots[r, :n])
            for k0 in range(0, n, SPLIT_KEYS):
                b.item([(r, p + n - 1)], off + k0, min(SPLIT_KEYS, n - k0), p + k0)
    for seq in meta.extends:
        slots = seq.kv_slots if seq.kv_slots is not None else meta.out_slots[seq.q_start : seq.q_start + seq.q_len]
        off = b.key_run(slots)
        first = seq.kv_len - seq.q_len
        for i in range(0, seq.q_len, EXTEND_BLOCK_M):
            rows = [(seq.q_start + j, first + j) for j in range(i, min(seq.q_len, i + EXTEND_BLOCK_M))]
            b.item(rows, off, seq.kv_len, 0, extend=True)
    return b.build(device, num_rows)


def paged_attention(
    q: torch.Tensor, kv: torch.Tensor, plan: _Plan, scale: float, softcap: float, window: int
) -> torch.Tensor:
    """Every query row of ``q`` [T, H, D] attended over the pool layer ``kv`` [2, Hkv, S, D] as ``plan`` says."""
    t, h, d = q.shape
    parts = plan.q_row.numel()
    out = torch.empty(parts, h, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(parts, h, dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(d))
    launches = ((plan.items, BLOCK_M, BLOCK_N), (plan.extend_items, EXTEND_BLOCK_M, EXTEND_BLOCK_N))
    for items, block_m, block_n in launches:
        if not items.shape[0]:
            continue
        _paged_attention_kernel[(items.shape[0], h)](
            q, kv, plan.slots, plan.q_row, plan.q_pos, items, out, lse,
            q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2), out.stride(0), out.stride(1),
            lse.stride(0), scale, softcap, window, h // kv.shape[1],
            D=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
            EXACT=q.dtype == torch.float32, UPCAST=INTERPRETED and q.dtype != torch.float32,
        )  # fmt: skip
    if plan.single:
        return out.to(q.dtype)
    return _merge(out, lse, plan.dest, t).to(q.dtype)


def _merge(out: torch.Tensor, lse: torch.Tensor, dest: torch.Tensor, rows: int) -> torch.Tensor:
    """Each output row from its partials: weights exp(lse - max lse) over the row's partials, normalized."""
    h = out.shape[1]
    top = torch.full((rows, h), float("-inf"), device=out.device)
    top.scatter_reduce_(0, dest[:, None].expand(-1, h), lse, "amax")
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w = torch.exp(lse - top[dest])  # [P, H]; an empty partial has lse -inf: weight 0
    num = torch.zeros(rows, h, out.shape[2], device=out.device).index_add_(0, dest, out * w[..., None])
    den = torch.zeros(rows, h, device=out.device).index_add_(0, dest, w)
    return num / den.clamp(min=1e-30)[..., None]


class TritonBackend(AttentionBackend):
    """``AttentionBackend`` over ``paged_attention``: K/V written into the pool, then one launch per layer."""

    graph_capturable = True

    def __init__(self, cascade: bool = True) -> None:
        self.cascade = cascade

    def prepare(self, meta: AttentionMetadata, pool: KVPool) -> _Plan:
        return plan_step(meta, meta.out_slots.device, self.cascade)

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        pool: KVPool,
        state: _Plan | None = None,
        options: AttnOptions = PLAIN,
    ) -> torch.Tensor:
        plan = state if state is not None else self.prepare(meta, pool)
        pool.store(layer, meta.out_slots, k, v)
        kv = pool.kv[layer]
        scale = options.scale if options.scale is not None else q.shape[-1] ** -0.5
        q = q if q.stride(-1) == 1 else q.contiguous()  # any row and head strides: q is a view of the q/k/v output
        return paged_attention(q, kv, plan, scale, options.softcap or 0.0, options.window or 0)
