"""Pre-quantized checkpoints, GPTQ and AWQ (``quantization_config.quant_method``), loaded onto the block kernels.

A GPTQ linear layer ``P`` is stored as ``P.qweight`` (int32 ``[K * bits / 32, N]``: ``32 / bits`` levels of
consecutive inputs per word, lowest bits first), ``P.qzeros`` (int32 ``[groups, N * bits / 32]``: the zero point of
each group and output, packed along the outputs), ``P.scales`` (fp16 ``[groups, N]``) and ``P.g_idx`` (int32
``[K]``: the group of each input). The weight is ``scales[g_idx[k], n] * (q[k, n] - z[g_idx[k], n])``. In the
``gptq`` checkpoint format (AutoGPTQ's, what the hub holds) the stored zero is one less than the real one;
``gptq_v2`` stores it as it is.

An AWQ layer (AutoAWQ's GEMM layout, ``version: "gemm"``, 4 bits) has no ``g_idx`` (its groups are always runs of
``group_size`` inputs) and packs along the outputs instead: ``qweight`` is int32 ``[K, N / 8]`` and ``qzeros``
``[groups, N / 8]``, the 8 levels of a word in the order 0, 2, 4, 6, 1, 3, 5, 7 of their output channels. Its
zeros are stored as they are. The weight is the same formula.

Where the groups are runs of consecutive inputs (``g_idx[k] == k // group_size``, with a group size a multiple
of 32), a layer maps onto ggml's blocks of 32 with the same arithmetic:
- 4 bits, symmetric (every zero 8): **Q4_0**, exactly: ``d = scale``, levels as they are;
- 4 bits, other zeros: **Q4_1**, ``d = scale`` and ``m = -scale * zero`` rounded once to fp16 (the one rounding);
- 8 bits, symmetric (every zero 128): **Q8_0**, exactly: ``d = scale``, levels minus 128.
Otherwise (act-order checkpoints, ``desc_act``, whose groups are scattered over the inputs; 8 bits with other
zeros) the layer is dequantized exactly and re-quantized to Q8_0 blocks, logged once. Where blocks are not served
(a GPU, tensor parallelism, ``--quantization none``) every layer is dequantized exactly into the model's dtype.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.runtime.models.quant import BLOCK, QuantTensor, quantize_q8_0

logger = logging.getLogger("radixserve.model")

PARTS = ("qweight", "qzeros", "scales", "g_idx")


# AWQ's order of output channels within a packed word: level i of a word is channel AWQ_ORDER[i] of its 8.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
SERVED = "GPTQ (4 or 8 bits) and AWQ (4 bits, GEMM layout) safetensors checkpoints, GGUF files, and --quantization "


@dataclass(frozen=True)
class QuantSpec:
    method: str  # "gptq" or "awq"
    bits: int
    group_size: int  # -1: one group over all inputs
    desc_act: bool
    zero_offset: int  # added to the stored zeros: 1 in GPTQ's "gptq" format, 0 in "gptq_v2" and AWQ

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> QuantSpec | None:
        """The checkpoint's quantization settings; None for a checkpoint that is not quantized. Other methods and
        layouts are refused with the list of those served."""
        qc = getattr(hf_config, "quantization_config", None)
        if not qc:
            return None
        method = str(qc.get("quant_method", "")).lower()
        served = SERVED + "int8/int4 of a float checkpoint"
        bits = int(qc.get("bits", 4))
        group = int(qc.get("group_size", 128))
        if method == "awq":
            version = str(qc.get("version", "gemm")).lower()
            if bits != 4 or version != "gemm" or not qc.get("zero_point", True):
                raise ValueError(
                    f"AWQ checkpoints of {bits} bits, version {version!r}, zero_point "
                    f"{qc.get('zero_point', True)} are not supported; served: {served}"
                )
            return cls("awq", 4, group, False, 0)
        if method != "gptq":
            raise ValueError(f"checkpoint quantization {method or qc!r} is not supported; served: {served}")
        if bits not in (4, 8):
            raise ValueError(f"GPTQ checkpoints of {bits} bits are not supported; served: {served}")
        fmt = str(qc.get("checkpoint_format", "gptq"))
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint format {fmt!r} is not supported; served: gptq, gptq_v2")
        return cls("gptq", bits, group, bool(qc.get("desc_act", False)), int(fmt == "gptq"))


def _unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words holding ``32 / bits`` levels each (lowest bits first) -> the levels along ``dim``, as int16."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    if dim == 0:  # [R, C] -> [R * per, C]
        levels = (words[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
        return levels.reshape(words.shape[0] * per, words.shape[1]).to(torch.int16)
    levels = (words[:, :, None] >> shifts[None, None, :]) & ((1 << bits) - 1)  # [R, C] -> [R, C * per]
    return levels.reshape(words.shape[0], words.shape[1] * per).to(torch.int16)


def _awq_columns(levels: torch.Tensor) -> torch.Tensor:
    """Levels unpacked along the outputs in AWQ's word order -> in channel order."""
    rows, cols = levels.shape
    out = torch.empty_like(levels)
    out.view(rows, cols // 8, 8)[:, :, list(AWQ_ORDER)] = levels.view(rows, cols // 8, 8)
    return out


def _levels(parts: dict[str, torch.Tensor], spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [N, K], zeros [groups, N], scales [groups, N] float32), the zeros with the format's offset applied."""
    if spec.method == "awq":
        q = _awq_columns(_unpack(parts["qweight"].to(torch.int32), 4, 1)).t()
        zeros = _awq_columns(_unpack(parts["qzeros"].to(torch.int32), 4, 1))
        return q, zeros, parts["scales"].float()
    q = _unpack(parts["qweight"].to(torch.int32), spec.bits, 0).t()
    n = q.shape[0]
    zeros = _unpack(parts["qzeros"].to(torch.int32), spec.bits, 1)[:, :n]
    zeros = (zeros + spec.zero_offset) & ((1 << spec.bits) - 1) if spec.zero_offset else zeros
    return q, zeros, parts["scales"].float()


def _group_index(parts: dict[str, torch.Tensor], spec: QuantSpec, k: int) -> torch.Tensor:
    g_idx = parts.get("g_idx")
    if g_idx is not None:
        return g_idx.long()
    group = spec.group_size if spec.group_size > 0 else k
    return torch.arange(k) // group


def dequantize(parts: dict[str, torch.Tensor], spec: QuantSpec) -> torch.Tensor:
    """The layer's float32 weight [N, K], exactly."""
    q, zeros, scales = _levels(parts, spec)
    return _weight(q, zeros, scales, _group_index(parts, spec, q.shape[1]))


def _weight(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return (q.float() - zeros[g].t().float()) * scales[g].t()


def to_blocks(parts: dict[str, torch.Tensor], spec: QuantSpec) -> tuple[QuantTensor, str]:
    """The layer as ggml blocks of 32, and how: "exact", "offsets rounded" (Q4_1's fp16 offsets) or
    "re-quantized" (Q8_0 of the exact weight; see the module docstring)."""
    q, zeros, scales = _levels(parts, spec)
    n, k = q.shape
    g = _group_index(parts, spec, k)
    if not _contiguous_groups(g) or (spec.bits == 8 and not bool((zeros == 128).all())):
        return quantize_q8_0(_weight(q, zeros, scales, g)), "re-quantized"
    first = g[::BLOCK]  # each block's group
    d = scales[first].t().contiguous()  # [N, K / 32]
    z = zeros[first].t().contiguous()
    nb = k // BLOCK
    d16 = d.to(torch.float16).view(torch.uint8).reshape(n, nb, 2)
    if spec.bits == 8:
        levels = (q - 128).to(torch.int8).view(torch.uint8).reshape(n, nb, BLOCK)
        return QuantTensor("Q8_0", torch.cat([d16, levels], dim=-1).reshape(n, -1).contiguous(), (n, k)), "exact"
    nib = q.to(torch.uint8).reshape(n, nb, BLOCK)
    packed = nib[..., :16] | (nib[..., 16:] << 4)  # ggml: byte j holds weights j and j + 16
    if bool((z == 8).all()):
        return QuantTensor("Q4_0", torch.cat([d16, packed], dim=-1).reshape(n, -1).contiguous(), (n, k)), "exact"
    m16 = (-d * z.float()).to(torch.float16).view(torch.uint8).reshape(n, nb, 2)
    data = torch.cat([d16, m16, packed], dim=-1).reshape(n, -1).contiguous()
    return QuantTensor("Q4_1", data, (n, k)), "offsets rounded"


def _contiguous_groups(g: torch.Tensor) -> bool:
    """Whether the groups are runs of consecutive inputs, each a whole number of blocks of 32."""
    k = len(g)
    size = int(torch.unique_consecutive(g, return_counts=True)[1][0]) if k else 0
    return k % BLOCK == 0 and size % BLOCK == 0 and size > 0 and bool(torch.equal(g, torch.arange(k) // size))


def iter_quantized_weights(
    weights: Iterator[tuple[str, torch.Tensor]], spec: QuantSpec, blocks: bool
) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors with each quantized layer's parts replaced by its ``.weight``: blocks where ``blocks``
    (see the module docstring), else the exact float32 weight. A layer is complete once its ``qweight``,
    ``qzeros`` and ``scales`` are in, and its ``g_idx`` where the checkpoint is act-order."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    how: Counter[str] = Counter()
    needed = {"qweight", "qzeros", "scales"} | ({"g_idx"} if spec.desc_act else set())
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part not in PARTS:
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[part] = tensor
        if not needed <= parts.keys():
            continue
        del pending[prefix]
        if not blocks:
            how["dequantized"] += 1
            yield f"{prefix}.weight", dequantize(parts, spec)
            continue
        w, kind = to_blocks(parts, spec)
        how[f"{w.qtype} ({kind})"] += 1
        yield f"{prefix}.weight", w
    incomplete = [p for p, parts in pending.items() if parts.keys() != {"g_idx"}]  # a late g_idx: groups known
    if incomplete:
        raise ValueError(f"quantized layer {incomplete[0]} lacks some of qweight, qzeros, scales in the checkpoint")
    logger.info(
        "%s %d-bit checkpoint, group size %d%s: %s",
        spec.method.upper(), spec.bits, spec.group_size, ", act-order" if spec.desc_act else "",
        ", ".join(f"{n} layers {kind}" for kind, n in how.items()),
    )  # fmt: skip
