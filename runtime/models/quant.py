"""Block-quantized weights kept quantized: GGUF's Q8_0, Q4_0 and Q4_1, and the linear layers over them.

A ``QuantTensor`` is a ``[N, K]`` weight as N rows (output channels) of ``K / 32`` blocks of 32 weights, in ggml's
byte layout (``csrc/quant_linear.cpp`` documents it). Rows are independent, so slicing rows (tensor parallelism,
merged projections) and permuting them (the q/k layout of llama.cpp) work on the bytes as they are.

``linear(x, w)``: the compiled kernel reads the blocks as they are, 4-6x fewer bytes than a float32 weight, and
multiplies them with x rounded to int8 per block (``reference_linear`` defines the arithmetic, llama.cpp's), for any
number of rows, so that a row's result does not depend on its batch. On a CPU with AVX-512 VNNI or AVX2 a weight
is first repacked (``QuantTensor.pack``: the same bytes, 16 output channels interleaved, ``csrc/quant_packed.cpp``
and ``csrc/quant_packed_avx2.h``), for which the kernel runs 2-4x fewer instructions per weight: the layers a
decode step runs are then bound by memory, not by the kernel's bookkeeping. Both packed kernels give the same bits,
except for the K-quants, whose AVX2 kernel rounds the activations per 256 inputs (``activation_block``); the K-quants
(Q4_K, Q6_K) are served as they are only by the packed kernels. Without the kernel (no compiler, not a CPU)
the weight is unpacked to float and multiplied exactly. ``reference_dequantize`` and ``reference_linear`` are the
pure-PyTorch definitions the kernels are checked against.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.runtime.cpu_ext import load_kernels
from radixserve.runtime.cpu_features import cpu_flags
from radixserve.runtime.k_quants import (
    Q4_K_BYTES,
    Q5_K_BYTES,
    Q6_K_BYTES,
    nibble_levels,
    q4_k_levels,
    q6_k_levels,
)

logger = logging.getLogger("radixserve.kernels")

BLOCK = 32
# ggml's type ids (what the kernels take) and bytes per block of 32 weights; Q4_K's and Q6_K's blocks are 256
# weights (``runtime/k_quants.py``), like Q5_K's. Only the packed kernel takes the K-quants and the 5-bit types.
QTYPES = {"Q8_0": 8, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24}
SUPER_BLOCKS = {"Q4_K": (256, Q4_K_BYTES), "Q5_K": (256, Q5_K_BYTES), "Q6_K": (256, Q6_K_BYTES)}  # weights, bytes
ROW_KERNEL_TYPES = frozenset({"Q8_0", "Q4_0", "Q4_1"})  # the types ``csrc/quant_linear.cpp`` (the row layout) takes
FIVE_BIT_TYPES = frozenset({"Q5_0", "Q5_1"})  # 4-bit nibbles plus a fifth bit per weight (ggml's qh)
# Types whose packed kernel is newer than the others': one that disagrees with the definition here is not served
# packed (the loader rewrites it as Q8_0), while the others still are.
OPTIONAL_PACKED_TYPES = FIVE_BIT_TYPES | {"Q5_K"}
# The levels' offset of the types without a float one (weight = d * (q - offset)); Q4_1's and Q5_1's m is a float.
LEVEL_OFFSET = {"Q4_0": 8, "Q5_0": 16}
WITH_MIN = frozenset({"Q4_1", "Q5_1"})

# Output channels per group of a packed weight (``QuantTensor.pack``).
GROUP = 16


def weight_block(qtype: str) -> int:
    """The input size must be a multiple of this."""
    return SUPER_BLOCKS[qtype][0] if qtype in SUPER_BLOCKS else BLOCK


def row_bytes(qtype: str, k: int) -> int:
    """Bytes of one output channel of ``k`` inputs."""
    if qtype in SUPER_BLOCKS:
        weights, nbytes = SUPER_BLOCKS[qtype]
        return k // weights * nbytes
    return k // BLOCK * BLOCK_BYTES[qtype]


@dataclass(frozen=True)
class QuantTensor:
    """A ``[N, K]`` weight in blocks: ``data`` is uint8 ``[N, row_bytes(qtype, K)]``, rows as ggml writes them; or,
    ``packed``, ``[ceil(N / 16), 16 * row_bytes(qtype, K)]``: groups of 16 channels interleaved for the packed
    kernel (as many bytes, the last group padded), made by ``pack`` once the weight is final (row slicing, merging
    and permuting need the row layout)."""

    qtype: str
    data: torch.Tensor
    shape: tuple[int, int]
    packed: bool = False
    # ``data`` is a read-only view of a checkpoint file's map (the GGUF loader's): a weight kept as it is must be
    # copied out (``owned``) so that the map can go once loading is done; packing copies it anyway.
    mapped: bool = False

    def __post_init__(self) -> None:
        n, k = self.shape
        if self.qtype not in QTYPES:
            raise ValueError(f"unsupported block type {self.qtype}; supported: {', '.join(QTYPES)}")
        row = row_bytes(self.qtype, k)
        want = (-(-n // GROUP), GROUP * row) if self.packed else (n, row)
        if k % weight_block(self.qtype) or tuple(self.data.shape) != want:
            raise ValueError(f"{self.qtype} data {tuple(self.data.shape)} does not hold a {n} x {k} weight")

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def rows(self, index: slice | torch.Tensor) -> QuantTensor:
        if self.packed:
            raise ValueError("a packed weight's rows are interleaved; slice it before packing")
        data = self.data[index]  # a slice is a view (still of the map, where mapped); an index tensor copies
        view = self.mapped and isinstance(index, slice)
        return QuantTensor(self.qtype, data, (data.shape[0], self.shape[1]), mapped=view)

    def owned(self) -> QuantTensor:
        """This weight with its own copy of the data where it is a view of a file's map; else itself."""
        if not self.mapped:
            return self
        return QuantTensor(self.qtype, self.data.clone(), self.shape, self.packed)

    def pack(self) -> QuantTensor:
        """This weight in 16-channel groups where this CPU runs the packed kernel; else itself."""
        op = packed_ops()
        if self.packed or op is None or self.data.device.type != "cpu" or self.qtype not in packed_types():
            return self
        data = op.pack(self.data.contiguous(), QTYPES[self.qtype], self.shape[1])
        return QuantTensor(self.qtype, data, self.shape, packed=True)

    @staticmethod
    def pack_rows(parts: list[QuantTensor]) -> QuantTensor | None:
        """The parts' rows one after another (one block type, a merged projection), packed at once without
        concatenating their blocks first; ``None`` where the packed kernel does not run here or a part other than
        the last has a number of rows that is not a multiple of 16 (its last group would be shared)."""
        op = packed_ops()
        first = parts[0]
        if op is None or any(p.packed or p.data.device.type != "cpu" or p.qtype != first.qtype for p in parts):
            return None
        if first.qtype not in packed_types():
            return None
        if any(p.shape[0] % GROUP for p in parts[:-1]):
            return None
        data = op.pack_parts([p.data.contiguous() for p in parts], QTYPES[first.qtype], first.shape[1])
        return QuantTensor(first.qtype, data, (sum(p.shape[0] for p in parts), first.shape[1]), packed=True)

    def dequantize(self) -> torch.Tensor:
        if self.packed:
            return packed_ops().dequantize(self.data, QTYPES[self.qtype], self.shape[1], self.shape[0])
        op = quant_ops()
        if op is not None and self.data.device.type == "cpu" and self.qtype in ROW_KERNEL_TYPES:
            return op.dequantize(self.data, QTYPES[self.qtype], self.shape[1])
        return reference_dequantize(self)


