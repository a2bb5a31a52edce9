"""Which kernels serve bfloat16 linear weights on a CPU with AVX-512 BF16, each checked against ``F.linear`` once.

Where the CPU has AVX-512 BF16 but no AMX (the 2-core AMD EPYC, Zen 4), bfloat16 weights are not packed for
oneDNN (``plain_bf16_weights``). Releasing the plain weight (``release_plain``, which ``prepack`` calls at load)
packs it in pairs of K instead, the operand layout of ``vdpbf16ps`` (``csrc/bf16_packed.cpp``; a weight in parts,
q/k/v mapped apart from a file, packs its parts in order), and one kernel multiplies it at every row count. One layer
of SmolLM2's shapes (``bench/bf16_layer.py --hidden 576 --intermediate 1536 --kv-dim 192 --layers 30``, 2 threads,
2026-12-05, the gate/up product gated), ms: 16 rows 0.34 against 0.50 for the dot-product kernel over the plain
weight (``csrc/bf16_linear.cpp``) and 0.50 for oneDNN's packed layout; 2,048 rows 34.5 against oneDNN's 34.1 and
``F.linear``'s 37.8 (which reaches oneDNN without a reorder). The 1B shape at one row: 2.3 against 3.7 and 4.4.
The pack is a transpose of 16 x 16 words per 64 bytes, done once at load. A head tied to the embedding packs too,
and the embedding looks its rows up in the packed copy (``Embedding.read_packed_rows``). A weight that does not
pack (a tied head whose vocabulary is not a multiple of 16, ``--keep-plain-weights``) stays plain: up to
``BF16_KERNEL_MAX_ROWS`` rows it takes the dot-product kernel, which reads the weight in place, and ``F.linear``
above. With AMX, which layout serves is measured on the machine (``bf16_layout``): the pairs, whose steps of many
rows then unpack the weight for oneDNN's GEMM on the tile units (``unpacked_product``), or oneDNN's packed layout;
with the latter the dot-product kernel serves only one to three rows, where it is the faster, for a weight kept
plain.

``linear.Linear`` asks this module which kernel a weight takes; the kernels themselves are C++ (``csrc/``).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from radixserve.runtime import envs
from radixserve.runtime.cpu_features import native_bf16
from radixserve.runtime.models import bf16_layout

logger = logging.getLogger("radixserve.model")


# Up to this many rows a bfloat16 product takes the AVX-512 BF16 kernel (see the module doc), measured: with AMX
# (packed oneDNN on the tile units wins from four rows) and without (F.linear is as fast from ~32 rows).
BF16_KERNEL_MAX_ROWS_AMX = 3
BF16_KERNEL_MAX_ROWS = 32


@functools.cache
def small_rows_kernel():  # noqa: ANN202 - the compiled function or None
    """The small-row bfloat16 kernel where it is built for this CPU and agrees with ``F.linear``."""
    if "avx512_bf16" not in native_bf16():
        return None
    from radixserve.runtime.cpu_ext import load_kernels

    kernels = load_kernels()
    if kernels is None or not kernels.bf16_linear.available:
        return None
    op = kernels.bf16_linear.linear
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(shape, generator=gen).to(torch.bfloat16) for shape in ((11, 64), (48, 64), (48,)))
    with torch.inference_mode():
        want = F.linear(x.float(), w.float(), b.float())
        tol = 1e-2 * float(want.abs().max())
        ok = torch.allclose(op(x, [w[:16], w[16:]], b).float(), want, rtol=1e-2, atol=tol)  # every tile shape
        ok &= torch.allclose(op(x[:1], [w], torch.empty(0)).float(), want[:1] - b.float(), rtol=1e-2, atol=tol)
    if not ok:
        logger.warning("bfloat16 linear kernel disagrees with F.linear on this machine; using oneDNN")
        return None
    return op


def _in_blocks(parts: tuple[torch.Tensor, ...]) -> bool:
    """Whether weight ``parts`` fit both kernels' blocking: bfloat16 on CPU, 2-D, contiguous, K % 32 and every
    part's N % 16."""
    return all(
        w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.dim() == 2 and w.is_contiguous()
        and w.shape[1] % 32 == 0 and w.shape[0] % 16 == 0
        for w in parts
    )  # fmt: skip


