"""Compiled CPU kernels of the reference attention backend, built once per machine and cached.

Decode attention over the KV pool is memory-bound: each step reads every decoding row's keys and values once.
The PyTorch formulation (``torch_ref``) has to gather the keys into a padded copy before one ``bmm`` can read them,
so it writes and re-reads them; ``csrc/decode_attention.cpp`` reads each key and value row in place, with AVX-512
where the CPU has it (SmolLM2-135M, 8 rows of ~500 tokens on the 2-core reference machine: ~270 -> ~150 us per
layer, about 10% of a decode step).

Prefill attention in bfloat16 has a kernel too, where the CPU has AVX-512 BF16 (``csrc/extend_attention.cpp``):
every long prefill chunk of a step in one call, its cached prefix read from the pool in place, products on
vdpbf16ps. Without AMX, SDPA's flash kernel widens bfloat16 to float32 for sgemm (2-core Zen 4, SmolLM2's heads, one
600-token prompt: 9.1 -> 2.2 ms a layer, 46 -> 193 GFLOP/s); with AMX, SDPA multiplies on the tile unit (310-490
GFLOP/s measured on the 2-core Xeon), and so can the kernel (``extend_attention_tiles``: its packed keys and values
are already the tiles' B operands); which of the three serves is timed on the machine's first start
(``prefill_timings``, kept beside the compiled kernels: ``runtime.measured``).

They are built once per machine by ``runtime.cpu_ext``; a machine without a compiler, a failed build, or a kernel that
disagrees with PyTorch on a self-check keeps the PyTorch path (logged once), and ``RADIXSERVE_CPU_KERNELS=0`` turns
the kernels off.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from radixserve.runtime import envs
from radixserve.runtime.cpu_ext import load_kernels
from radixserve.runtime.cpu_features import cpu_flags
from radixserve.runtime.measured import once, race
from radixserve.runtime.threads import one_intra_op_thread

logger = logging.getLogger("radixserve.kernels")


# (q [B, H, D], kv [2, Hkv, N, D], slots [B, W] or [1, W] shared by all rows, lens [B], scale[, groups [B, 2]])
#   -> (out [B, H, D] in q's dtype, lse [B, H] float32). groups: per row (its prefix group or -1, the group's prefix
#   length); a group's rows attend their shared prefix (their first keys, the same slots) together.
DecodeAttention = Callable[..., list[torch.Tensor]]


# Pool dtypes the kernel reads, with its self-check's tolerance against the reference (bfloat16: the reference
# computes in float32 from the same bfloat16 inputs, so only the output's rounding differs).
DTYPES = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (1e-2, 1e-2)}


def applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model on ``device`` in ``dtype`` can use these kernels (float32 or bfloat16 on CPU)."""
    return torch.device(device).type == "cpu" and dtype in DTYPES