@dataclass(frozen=True)
class QuantParts:
    """A merged weight (q/k/v, gate/up) whose parts come in different block types, as a Q4_K_M file has them (q
    and k in Q4_K, v in Q6_K in half the layers): consecutive runs of one type, each its own ``QuantTensor``,
    computed by its own kernel call, their outputs side by side. Only where the packed kernel serves every type;
    elsewhere such parts are re-quantized to Q8_0 as a whole."""

    parts: tuple[QuantTensor, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def qtype(self) -> str:
        return "+".join(p.qtype for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def pack(self) -> QuantParts:
        return QuantParts(tuple(p.pack() for p in self.parts))

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts], dim=0)


def reference_dequantize(w: QuantTensor) -> torch.Tensor:
    """The float32 ``[N, K]`` matrix the blocks encode, in plain PyTorch (the definition)."""
    n, k = w.shape
    if w.qtype == "Q6_K":
        levels, scales = q6_k_levels(w.data, n, k)
        return (levels.float().reshape(n, -1, 16) * scales[..., None]).reshape(n, k)
    if w.qtype in ("Q4_K", "Q5_K"):
        quants, scales, offsets = q4_k_levels(w.data, n, k, five=w.qtype == "Q5_K")
        return (quants.float().reshape(n, -1, 32) * scales[..., None] - offsets[..., None]).reshape(n, k)
    blocks = w.data.reshape(n, k // BLOCK, BLOCK_BYTES[w.qtype])
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [n, nb, 1]
    if w.qtype == "Q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (d * q).reshape(n, k)
    q = block_levels(blocks, w.qtype).float()
    m = blocks[..., 2:4].contiguous().view(torch.float16).float() if w.qtype in WITH_MIN else -LEVEL_OFFSET[w.qtype] * d
    return (d * q + m).reshape(n, k)


def block_levels(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """The int16 levels ``[n, nb, 32]`` in weight order of 4-bit or 5-bit blocks (uint8 ``[n, nb, bytes]``), before
    the offset (``k_quants.nibble_levels`` after the block's scales)."""
    return nibble_levels(blocks, 4 if qtype in WITH_MIN else 2, qtype in FIVE_BIT_TYPES)


def activation_block(qtype: str) -> int:
    """Inputs per activation scale of the kernel that serves ``qtype`` here: 256 for the K-quants (Q4_K, Q6_K)
    under the AVX2 packed kernel (one scale per super-block, as llama.cpp's Q8_K; ``csrc/quant_packed_avx2_q8k.h``),
    else 32."""
    if qtype not in SUPER_BLOCKS:  # (before packed_ops: quant_ops' own check calls this)
        return BLOCK
    op = packed_ops()
    return op.activation_block(QTYPES[qtype]) if op is not None else BLOCK


def reference_linear(x: torch.Tensor, w: QuantTensor, act_block: int | None = None) -> torch.Tensor:
    """What the block kernel computes for float32 ``x`` [M, K] (the definition it is checked against): each row of
    x rounded to int8 per block of ``act_block`` inputs (default: ``activation_block(w.qtype)``; scale max|x| /
    127), integer dot products with the weight's levels per block of 32, scaled by both blocks' scales; Q4_1's and
    Q5_1's offset times the sum of the rounded x block (so the result is exactly the dequantized weight times the
    rounded x, as llama.cpp's Q8_1 activations make it)."""
    m, k = x.shape
    n, nb = w.shape[0], k // BLOCK
    act = activation_block(w.qtype) if act_block is None else act_block
    if act % BLOCK or k % act:
        raise ValueError(f"activation block {act} must be a multiple of {BLOCK} dividing K = {k}")
    xa = x.float().reshape(m, k // act, act)
    da = xa.abs().amax(-1, keepdim=True) / 127.0
    # x times the reciprocal of dx, in float32, as the kernels compute it (x / dx can round the other way)
    qx = (xa * torch.where(da > 0, 1.0 / torch.where(da > 0, da, torch.ones_like(da)), torch.zeros_like(da))).round()
    qx = qx.reshape(m, nb, BLOCK)
    dx = da.repeat_interleave(act // BLOCK, dim=1)  # [m, nb, 1]: each block of 32's scale
    if w.qtype == "Q6_K":  # integer dot products per sub-block of 16, each scaled by its d * scale
        levels, scales = q6_k_levels(w.data, n, k)
        dots = torch.einsum("mhj,nhj->mnh", qx.reshape(m, -1, 16).double(), levels.reshape(n, -1, 16).double())
        per_half = dots * scales[None].double() * dx.squeeze(-1).repeat_interleave(2, dim=1)[:, None].double()
        return per_half.sum(-1).float()
    if w.qtype in ("Q4_K", "Q5_K"):  # Q4_1's arithmetic with the scale and offset of each sub-block of 32
        quants, scales, offsets = q4_k_levels(w.data, n, k, five=w.qtype == "Q5_K")
        dots = torch.einsum("mbj,nbj->mnb", qx.double(), quants.reshape(n, nb, BLOCK).double())
        y = (dots * scales[None].double() * dx.squeeze(-1)[:, None].double()).sum(-1)
        sx = qx.sum(-1).double() * dx.squeeze(-1).double()
        return (y - (sx[:, None, :] * offsets[None].double()).sum(-1)).float()
    blocks = w.data.reshape(n, nb, BLOCK_BYTES[w.qtype])
    dw = blocks[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1)  # [n, nb]
    if w.qtype == "Q8_0":
        levels = blocks[..., 2:].contiguous().view(torch.int8).double()
    else:
        levels = block_levels(blocks, w.qtype).double() - LEVEL_OFFSET.get(w.qtype, 0)
    dots = torch.einsum("mbj,nbj->mnb", qx.double(), levels)  # exact integers
    y = (dots * (dw[None] * dx.squeeze(-1)[:, None]).double()).sum(-1)
    if w.qtype in WITH_MIN:
        mw = blocks[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1)
        sx = qx.sum(-1).double() * dx.squeeze(-1).double()  # [m, nb]
        y = y + (sx[:, None, :] * mw[None].double()).sum(-1)
    return y.float()


def quantize_q8_0(w: torch.Tensor) -> QuantTensor:
    """``w`` [N, K] (K a multiple of 32) as Q8_0: one fp16 scale per block of 32, the max magnitude over 127."""
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"Q8_0 needs the input size to be a multiple of {BLOCK}, got {k}")
    blocks = w.float().reshape(n, k // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.where(scale > 0, blocks / scale.clamp(min=1e-30), torch.zeros_like(blocks)).round().clamp(-127, 127)
    d = scale.to(torch.float16).view(torch.uint8).reshape(n, k // BLOCK, 2)
    data = torch.cat([d, q.to(torch.int8).view(torch.uint8)], dim=-1).reshape(n, -1)
    return QuantTensor("Q8_0", data.contiguous(), (n, k))


def quantize_q4_1(w: torch.Tensor) -> QuantTensor:
    """``w`` [N, K] as Q4_1: per block of 32, the minimum and a step of (max - min) / 15, as fp16."""
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"Q4_1 needs the input size to be a multiple of {BLOCK}, got {k}")
    blocks = w.float().reshape(n, k // BLOCK, BLOCK)
    lo, hi = blocks.amin(dim=-1, keepdim=True), blocks.amax(dim=-1, keepdim=True)
    d16, m16 = ((hi - lo) / 15).to(torch.float16), lo.to(torch.float16)
    d = d16.float()  # quantize against the scale as it is stored, so that d * q + m rounds to the nearest level
    q = torch.where(d > 0, (blocks - m16.float()) / d.clamp(min=1e-30), torch.zeros_like(blocks))
    q = q.round().clamp(0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    header = torch.cat([d16.view(torch.uint8).reshape(n, -1, 2), m16.view(torch.uint8).reshape(n, -1, 2)], dim=-1)
    return QuantTensor("Q4_1", torch.cat([header, packed], dim=-1).reshape(n, -1).contiguous(), (n, k))


QUANTIZERS = {"Q8_0": quantize_q8_0, "Q4_1": quantize_q4_1}


@functools.cache
def quant_ops():  # noqa: ANN201 - the compiled module, or None
    """The compiled block kernels, checked against ``reference_dequantize`` and a float32 matmul; or ``None``."""
    kernels = load_kernels()
    if kernels is None:
        return None
    module = kernels.quant_linear
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for qtype in ROW_KERNEL_TYPES:
            w = _random_blocks(qtype, 37, 96, gen)
            ref = reference_dequantize(w)
            got = module.dequantize(w.data, QTYPES[qtype], 96)
            ok = torch.equal(got, ref)
            for m in (1, 3, 5):
                x = torch.randn(m, 96, generator=gen)
                got = module.linear(x, w.data, QTYPES[qtype], 96)
                ok &= torch.allclose(got, reference_linear(x, w), rtol=1e-4, atol=1e-4)
            ids = torch.tensor([0, 36, 5])
            ok &= torch.equal(module.rows(w.data, ids, QTYPES[qtype], 96), ref[ids])
            if not ok:
                logger.warning("CPU quantized-linear kernel disagrees with PyTorch on %s; using PyTorch ops", qtype)
                return None
    return module


def packed_ops():  # noqa: ANN201 - the compiled module, or None
    """The 16-channel-group kernels where this CPU has AVX-512 VNNI or AVX2 (with FMA and F16C; the build picks
    one) and they agree with ``reference_linear`` (and the row layout's unpacking) on every block type but the
    optional ones and every row count 1-7; or ``None`` (weights keep their rows)."""
    return _packed_checked()[0]


def packed_types() -> frozenset[str]:
    """The block types the packed kernel serves here (its check passed on them): empty without it."""
    return _packed_checked()[1]


@functools.cache
def _packed_checked():  # noqa: ANN202 - (the module or None, the types it serves)
    kernels = load_kernels()
    if kernels is None or quant_ops() is None or not kernels.quant_packed.supported():
        return None, frozenset()
    module = kernels.quant_packed
    gen = torch.Generator().manual_seed(0)
    served = set()
    with torch.inference_mode():
        for qtype in QTYPES:
            k = 96 if qtype not in SUPER_BLOCKS else 512  # 3 blocks of 32; 2 super-blocks of 256
            w = _random_blocks(qtype, 37, k, gen)
            code = QTYPES[qtype]
            data = module.pack(w.data, code, k)
            ref = reference_dequantize(w)
            ok = torch.equal(module.dequantize(data, code, k, 37), ref)
            ids = torch.tensor([0, 36, 17])
            ok &= torch.equal(module.rows(data, ids, code, k, 37), ref[ids])
            x = torch.randn(7, k, generator=gen)
            want = reference_linear(x, w, module.activation_block(code))
            for m in range(1, 8):
                ok &= torch.allclose(module.linear(x[:m], data, code, k, 37), want[:m], rtol=1e-4, atol=1e-4)
            xb = x.to(torch.bfloat16)  # bfloat16 in, the float32 sums rounded once to bfloat16 out
            as_float = module.linear(xb.float(), data, code, k, 37)
            ok &= torch.equal(module.linear(xb, data, code, k, 37), as_float.to(xb.dtype))
            if ok:
                served.add(qtype)
            elif qtype in OPTIONAL_PACKED_TYPES:
                logger.warning("packed quantized-linear kernel disagrees with PyTorch on %s; not served packed", qtype)
            else:
                logger.warning("packed quantized-linear kernel disagrees with PyTorch on %s; keeping rows", qtype)
                return None, frozenset()
    return module, frozenset(served)


def _random_blocks(qtype: str, n: int, k: int, gen: torch.Generator) -> QuantTensor:
    """Random but valid blocks (finite fp16 scales) of ``qtype``."""
    if qtype in SUPER_BLOCKS:  # any quants and sub-block scales; positive fp16 d (and Q4_K's dmin)
        size = SUPER_BLOCKS[qtype][1]
        data = torch.randint(0, 256, (n, k // 256, size), dtype=torch.uint8, generator=gen)
        for at in (0, 2) if qtype in ("Q4_K", "Q5_K") else (size - 2,):
            scale = (torch.rand(n, k // 256, 1, generator=gen) * 0.01).to(torch.float16)
            data[..., at : at + 2] = scale.view(torch.uint8)
        return QuantTensor(qtype, data.reshape(n, -1), (n, k))
    nb, bs = k // BLOCK, BLOCK_BYTES[qtype]
    data = torch.randint(0, 256, (n, nb, bs), dtype=torch.uint8, generator=gen)

    def halves(scale: float) -> torch.Tensor:  # [n, nb, 2]: one fp16 per block, as its two bytes
        return ((torch.rand(n, nb, 1, generator=gen) - 0.5) * scale).to(torch.float16).view(torch.uint8)

    data[..., 0:2] = halves(0.1)
    if qtype in WITH_MIN:
        data[..., 2:4] = halves(1.0)
    return QuantTensor(qtype, data.reshape(n, nb * bs), (n, k))


# bfloat16 steps of at least this many rows unpack the blocks to bfloat16 and take oneDNN's AMX GEMM (see
# ``linear``); the unpacked weight is made and dropped a slice of output channels at a time, this many bytes of
# float32 at most, so that the resident weights stay the blocks.
BF16_UNPACK_FROM_ROWS = 64
UNPACK_SLICE_BYTES = 8 * 2**20


@functools.cache
def amx() -> bool:
    return "amx_bf16" in cpu_flags()


def _unpacks_for_gemm(w: QuantTensor, x2: torch.Tensor) -> bool:
    """Whether this product unpacks the blocks for oneDNN's bfloat16 GEMM rather than run the block kernel: for
    steps of ``BF16_UNPACK_FROM_ROWS`` rows or more, where that GEMM is faster. With AMX it is (4x at 2,048 rows).
    Without AMX the packed kernel's int8 products outrun a bfloat16 GEMM at every row count (2-core AMD EPYC,
    AVX-512 BF16 and VNNI, 1B Llama shapes: 3-4x at 64 rows, 1.0-1.5x at 1,024), so a packed weight never
    unpacks there."""
    if x2.dtype != torch.bfloat16 or x2.shape[0] < BF16_UNPACK_FROM_ROWS:
        return False
    return not w.packed or amx()


def packed_unpacks_for_gemm(x2: torch.Tensor) -> bool:
    """``_unpacks_for_gemm`` for a packed weight, which needs nothing else of it (``Linear``'s direct call)."""
    return x2.dtype == torch.bfloat16 and x2.shape[0] >= BF16_UNPACK_FROM_ROWS and amx()


def _dequantized_rows(w: QuantTensor, n0: int, n1: int) -> torch.Tensor:
    """Channels ``[n0, n1)`` of ``w`` as float32 (``n0`` a multiple of ``GROUP`` for a packed weight)."""
    n, k = w.shape
    if w.packed:
        return packed_ops().dequantize(w.data[n0 // GROUP : -(-n1 // GROUP)], QTYPES[w.qtype], k, n1 - n0)
    return w.rows(slice(n0, n1)).dequantize()


def _unpacked_bf16_linear(x2: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    n, k = w.shape
    step = max(GROUP, UNPACK_SLICE_BYTES // (4 * k) // GROUP * GROUP)
    if step >= n:
        return F.linear(x2, _dequantized_rows(w, 0, n).to(x2.dtype))
    out = torch.empty(x2.shape[0], n, dtype=x2.dtype, device=x2.device)
    for n0 in range(0, n, step):
        n1 = min(n, n0 + step)
        out[:, n0:n1] = F.linear(x2, _dequantized_rows(w, n0, n1).to(x2.dtype))
    return out


def linear(x: torch.Tensor, w: QuantTensor | QuantParts, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize(w)^T (+ bias)`` for ``x`` [..., K] (float32 or bfloat16).

    The block kernel serves float32 at every row count (a row's numbers then never depend on its batch), and
    bfloat16 decode steps. A bfloat16 step of ``BF16_UNPACK_FROM_ROWS`` rows or more (a prefill chunk) unpacks the
    blocks slice by slice to bfloat16 for oneDNN's GEMM where that is faster (``_unpacks_for_gemm``): on the
    2-core Xeon with AMX the row-layout kernel is compute-bound (a 3072 x 576 Q4_1 weight at 2,048 rows: 63 ms)
    where unpacking and AMX take 3.9 ms; at 16 rows the blocks win (0.73 vs 1.25 ms), at 64 the unpacking (1.3 vs
    2.8 ms). bfloat16 rows of such a step carry the GEMM's rounding, not the kernel's int8 activations: in
    bfloat16 a row's last bits may then depend on its batch."""
    if isinstance(w, QuantParts):
        y = torch.cat([linear(x, part) for part in w.parts], dim=-1)
        return y + bias if bias is not None else y
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    op = quant_ops() if x.device.type == "cpu" else None
    if op is not None and _unpacks_for_gemm(w, x2):
        y = _unpacked_bf16_linear(x2.contiguous(), w)
        if bias is not None:
            y = y + bias
        return y.reshape(*lead, w.shape[0])
    if w.packed:
        xk = x2 if x2.dtype in (torch.float32, torch.bfloat16) else x2.float()
        y = packed_ops().linear(xk, w.data, QTYPES[w.qtype], k, w.shape[0]).to(x.dtype)
        if bias is not None:
            y = y + bias
    elif op is not None and w.qtype in ROW_KERNEL_TYPES:
        # Every row count takes the kernel, so a row's result never depends on what shares its batch (and the
        # integer products keep up with the float32 GEMM even at prefill sizes: bench.linear_kernels).
        y = op.linear(x2.float(), w.data, QTYPES[w.qtype], k).to(x.dtype)
        if bias is not None:
            y = y + bias
    else:
        y = F.linear(x2, w.dequantize().to(x.dtype), bias)
    return y.reshape(*lead, w.shape[0])


def embedding(ids: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    """Rows ``ids`` of ``dequantize(w)``, float32, without unpacking the others."""
    op = quant_ops() if w.data.device.type == "cpu" else None
    flat = ids.reshape(-1)
    if w.packed:
        rows = packed_ops().rows(w.data, flat.to(torch.int64), QTYPES[w.qtype], w.shape[1], w.shape[0])
    elif op is not None and w.qtype in ROW_KERNEL_TYPES:
        rows = op.rows(w.data, flat.to(torch.int64), QTYPES[w.qtype], w.shape[1])
    else:
        rows = reference_dequantize(w.rows(flat))
    return rows.reshape(*ids.shape, w.shape[1])