def weight_kernel(parts: tuple[torch.Tensor, ...]):  # noqa: ANN202
    """The bfloat16 kernel when it applies to this weight (its parts, ``_in_blocks``)."""
    return small_rows_kernel() if _in_blocks(parts) else None


@functools.cache
def packed_ops():  # noqa: ANN202 - the compiled module or None
    """``csrc/bf16_packed.cpp`` where it is built for this CPU and agrees with ``F.linear`` (every tile shape), its
    gate/up product with ``silu_mul`` over ``linear`` (to the bit)."""
    if small_rows_kernel() is None:
        return None
    from radixserve.runtime.cpu_ext import load_kernels

    kernels = load_kernels()
    ops = getattr(kernels, "bf16_packed", None)
    if ops is None or not ops.available:
        return None
    if not agrees_with_f_linear(ops, product_of(ops)):
        logger.warning("packed bfloat16 linear kernel disagrees with F.linear on this machine; not packing")
        return None
    return ops


def product_of(module):  # noqa: ANN001, ANN202 - a compiled module with linear / linear_silu_mul over the pairs
    def product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor, gated: bool) -> torch.Tensor:
        return (module.linear_silu_mul if gated else module.linear)(x, packed, bias)

    return product


def agrees_with_f_linear(ops, product) -> bool:  # noqa: ANN001 - bf16_packed's module; product(x, packed, bias, gated)
    """Whether ``product`` over weights packed in pairs (``ops.pack``) agrees with ``F.linear``: 11 blocks (runs of 6,
    4 and 1 for the pairs' kernel; units of two and one for the tiles) and a slice of 3 of them, K of two tiles, rows
    that take every tile shape of both kernels (and prefetching), a bias or none; gated over [gate; up] of 5 blocks
    each (runs of 3 and 2), to the bit what ``silu_mul`` gives over its plain product."""
    from radixserve.runtime.cpu_ext import load_kernels

    silu_mul = load_kernels().fused_ops.silu_mul
    gen = torch.Generator().manual_seed(0)
    w, b = (torch.randn(shape, generator=gen).to(torch.bfloat16) for shape in ((176, 64), (176,)))
    packed = ops.pack([w[:16].contiguous(), w[16:].contiguous()])
    gate_up = ops.pack([w[:80].contiguous(), w[80:160].contiguous()])
    none = torch.empty(0, dtype=torch.bfloat16)
    ok = True
    with torch.inference_mode():
        for rows in (1, 3, 13, 16, 17, 45, 70):
            x = torch.randn((rows, 64), generator=gen).to(torch.bfloat16)
            for bias in (b, none):
                want = F.linear(x.float(), w.float(), bias.float() if bias.numel() else None)
                tol = 1e-2 * float(want.abs().max())
                ok &= torch.allclose(product(x, packed, bias, False).float(), want, rtol=1e-2, atol=tol)
                if bias.numel():
                    part = product(x, packed[6:9], b[96:144], False).float()
                    ok &= torch.allclose(part, want[:, 96:144], rtol=1e-2, atol=tol)
            gated = silu_mul(product(x, gate_up, b[:160], False))
            ok &= torch.equal(product(x, gate_up, b[:160], True), gated)
    return bool(ok)


@functools.cache
def tiles_ops():  # noqa: ANN202 - the compiled module or None
    """``csrc/bf16_tiles.cpp`` where the CPU has AMX, the kernels were built for it, Linux lets this process use the
    tiles and their product agrees with ``F.linear`` (``agrees_with_f_linear``): the products over weights packed in
    pairs that ``bf16_layout`` measured faster on the tiles run there. The tiles run first in a child process
    (``amx_probe``): a fault there turns them off instead of killing the engine."""
    if packed_ops() is None or "amx_bf16" not in native_bf16():
        return None
    from radixserve.runtime.amx_probe import tiles_survive

    return checked_tiles() if tiles_survive() else None


def checked_tiles():  # noqa: ANN202 - the compiled module or None
    """``tiles_ops`` without asking ``amx_probe`` first: what the probe's child process runs."""
    if packed_ops() is None:
        return None
    from radixserve.runtime.cpu_ext import load_kernels

    tiles = getattr(load_kernels(), "bf16_tiles", None)
    if tiles is None or not tiles.available or not tiles.enable():
        return None
    if not agrees_with_f_linear(packed_ops(), product_of(tiles)):
        logger.warning("AMX tile product disagrees with F.linear on this machine; not using it")
        return None
    return tiles


