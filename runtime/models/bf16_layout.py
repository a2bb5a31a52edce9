"""Which layout serves bfloat16 linear weights on this CPU, decided once per machine.

Two layouts serve a bfloat16 weight on a CPU with AVX-512 BF16 (``bf16_kernels``, ``linear``):

* **pairs**: packed in pairs of K for ``csrc/bf16_packed.cpp``, whose one kernel multiplies every row count with
  ``vdpbf16ps``. With AMX, two other ways serve products over the same layout from the row counts where they were
  measured faster: ``csrc/bf16_tiles.cpp`` from ``tiles_from_rows`` (the weight read in place as the tiles' B
  operand: a block of the pairs layout is a column of B tiles), and from ``unpack_from_rows`` oneDNN's GEMM over the
  weight unpacked a slice at a time (``bf16_kernels.unpacked_product``);
* **onednn**: packed for oneDNN (its kernels at every row count; with AMX, on the tile units).

Without AMX the pairs serve at every row count (2-core AMD EPYC Zen 4: one layer of SmolLM2's shapes 0.35 against
oneDNN's 0.53 ms at 16 rows, 36.0 against 34.3 ms at 2,048; every served workload faster; docs/benchmarks.md),
chosen without measuring. With AMX the answer is the machine's: the tile units multiply a prefill chunk several
times faster than ``vdpbf16ps``, but a decode step streams the weights, which oneDNN did at ~13 GB/s of the ~25 GB/s
the 2-core Xeon reads (docs/benchmarks.md, 2026-12-02). So the first start on such a CPU times them (``measure``, on
the threads steps run with; ``runtime.measured``): every way at 1 and 16 rows over 96 MB of weights, more than a
cache holds, and at 64, 256 and 1,024 rows (``decide``): the pairs' kernel, the tiles, the pairs unpacked and
oneDNN's layout. ``tiles_from_rows`` is the first of those row counts where the tiles beat the pairs' kernel,
``unpack_from_rows`` the first where unpacking beat what the pairs served there otherwise; the pairs serve where
they are faster at decode and not much slower on a chunk (``CHUNK_SLACK``). What was measured is kept beside the
compiled kernels (one file per machine and kernel sources) and logged. ``RADIXSERVE_BF16_LAYOUT=pairs|onednn``,
``RADIXSERVE_BF16_TILES_FROM_ROWS`` and ``RADIXSERVE_BF16_UNPACK_FROM_ROWS`` override the choice (``runtime.envs``).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from radixserve.runtime import envs
from radixserve.runtime.cpu_features import cpu_flags
from radixserve.runtime.measured import once, race

logger = logging.getLogger("radixserve.model")

NEVER = 1 << 30  # a row count no step reaches: the pairs' kernel takes every product
CACHE_FILE = "bf16_layout.json"
# The layouts are compared on decode steps of these many rows (summed) and on a prefill chunk of the last of
# MANY_ROWS rows; the pairs serve where they are faster at decode and their chunk (their kernel's or unpacked) takes
# at most CHUNK_SLACK times oneDNN's. Why not a single mix: a chunk costs as much as ~40 decode steps, and which share
# a workload spends in each varies (prefix-cached traffic is mostly decode); on the 2-core Zen 4 the pairs serve
# every workload best (docs/benchmarks.md) with a chunk at 1.07x oneDNN's and decode 1.2-2x faster.
DECODE_ROWS = (1, 16)
CHUNK_SLACK = 1.15
MANY_ROWS = (64, 256, 1024)


@dataclass(frozen=True)
class Bf16Layout:
    """How bfloat16 linear weights are served (see the module doc)."""

    pairs: bool  # packed in pairs of K (csrc/bf16_packed.cpp); False: packed for oneDNN
    unpack_from_rows: int = NEVER  # with the pairs: products of this many rows or more take oneDNN's GEMM
    why: str = ""
    tiles_from_rows: int = NEVER  # with the pairs and AMX: from this many rows (below the above) the tiles serve


@functools.cache
def chosen() -> Bf16Layout:
    """This machine's layout (``RADIXSERVE_BF16_LAYOUT``, ``RADIXSERVE_BF16_UNPACK_FROM_ROWS`` and, with AMX,
    ``RADIXSERVE_BF16_TILES_FROM_ROWS`` first; measured only where they leave something open). Only asked
    where both layouts can serve: AVX-512 BF16, the pairs' kernel built and checked (``bf16_kernels``)."""
    forced, rows, tiles = envs.bf16_layout(), envs.bf16_unpack_from_rows(), envs.bf16_tiles_from_rows()
    if forced == "onednn":
        return Bf16Layout(False, NEVER, "RADIXSERVE_BF16_LAYOUT=onednn")
    if "amx_bf16" not in cpu_flags():
        return Bf16Layout(True, rows or NEVER, "no AMX: the pairs serve every workload faster")
    if forced == "pairs" and rows is not None and tiles is not None:
        return Bf16Layout(True, rows, "RADIXSERVE_BF16_LAYOUT=pairs", tiles)
    found = measured()
    layout = Bf16Layout(
        forced == "pairs" or found["pairs"],
        rows or int(found["unpack_from_rows"]),
        "RADIXSERVE_BF16_LAYOUT=pairs" if forced == "pairs" else "measured on this CPU",
        tiles or int(found["tiles_from_rows"]),
    )
    decode, served = found["decode_ms"], found["served_ms"]
    logger.info(
        "bfloat16 weights %s (%s, %d threads: decode steps of %s rows %s ms in pairs, %s ms in oneDNN's layout; a "
        "%s-row chunk %.2fx oneDNN's in pairs)%s%s",
        "packed in pairs of K" if layout.pairs else "packed for oneDNN",
        layout.why,
        found["threads"],
        "/".join(decode["onednn"]),
        "/".join(f"{served[r]:.1f}" for r in decode["onednn"]),
        "/".join(f"{ms:.1f}" for ms in decode["onednn"].values()),
        list(found["many_rows_ms"])[-1],
        found["chunk_ratio"],
        f"; from {layout.tiles_from_rows} rows on AMX tiles" if layout.pairs and layout.tiles_from_rows < NEVER else "",
        f"; from {layout.unpack_from_rows} rows unpacked for oneDNN's GEMM"
        if layout.pairs and layout.unpack_from_rows < NEVER
        else "",
    )
    return layout


