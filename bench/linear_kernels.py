"""Linear-layer kernels on this CPU, at a model's shapes: the time of one ``x @ W^T`` per candidate.

The decode step of a small model is mostly its linear layers, and at a few rows they are bound by the bytes of
weights they read; this measures which kernel and which weight format make them fastest, at 1 to 2,048 rows:

* ``f32``: ``F.linear`` on float32 weights (MKL);
* ``f32-onednn``: oneDNN on a prepacked float32 weight (what the engine runs for float32 on CPU);
* ``bf16``: ``F.linear`` on bfloat16 weights and activations;
* ``int8``: ``torch.ops.aten._weight_int8pack_mm`` (int8 weights, one scale per output channel, float32 activations);
* ``int4-g{32,64,128}``: ``_weight_int4pack_mm_for_cpu`` (int4 weights, group-wise scales and zeros);
* ``ours-Q8_0``, ``ours-Q4_1``: the engine's row-layout block kernel (``runtime/models/csrc/quant_linear.cpp``);
  ``ours-Q8_0-packed``, ``ours-Q4_1-packed``: the 16-channel-group kernel (``quant_packed.cpp``, AVX-512 VNNI or
  AVX2), which the engine serves where the CPU runs it.

    python -m bench.linear_kernels --rows 1,16,256 --shapes 576x1728,576x576,576x3072,1536x576,576x49152
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from bench.common import format_table, machine_summary

# SmolLM2-135M: qkv (576 -> 576 + 2 * 192), o, gate_up (576 -> 2 * 1536), down, lm_head.
DEFAULT_SHAPES = "576x960,576x576,576x3072,1536x576,576x49152"


def _int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127
    q = torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8)
    return q, scale


def _int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    zero = lo + 8 * scale  # the op dequantizes (q - 8) * scale + zero
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)  # inner_k_tiles is ignored on CPU
    scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [k / group, n, 2]
    return packed, scales_zeros


def candidates(w: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"f32": lambda x: F.linear(x, w)}
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 8)
        out["f32-onednn"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (AttributeError, RuntimeError):
        pass
    wb = w.to(torch.bfloat16)
    out["bf16"] = lambda x: F.linear(x.to(torch.bfloat16), wb)
    q8, s8 = _int8(w)
    out["int8"] = lambda x: torch.ops.aten._weight_int8pack_mm(x, q8, s8)
    for group in (32, 64, 128):
        if w.shape[1] % group == 0:
            q4, sz = _int4(w, group)
            out[f"int4-g{group}"] = lambda x, q4=q4, sz=sz, group=group: torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, q4, group, sz
            )
    from radixserve.runtime.models import quant

    for qtype, quantize in quant.QUANTIZERS.items():  # ours: GGUF blocks, int8 activations
        blocks = quantize(w)
        out[f"ours-{qtype}"] = lambda x, blocks=blocks: quant.linear(x, blocks)
        groups = blocks.pack()  # 16-channel groups, where this CPU runs the packed kernel (what the engine serves)
        if groups.packed:
            out[f"ours-{qtype}-packed"] = lambda x, groups=groups: quant.linear(x, groups)
    return out


def time_op(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, budget_s: float) -> float:
    for _ in range(3):
        fn(x)
    times = []
    deadline = time.perf_counter() + budget_s
    while time.perf_counter() < deadline or len(times) < 5:
        t = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated INxOUT")
    p.add_argument("--rows", default="1,16,256")
    p.add_argument("--budget", type=float, default=0.5, help="seconds per measurement")
    p.add_argument("--only", default="", help="comma-separated candidate names (default: all)")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    with torch.inference_mode():
        for shape in args.shapes.split(","):
            k, n = (int(v) for v in shape.split("x"))
            w = torch.randn(n, k) / k**0.5
            ops = candidates(w)
            if args.only:
                ops = {k: v for k, v in ops.items() if k in args.only.split(",")}
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k)
                ref = F.linear(x, w)
                base = None
                for name, fn in ops.items():
                    err = (fn(x).float() - ref).abs().max().item() / ref.abs().max().item()
                    t = time_op(fn, x, args.budget)
                    base = base or t
                    rows.append([shape, m, name, t * 1e6, base / t, 2 * m * n * k / t / 1e9, err])
    print(f"# linear kernels, {machine_summary()}")
    print(format_table(["in x out", "rows", "kernel", "us", "vs f32", "GFLOP/s", "max rel err"], rows))


if __name__ == "__main__":
    main()