def packs(parts: tuple[torch.Tensor, ...]) -> bool:
    """Whether bfloat16 weight ``parts`` are packed for ``csrc/bf16_packed.cpp`` when released: served plain on this
    CPU otherwise (``plain_bf16_weights``), on the CPU, shapes its blocks take (K % 32, each N % 16)."""
    return plain_bf16_weights() and packed_ops() is not None and _in_blocks(parts)


@functools.cache
def plain_bf16_weights() -> bool:
    """Whether bfloat16 weights on this CPU are served by the AVX-512 BF16 kernels rather than packed for oneDNN
    (see the module doc): the kernels built and checked, and the pairs this machine's layout (``bf16_layout``:
    always without AMX, measured with it). They load plain (the loader maps the file) and pack in pairs of K when
    released (``csrc/bf16_packed.cpp``); what does not pack stays plain."""
    if not envs.onednn_linear() or small_rows_kernel() is None:
        return False
    if packed_ops() is None:  # the dot-product kernel alone: it serves up to 32 rows, F.linear above
        return "amx_bf16" not in native_bf16()
    layout = bf16_layout.chosen()
    tiles = tiles_ops()
    if tiles is not None:  # the pairs' products from this many rows on run on the tiles (in C++: the decode stack too)
        tiles.use_from_rows(layout.tiles_from_rows if layout.pairs else bf16_layout.NEVER)
    return layout.pairs


def unpack_from_rows() -> int:
    """Products of this many rows or more over weights packed in pairs go to ``unpacked_product`` (``bf16_layout``:
    with AMX, as measured; without it, never)."""
    return bf16_layout.chosen().unpack_from_rows


# ``unpacked_product`` unpacks a weight this many bytes at a time at most (a slice of output channels): a prefill
# step's transient memory stays small beside the weights (a 1B model's gate/up projection is 64 MB).
UNPACK_SLICE_BYTES = 16 * 2**20


def unpacked_product(
    x2: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, gated: bool
) -> torch.Tensor:
    """What ``packed_ops().linear`` (``gated``: ``linear_silu_mul``) gives for ``x2`` [M, K], by ``F.linear`` over
    the weight unpacked from pairs of K a slice of output channels at a time: oneDNN's GEMM, which with AMX runs on
    the tile units, for steps of many rows (``unpack_from_rows``). Rounding is the GEMM's; gated, SiLU-and-mul is
    ``fused.silu_mul``'s over the [gate; up] product."""
    from radixserve.runtime.models import fused

    ops = packed_ops()
    blocks, k = packed.shape[0], packed.shape[1] // 16
    bias = bias if bias is not None and bias.numel() else None
    if 32 * k * blocks <= UNPACK_SLICE_BYTES:  # whole: [gate; up] unpacks as it multiplies
        y = F.linear(x2, ops.unpack(packed), bias)
        return fused.silu_mul(y) if gated else y
    units = blocks // 2 if gated else blocks  # output blocks of 16 channels (gated: each a gate and an up block)
    step = max(1, UNPACK_SLICE_BYTES // (32 * k * (2 if gated else 1)))
    out = x2.new_empty((x2.shape[0], 16 * units))
    for b0 in range(0, units, step):
        b1 = min(units, b0 + step)
        spans = ((b0, b1), (units + b0, units + b1)) if gated else ((b0, b1),)
        ws = [ops.unpack(packed[s0:s1]) for s0, s1 in spans]
        w = ws[0] if len(ws) == 1 else torch.cat(ws)
        b = torch.cat([bias[16 * s0 : 16 * s1] for s0, s1 in spans]) if bias is not None else None
        y = F.linear(x2, w, b)
        out[:, 16 * b0 : 16 * b1] = fused.silu_mul(y) if gated else y
    return out


def bf16_kernel_max_rows() -> int:
    return BF16_KERNEL_MAX_ROWS if plain_bf16_weights() else BF16_KERNEL_MAX_ROWS_AMX