def reference_decode_attention(
    q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel computes, in plain PyTorch, one row at a time (for the self-check and tests)."""
    b, h, d = q.shape
    n_kv = kv.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty(b, h, dtype=torch.float32)
    for i in range(b):
        idx = slots[i if slots.shape[0] > 1 else 0, : int(lens[i])]
        keys = kv[0][:, idx].repeat_interleave(h // n_kv, dim=0).float()  # [H, L, D]
        values = kv[1][:, idx].repeat_interleave(h // n_kv, dim=0).float()
        scores = torch.einsum("hd,hld->hl", q[i].float(), keys) * scale
        lse[i] = torch.logsumexp(scores, dim=-1)
        out[i] = torch.einsum("hl,hld->hd", torch.softmax(scores, dim=-1), values).to(q.dtype)
    return out, lse


def _self_check(op: DecodeAttention) -> bool:
    """Run the kernel on random rows of several shapes and each dtype against ``reference_decode_attention``."""
    gen = torch.Generator().manual_seed(0)
    for dtype, (rtol, atol) in DTYPES.items():
        for heads, kv_heads, dim in ((9, 3, 64), (8, 8, 128), (6, 2, 48)):
            kv = torch.randn(2, kv_heads, 97, dim, generator=gen).to(dtype)
            lens = torch.tensor([1, 17, 40, 33])
            slots = torch.stack([torch.randperm(97, generator=gen)[:40] for _ in range(4)])
            q = torch.randn(4, heads, dim, generator=gen).to(dtype)
            out, lse = op(q, kv, slots, lens, dim**-0.5)
            ref_out, ref_lse = reference_decode_attention(q, kv, slots, lens, dim**-0.5)
            if out.dtype != dtype or lse.dtype != torch.float32:
                return False
            if not (torch.allclose(out.float(), ref_out.float(), rtol=rtol, atol=atol)
                    and torch.allclose(lse, ref_lse, atol=1e-4)):  # fmt: skip
                return False
    return True


@functools.cache
def decode_attention_op() -> DecodeAttention | None:
    """The compiled decode-attention kernel, or ``None`` where it is off, cannot be built, or fails its check."""
    module = load_kernels()
    if module is None:
        return None
    return _checked(module.decode_attention.decode_attention, _self_check, "decode-attention", "PyTorch ops")


def grouped_rows(
    spec: list[tuple[int, int, int]], n_slots: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slots, lens, groups) for rows given as (group or -1, prefix length, own keys), at random distinct slots of a
    pool of ``n_slots``: a group's rows start with the same slots (for checks and tests of ``groups``)."""
    order = torch.randperm(n_slots, generator=gen)
    prefixes: dict[int, torch.Tensor] = {}
    used = 0
    for g, p, _ in spec:
        if g >= 0 and g not in prefixes:
            prefixes[g], used = order[used : used + p], used + p
    tables = []
    for g, _, own in spec:
        tables.append(torch.cat([prefixes[g] if g >= 0 else order[:0], order[used : used + own]]))
        used += own
    lens = torch.tensor([len(t) for t in tables])
    slots = torch.zeros(len(spec), int(lens.max()), dtype=torch.int64)
    for i, t in enumerate(tables):
        slots[i, : len(t)] = t
    return slots, lens, torch.tensor([[g, p] for g, p, _ in spec])


def _self_check_groups(op: DecodeAttention) -> bool:
    """Rows that share a prefix, attended over it together (``groups``), against the same rows whole: groups of
    several sizes and prefix lengths (within one block of keys, over several, a block and one key), rows with no
    keys of their own past the prefix, a row in no group, every head size the prefix kernel has."""
    gen = torch.Generator().manual_seed(0)
    # (group, prefix length, own keys) per row
    spec = [(0, 65, 3), (0, 65, 0), (1, 130, 20), (-1, 0, 37), (0, 65, 1), (1, 130, 1), (2, 7, 5), (2, 7, 1)]
    for heads, kv_heads, dim in ((9, 3, 64), (8, 8, 128), (12, 2, 96), (8, 1, 256)):
        kv = torch.randn(2, kv_heads, 400, dim, generator=gen).bfloat16()
        slots, lens, groups = grouped_rows(spec, 400, gen)
        q = torch.randn(len(spec), heads, dim, generator=gen).bfloat16()
        out, lse = op(q, kv, slots, lens, dim**-0.5, groups)
        ref_out, ref_lse = reference_decode_attention(q, kv, slots, lens, dim**-0.5)
        if not (torch.allclose(out.float(), ref_out.float(), rtol=2e-2, atol=2e-2)
                and torch.allclose(lse, ref_lse, atol=1e-3)):  # fmt: skip
            return False
    return True


@functools.cache
def prefix_groups_op() -> DecodeAttention | None:
    """The decode kernel where it attends rows that share a prefix together (``groups``) and passes its check here,
    else ``None`` (whole rows, the prefix read per row). The kernel takes groups in bfloat16 on AVX-512 BF16 for
    head sizes 64, 96, 128 and 256 and up to 8 query heads per KV head, and ignores them elsewhere (the rows it is
    given are whole either way). ``RADIXSERVE_PREFIX_GROUPS=0`` turns it off."""
    op = decode_attention_op()
    module = load_kernels()
    if not envs.prefix_groups() or op is None or module is None:
        return None
    probe = (torch.empty(1, 1, 64, dtype=torch.bfloat16), torch.empty(2, 1, 1, 64, dtype=torch.bfloat16))
    if not module.decode_attention.groups_supported(*probe):
        return None
    return _checked(op, _self_check_groups, "shared-prefix decode-attention", "whole rows")


def _checked(op: Callable, check: Callable[[Callable], bool], what: str, fallback: str) -> Callable | None:
    """``op`` if it passes ``check`` here, else ``None`` (logged once, naming ``what`` and the ``fallback``).

    On one thread: a multi-threaded op here would give the caller's thread an OpenMP team of its own, and with
    more OpenMP threads than cores libgomp stops letting the engine thread's workers spin between ops (see
    ``runtime.threads.one_intra_op_thread``)."""
    try:
        with one_intra_op_thread(), torch.inference_mode():
            ok = check(op)
    except RuntimeError as exc:
        logger.warning("CPU %s kernel failed its self-check (%s); using %s", what, exc, fallback)
        return None
    if not ok:
        logger.warning("CPU %s kernel disagrees with PyTorch on this machine; using %s", what, fallback)
        return None
    return op


# Head sizes the prefill kernel has code for (other sizes stay on SDPA); any number of query heads per KV head.
EXTEND_HEAD_DIMS = (64, 96, 128, 256)

# (q [T, H, D], kv [2, Hkv, N, D], slots [S] int64: every chunk's kv_len slots one after another, seqs [B, 4] int64
#  rows of (q_start, q_len, kv_len, slot_offset), scale, window (0: none)) -> out [T, H, D]; rows of q outside every
#  chunk are left uninitialized. Query i of a chunk sits at position kv_len - q_len + i and sees the keys up to it
#  (and after its window's start).
ExtendAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, int], torch.Tensor]