def measured() -> dict:
    """What ``measure`` found on this machine (``runtime.measured.once``: kept beside the compiled kernels)."""
    keys = {"pairs", "tiles_from_rows", "unpack_from_rows", "chunk_ratio", "served_ms"}
    keys |= {"threads", "decode_ms", "many_rows_ms"}
    return once(CACHE_FILE, keys, measure, "the bfloat16 weight layouts")


def measure(
    weights: int = 24,
    shape: tuple[int, int] = (2048, 1024),
    decode_rows: tuple[int, ...] = DECODE_ROWS,
    many_rows: tuple[int, ...] = MANY_ROWS,
    rounds: int = 5,
) -> dict:
    """Times both layouts on the caller's intra-op threads over ``weights`` random weights of ``shape`` (24 of
    2,048 x 1,024: 96 MB each way, so that a pass streams them from memory as a decode step does) at each of
    ``decode_rows``, and on two of the weights at each of ``many_rows``: the pairs' kernel (``pairs``), the tiles
    where they serve (``tiles``, ``bf16_kernels.tiles_ops``), the pairs unpacked for oneDNN's GEMM (``unpacked``,
    ``many_rows`` only) and oneDNN's layout (``onednn``). Returns the medians (ms a pass) with what ``decide``
    makes of them."""
    from radixserve.runtime.models.bf16_kernels import packed_ops, tiles_ops, unpacked_product
    from radixserve.runtime.models.linear import PACK_BATCH_HINT

    ops, tiles = packed_ops(), tiles_ops()
    assert ops is not None, "measure needs the pairs' kernel (bf16_kernels.packed_ops)"
    gen = torch.Generator().manual_seed(0)
    none = torch.empty(0, dtype=torch.bfloat16)
    n, k = shape
    few = min(2, weights)
    with torch.inference_mode():
        plain = torch.randn(shape, generator=gen).to(torch.bfloat16)
        pairs = [ops.pack([plain.clone()], 1) for _ in range(weights)]
        onednn = [torch.ops.mkldnn._reorder_linear_weight(plain.clone(), PACK_BATCH_HINT) for _ in range(weights)]

        def ways(x: torch.Tensor, count: int, unpacked: bool) -> dict:
            onednn_linear = torch.ops.mkldnn._linear_pointwise
            found = {
                "pairs": lambda: [ops.linear(x, w, none) for w in pairs[:count]],
                "onednn": lambda: [onednn_linear(x, w, None, "none", [], "") for w in onednn[:count]],
            }
            if tiles is not None:
                found["tiles"] = lambda: [tiles.linear(x, w, none) for w in pairs[:count]]
            if unpacked:
                found["unpacked"] = lambda: [unpacked_product(x, w, None, False) for w in pairs[:count]]
            return found

        decode: dict[str, dict[str, float]] = {}
        for rows in decode_rows:
            x = torch.randn((rows, k), generator=gen).to(torch.bfloat16)
            timed = ways(x, weights, unpacked=False)
            for way, ms in zip(timed, race(list(timed.values()), rounds), strict=True):
                decode.setdefault(way, {})[str(rows)] = ms
        many: dict[str, dict[str, float]] = {}
        for rows in many_rows:
            x = torch.randn((rows, k), generator=gen).to(torch.bfloat16)
            timed = ways(x, few, unpacked=True)
            many[str(rows)] = dict(zip(timed, race(list(timed.values()), max(1, rounds // 2)), strict=True))
    return {
        **decide(decode, many),
        "decode_ms": decode,
        "many_rows_ms": many,
        "weights": [weights, n, k],
        "threads": torch.get_num_threads(),
    }


def decide(decode: dict[str, dict[str, float]], many: dict[str, dict[str, float]]) -> dict:
    """What serves, from ``measure``'s medians (``decode``: way -> rows -> ms, ``many``: rows -> way -> ms):

    * ``tiles_from_rows``: the fewest measured rows where the tiles beat the pairs' kernel (``NEVER``: nowhere, or no
      tiles), ``unpack_from_rows``: the fewest where unpacking beat what the pairs served there otherwise; products
      of that many rows or more take that way (a way that wins at some size is taken to keep winning above it);
    * ``served_ms``: rows -> what the pairs take that way;
    * ``pairs``: the pairs faster at the decode rows (summed) and their chunk (the last of ``many``) at most
      ``CHUNK_SLACK`` times oneDNN's (``chunk_ratio``)."""
    timed = {int(rows): {way: decode[way][rows] for way in decode} for rows in decode["onednn"]}
    timed |= {int(rows): ways for rows, ways in many.items()}
    order = sorted(timed)
    inf = float("inf")
    tiles_from = next((r for r in order if timed[r].get("tiles", inf) < timed[r]["pairs"]), NEVER)

    def kernel(rows: int) -> float:
        return timed[rows]["tiles"] if rows >= tiles_from else timed[rows]["pairs"]

    unpack_from = next((r for r in order if timed[r].get("unpacked", inf) < kernel(r)), NEVER)
    served = {r: timed[r]["unpacked"] if r >= unpack_from else kernel(r) for r in order}
    chunk = max(int(r) for r in many)
    ratio = served[chunk] / timed[chunk]["onednn"]
    faster = sum(served[int(r)] for r in decode["onednn"]) < sum(decode["onednn"].values())
    return {
        "pairs": faster and ratio <= CHUNK_SLACK,
        "tiles_from_rows": tiles_from,
        "unpack_from_rows": unpack_from,
        "chunk_ratio": ratio,
        "served_ms": {str(r): ms for r, ms in served.items()},
    }
