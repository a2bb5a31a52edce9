"""One decoder layer's bfloat16 projections, streamed from memory: the kernels the engine may serve them with.

A layer of a Llama shape (q/k/v, o, gate/up, down) is multiplied at 1 to 256 rows, over ``--layers`` layers' worth
of distinct weights (2 by default; more for small shapes, which the caches would hold) so that every call reads its
weights from memory, not from the caches, as a decode step does:

* ``packed``: the AVX-512 BF16 kernel over the weights packed in pairs of K, q/k/v packed from three parts
  (``csrc/bf16_packed.cpp``: what the engine runs at every row count on a CPU with AVX-512 BF16 and no AMX), in the
  kernels' 2 MB slabs as the engine holds them; ``packed 4K``: the same weights copied into torch's own memory
  (4 KB pages where transparent huge pages are only used when advised);
* ``kernel``: the dot-product kernel on the plain weights, q/k/v as three parts (``csrc/bf16_linear.cpp``, what the
  engine runs up to ``bf16_kernels.BF16_KERNEL_MAX_ROWS`` rows for a head tied to the embedding);
* ``packed + silu_mul`` and ``gated``: the packed kernel with the MLP's SiLU-and-mul after the gate/up product, and
  the gate/up product multiplied gated in one call (``linear_silu_mul``: what the engine runs);
* ``onednn``: oneDNN on prepacked weights (what the engine runs with AMX, and ran everywhere before);
* ``F.linear``: on the plain weights (the engine's path above the kernel's rows).

Printed: milliseconds per layer (median of 5), each against oneDNN, the gated layer against the separate one, and
the packed kernel on huge pages against 4 KB pages.

With ``--checkpoint DIR`` (a bfloat16 safetensors folder) it times instead the kernel at one row over every
matrix of the checkpoint, mapped from its files as the loader maps them, against the same bytes copied into fresh
memory, alternating (why the engine moves mapped weights into memory of its own: ``runtime.mapped_weights``).

    python -m bench.bf16_layer                      # the 1B Llama shape (hidden 2048, MLP 8192, 8 KV heads)
    python -m bench.bf16_layer --hidden 3072 --intermediate 8192
    python -m bench.bf16_layer --hidden 576 --intermediate 1536 --kv-dim 192 --layers 30   # SmolLM2-135M
    python -m bench.bf16_layer --checkpoint ~/.cache/radixserve/bench-models/random-llama-1b
    python -m bench.bf16_layer --hidden 576 --intermediate 1536 --kv-dim 192 --layers 30 --rows 2048 --busy 1/8
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import busy_neighbour, format_table, machine_summary
from radixserve.runtime.cpu_ext import load_kernels
from radixserve.runtime.models.bf16_kernels import packed_ops, small_rows_kernel


def mapped_against_copied(folder: Path, rounds: int = 4) -> None:
    """The kernel at one row over every 2-D bfloat16 tensor of ``folder``: mapped, then copied, ``rounds`` times."""
    from radixserve.runtime.safetensors_read import iter_file
    from radixserve.runtime.weights import safetensors_files

    kernel = small_rows_kernel()
    mapped = [t for f in safetensors_files(folder)
              for _, t in iter_file(f, mapped=lambda _n, d, s: d == torch.bfloat16 and len(s) == 2)
              if t.dim() == 2 and t.shape[1] % 32 == 0 and t.shape[0] % 16 == 0]  # fmt: skip
    copied = [t.clone() for t in mapped]
    none, nbytes = torch.empty(0), sum(t.nbytes for t in mapped)
    xs = {k: torch.randn(1, k).to(torch.bfloat16) for k in {t.shape[1] for t in mapped}}

    def once(ws: list[torch.Tensor]) -> float:
        start = time.perf_counter()
        for w in ws:
            kernel(xs[w.shape[1]], [w], none)
        return time.perf_counter() - start

    rows = []
    with torch.inference_mode():
        for r in range(rounds):
            a, b = (statistics.median(once(ws) for _ in range(5)) for ws in (mapped, copied))
            rows.append([r + 1, a * 1e3, b * 1e3, nbytes / a / 1e9, nbytes / b / 1e9, a / b])
    print(f"# {folder.name}: {len(mapped)} matrices, {nbytes / 2**20:.0f} MiB, one row; {machine_summary()}")
    print(format_table(["round", "mapped ms", "copied ms", "mapped GB/s", "copied GB/s", "mapped / copied"], rows))


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--kv-dim", type=int, default=512, help="KV heads x head dim")
    p.add_argument("--layers", type=int, default=2, help="layers of distinct weights, each call its own")
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--checkpoint", type=Path, help="time mapped against copied weights of this folder instead")
    p.add_argument("--busy", default="", help="MS/PERIOD: a busy loop in another process meanwhile (e.g. 1/8)")
    args = p.parse_args(argv)
    kernel = small_rows_kernel()
    if kernel is None or packed_ops() is None:
        raise SystemExit("the AVX-512 BF16 kernels do not run on this CPU")
    torch.set_num_threads(args.threads)
    if args.checkpoint is not None:
        mapped_against_copied(args.checkpoint.expanduser())
        return
    h, i, kv = args.hidden, args.intermediate, args.kv_dim
    gen = torch.Generator().manual_seed(0)

    def weight(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)

    layers = [{"qkv": [weight(h, h), weight(kv, h), weight(kv, h)], "o": [weight(h, h)],
               "gate_up": [weight(2 * i, h)], "down": [weight(h, i)]} for _ in range(args.layers)]  # fmt: skip
    plain = [{name: torch.cat(parts) for name, parts in layer.items()} for layer in layers]
    packed = [{name: torch.ops.mkldnn._reorder_linear_weight(w, 8) for name, w in layer.items()} for layer in plain]
    pairs_ops = packed_ops()
    pairs = [{name: pairs_ops.pack(parts) for name, parts in layer.items()} for layer in layers]
    # The same packed weights in memory of torch's own (4 KB pages where transparent huge pages are "madvise"), where
    # pack's are in the kernels' 2 MB slabs.
    small_pages = [{name: w.clone() for name, w in layer.items()} for layer in pairs]
    none = torch.empty(0)

    def run(matmul: Callable[[str, int, torch.Tensor], object], rows: int) -> float:
        xs = {h: torch.randn(rows, h).to(torch.bfloat16), i: torch.randn(rows, i).to(torch.bfloat16)}
        start = time.perf_counter()
        for n in range(len(layers)):
            for name in ("qkv", "o", "gate_up", "down"):
                matmul(name, n, xs[i if name == "down" else h])
        return (time.perf_counter() - start) / len(layers)  # per layer

    silu_mul = load_kernels().fused_ops.silu_mul

    def separate(name: str, n: int, x: torch.Tensor) -> object:  # the MLP's gate/up product, then its SiLU-and-mul
        y = pairs_ops.linear(x, pairs[n][name], none)
        return silu_mul(y) if name == "gate_up" else y

    def gated(name: str, n: int, x: torch.Tensor) -> object:  # the same in one call
        w = pairs[n][name]
        return pairs_ops.linear_silu_mul(x, w, none) if name == "gate_up" else pairs_ops.linear(x, w, none)

    ways: dict[str, Callable[[str, int, torch.Tensor], object]] = {
        "packed": lambda name, n, x: pairs_ops.linear(x, pairs[n][name], none),
        "packed 4K": lambda name, n, x: pairs_ops.linear(x, small_pages[n][name], none),
        "packed + silu_mul": separate,
        "gated": gated,
        "kernel": lambda name, n, x: kernel(x, layers[n][name], none),
        "onednn": lambda name, n, x: torch.ops.mkldnn._linear_pointwise(x, packed[n][name], None, "none", [], ""),
        "F.linear": lambda name, n, x: F.linear(x, plain[n][name]),
    }
    table = []
    with torch.inference_mode(), busy_neighbour(args.busy):
        for rows in (int(r) for r in args.rows.split(",")):
            ms = {}
            for name, way in ways.items():
                run(way, rows)
                ms[name] = statistics.median(run(way, rows) for _ in range(5)) * 1e3
            speed = [ms["onednn"] / ms[n] for n in ("packed", "kernel", "F.linear")]
            pages = ms["packed 4K"] / ms["packed"]
            table.append([rows, *(ms[n] for n in ways), *speed, ms["packed + silu_mul"] / ms["gated"], pages])
    busy = f", busy neighbour {args.busy} ms" if args.busy else ""
    print(f"# one layer of hidden {h}, MLP {i}, KV {kv}, bfloat16, {args.threads} threads{busy}; {machine_summary()}")
    heads = ["rows", "packed ms", "packed 4K ms", "+ silu_mul ms", "gated ms", "kernel ms", "oneDNN ms", "F.linear ms"]
    tail = ["packed x oneDNN", "kernel x oneDNN", "F.linear x oneDNN", "gated x separate", "huge x 4K pages"]
    print(format_table([*heads, *tail], table))


if __name__ == "__main__":
    main()