def reference_extend_attention(
    q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, seqs: torch.Tensor, scale: float, window: int
) -> torch.Tensor:
    """What the prefill kernel computes, in float32 PyTorch, one chunk at a time; rows outside chunks are 0."""
    h, n_kv = q.shape[1], kv.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32)
    for q_start, q_len, kv_len, offset in seqs.tolist():
        idx = slots[offset : offset + kv_len]
        keys = kv[0][:, idx].float().repeat_interleave(h // n_kv, dim=0)
        values = kv[1][:, idx].float().repeat_interleave(h // n_kv, dim=0)
        pos = torch.arange(kv_len - q_len, kv_len)[:, None]
        key = torch.arange(kv_len)[None, :]
        visible = (key <= pos) & ((key > pos - window) if window else True)
        qs = q[q_start : q_start + q_len].float().transpose(0, 1)
        o = F.scaled_dot_product_attention(qs, keys, values, attn_mask=visible, scale=scale)
        out[q_start : q_start + q_len] = o.transpose(0, 1)
    return out


def _self_check_extend(op: ExtendAttention) -> bool:
    """The prefill kernel against ``reference_extend_attention`` on chunks with and without a cached prefix, a
    window, every head size, more query heads per KV head than a task takes, in one batch. bfloat16 inputs; the
    kernel rounds its probabilities to bfloat16 before the product with the values (as SDPA's bfloat16 path
    does), so it agrees to a few bfloat16 steps."""
    gen = torch.Generator().manual_seed(0)
    for heads, kv_heads, dim, window in ((9, 3, 64, 0), (8, 8, 128, 0), (12, 2, 96, 24), (10, 1, 256, 0)):
        # (q_len, kv_len): several blocks of 16 queries and of 64 keys, a lone query, a fresh chunk; small, as the
        # check runs at every start.
        chunks = ((37, 100), (1, 70), (20, 20), (17, 66))
        kv = torch.randn(2, kv_heads, 300, dim, generator=gen).bfloat16()
        t = 3 + sum(q_len for q_len, _ in chunks)  # 3 rows before the chunks: the decode rows' place
        q = torch.randn(t, heads, dim, generator=gen).bfloat16()
        slots = torch.cat([torch.randperm(300, generator=gen)[:kv_len] for _, kv_len in chunks])
        rows, q_start, offset = [], 3, 0
        for q_len, kv_len in chunks:
            rows.append([q_start, q_len, kv_len, offset])
            q_start, offset = q_start + q_len, offset + kv_len
        seqs = torch.tensor(rows)
        out = op(q, kv, slots, seqs, dim**-0.5, window)
        ref = reference_extend_attention(q, kv, slots, seqs, dim**-0.5, window)
        if out.dtype != torch.bfloat16 or not torch.allclose(out[3:].float(), ref[3:], rtol=2e-2, atol=2e-2):
            return False
    return True


def prefill_ops() -> dict[str, ExtendAttention]:
    """The compiled bfloat16 prefill-attention kernels that pass their check here: ``kernel`` (vdpbf16ps; none
    where the CPU lacks AVX-512 BF16, the kernels are off or cannot be built) and, with AMX, ``tiles`` (its products
    on the tile units: ``extend_attention_tiles``; run first in a child process, ``amx_probe``)."""
    module = load_kernels()
    if module is None or not module.extend_attention.available():
        return {}
    ops = {}
    kernel = _checked(module.extend_attention.extend_attention, _self_check_extend, "prefill-attention", "SDPA")
    if kernel is not None:
        ops["kernel"] = kernel
    if "amx_bf16" in cpu_flags() and module.extend_attention.tiles_available:
        from radixserve.runtime.amx_probe import tiles_survive

        tiles = checked_extend_tiles(module) if tiles_survive() else None
        if tiles is not None:
            ops["tiles"] = tiles
    return ops


def checked_extend_tiles(module) -> ExtendAttention | None:  # noqa: ANN001 - the compiled kernels
    """The prefill-attention kernel on AMX tiles where it is built and passes its check here, without asking
    ``amx_probe`` first (the probe's child process runs this)."""
    if not module.extend_attention.tiles_available:
        return None
    tiles = functools.partial(module.extend_attention.extend_attention_tiles, emulated=False)
    return _checked(tiles, _self_check_extend, "prefill-attention AMX tile", "the other kernel or SDPA")


@functools.cache
def extend_attention_op() -> ExtendAttention | None:
    """The compiled bfloat16 prefill-attention kernel (``prefill_ops``), or ``None`` for SDPA: without AMX the
    vdpbf16ps kernel where it passes its check; with AMX whichever of it, the tile kernel and SDPA measured fastest
    on this CPU (``prefill_timings``, once per machine)."""
    ops = prefill_ops()
    if not ops or "amx_bf16" not in cpu_flags():
        return ops.get("kernel")
    keys = {f"{name}_ms" for name in ops} | {"sdpa_ms"}
    found = once(PREFILL_TIMINGS, keys, lambda: prefill_timings(ops), "bfloat16 prefill attention")
    totals = {name: sum(found[f"{name}_ms"].values()) for name in (*ops, "sdpa")}
    best = min(totals, key=totals.__getitem__)
    logger.info(
        "bfloat16 prefill attention: %s (measured on this CPU: %s)",
        {"kernel": "the compiled kernel", "tiles": "the compiled kernel on AMX tiles", "sdpa": "SDPA"}[best],
        ", ".join(f"{name} {ms:.1f} ms" for name, ms in totals.items()),
    )
    return ops.get(best)


PREFILL_TIMINGS = "prefill_attention.json"


def prefill_timings(
    ops: dict[str, ExtendAttention],
    heads: tuple[int, int, int] = (16, 4, 64),
    chunks: tuple[tuple[int, int], ...] = ((1024, 1024), (256, 1280)),
    rounds: int = 3,
) -> dict:
    """Median milliseconds of each prefill kernel of ``ops`` (``<name>_ms``) and of SDPA as ``TorchReferenceBackend``
    calls it (``sdpa_ms``), on the caller's intra-op threads, for each chunk (q_len, kv_len) of ``heads`` (query
    heads, KV heads, head size): by default a fresh 1,024-token chunk (SDPA causal over the step's own keys) and a
    256-token chunk after a cached 1,024-token prefix (SDPA over keys gathered from the pool, with a mask). With AMX,
    SDPA multiplies on the tile units (310-490 GFLOP/s on the 2-core Xeon); the kernels read the prefix in place."""
    n_heads, kv_heads, dim = heads
    gen = torch.Generator().manual_seed(0)
    size = max(kv_len for _, kv_len in chunks)
    kv = torch.randn(2, kv_heads, size, dim, generator=gen).bfloat16()
    found: dict[str, dict[str, float]] = {f"{name}_ms": {} for name in (*ops, "sdpa")}
    with torch.inference_mode():
        for q_len, kv_len in chunks:
            q = torch.randn(q_len, n_heads, dim, generator=gen).bfloat16()
            slots = torch.randperm(size, generator=gen)[:kv_len]
            seqs = torch.tensor([[0, q_len, kv_len, 0]])
            qs = q.transpose(0, 1).unsqueeze(0)
            if q_len == kv_len:
                new = kv[:, :, slots].permute(0, 2, 1, 3).contiguous()  # the step's k and v, [T, Hkv, D] each

                def sdpa(new: torch.Tensor = new, qs: torch.Tensor = qs) -> torch.Tensor:
                    ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in new)
                    return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)

            else:
                index = (torch.arange(2 * kv_heads)[:, None] * size + slots[None, :]).reshape(-1)
                mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)

                def sdpa(index: torch.Tensor = index, mask: torch.Tensor = mask, qs: torch.Tensor = qs) -> torch.Tensor:
                    rows = kv.view(-1, dim).index_select(0, index).view(2, 1, kv_heads, -1, dim)
                    return F.scaled_dot_product_attention(qs, rows[0], rows[1], attn_mask=mask, enable_gqa=True)

            calls = [
                lambda op=op, q=q, slots=slots, seqs=seqs: op(q, kv, slots, seqs, dim**-0.5, 0) for op in ops.values()
            ]
            for name, ms in zip(found, race([*calls, sdpa], rounds), strict=True):
                found[name][f"{q_len}/{kv_len}"] = ms
    return found
