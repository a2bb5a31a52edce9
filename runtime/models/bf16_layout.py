"""Which layout serves bfloat16 linear weights on this CPU, decided once per machine.

Two layouts serve a bfloat16 weight on a CPU with AVX-512 BF16 (``bf16_kernels``, ``linear``):

* **pairs**: packed in pairs of K for ``csrc/bf16_packed.cpp``, whose one kernel multiplies every row count with
  ``vdpbf16ps``; with AMX, a product of ``unpack_from_rows`` rows or more (a prefill chunk) unpacks the weight a
  slice at a time for oneDNN's GEMM, which runs on the tile units (``bf16_kernels.unpacked_product``);
* **onednn**: packed for oneDNN (its kernels at every row count; with AMX, on the tile units).

Without AMX the pairs win at every row count (2-core AMD EPYC Zen 4: one layer of SmolLM2's shapes 0.32 against
0.46 ms at 16 rows for the next best kernel, 34.7 against ``F.linear``'s 38.2 ms at 2,048; docs/benchmarks.md),
and are chosen without measuring. With AMX the answer is the machine's: the tile units multiply a prefill chunk
several times faster than ``vdpbf16ps``, but a decode step streams the weights, which oneDNN did at ~13 GB/s of the
~25 GB/s the 2-core Xeon reads (docs/benchmarks.md, 2026-12-02). So the first start on such a CPU times both
layouts (``measure``, on one thread: the loader's, see ``runtime.threads.one_intra_op_thread``) at 1 and 16 rows
over 96 MB of weights, more than a cache holds, and keeps the faster; with the pairs, it times them against
unpacking at 64, 256 and 1,024 rows for ``unpack_from_rows``. What it measured is kept beside the compiled kernels
(``cpu_ext.build_dir``: one per machine and kernel sources) and logged. ``RADIXSERVE_BF16_LAYOUT=pairs|onednn``
and ``RADIXSERVE_BF16_UNPACK_FROM_ROWS`` override the choice (``runtime.envs``).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixserve.runtime import envs
from radixserve.runtime.cpu_features import cpu_flags

logger = logging.getLogger("radixserve.model")

NEVER = 1 << 30  # a row count no step reaches: the pairs' kernel takes every product
CACHE_FILE = "bf16_layout.json"
DECODE_ROWS = (1, 16)
UNPACK_ROWS = (64, 256, 1024)


@dataclass(frozen=True)
class Bf16Layout:
    """How bfloat16 linear weights are served (see the module doc)."""

    pairs: bool  # packed in pairs of K (csrc/bf16_packed.cpp); False: packed for oneDNN
    unpack_from_rows: int = NEVER  # with the pairs: products of this many rows or more take oneDNN's GEMM
    why: str = ""


@functools.cache
def chosen() -> Bf16Layout:
    """This machine's layout (``RADIXSERVE_BF16_LAYOUT`` / ``RADIXSERVE_BF16_UNPACK_FROM_ROWS`` first). Only asked
    where both layouts can serve: AVX-512 BF16, the pairs' kernel built and checked (``bf16_kernels``)."""
    forced, rows = envs.bf16_layout(), envs.bf16_unpack_from_rows()
    if forced == "onednn":
        return Bf16Layout(False, NEVER, "RADIXSERVE_BF16_LAYOUT=onednn")
    if "amx_bf16" not in cpu_flags():
        return Bf16Layout(True, rows or NEVER, "no AMX: the pairs are faster at every row count")
    if forced == "pairs" and rows is not None:
        return Bf16Layout(True, rows, "RADIXSERVE_BF16_LAYOUT=pairs")
    found = measured()
    layout = Bf16Layout(
        forced == "pairs" or found["pairs"],
        rows or int(found["unpack_from_rows"]),
        "RADIXSERVE_BF16_LAYOUT=pairs" if forced == "pairs" else "measured on this CPU",
    )
    decode = found["decode_ms"]
    logger.info(
        "bfloat16 weights %s (%s; %s rows, one thread: pairs %s ms, oneDNN %s ms over 96 MB of weights)%s",
        "packed in pairs of K" if layout.pairs else "packed for oneDNN",
        layout.why,
        "/".join(str(r) for r in DECODE_ROWS),
        "/".join(f"{decode['pairs'][str(r)]:.1f}" for r in DECODE_ROWS),
        "/".join(f"{decode['onednn'][str(r)]:.1f}" for r in DECODE_ROWS),
        f"; from {layout.unpack_from_rows} rows the pairs unpack for oneDNN's GEMM"
        if layout.pairs and layout.unpack_from_rows < NEVER
        else "",
    )
    return layout


def measured() -> dict:
    """What ``measure`` found on this machine: read from beside the compiled kernels, or measured now and kept."""
    from radixserve.runtime.cpu_ext import build_dir

    path = build_dir() / CACHE_FILE
    try:
        found = json.loads(path.read_text())
        if {"pairs", "unpack_from_rows", "decode_ms"} <= found.keys():
            return found
    except (OSError, ValueError):
        pass
    logger.info("timing the bfloat16 weight layouts on this CPU (once per machine, about a second)")
    found = measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{CACHE_FILE}.{os.getpid()}")
        tmp.write_text(json.dumps(found, indent=1))
        tmp.replace(path)
    except OSError as exc:
        logger.warning("could not keep the bfloat16 layout timings in %s (%s)", path, exc)
    return found


def _medians(first: Callable[[], None], second: Callable[[], None], rounds: int) -> tuple[float, float]:
    """Median milliseconds of ``first`` and ``second``, run in turn (each once before timing)."""
    first(), second()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        for fn, out in ((first, times[0]), (second, times[1])):
            start = time.perf_counter()
            fn()
            out.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[0]), statistics.median(times[1])


def measure(
    weights: int = 24,
    shape: tuple[int, int] = (2048, 1024),
    decode_rows: tuple[int, ...] = DECODE_ROWS,
    unpack_rows: tuple[int, ...] = UNPACK_ROWS,
    rounds: int = 5,
) -> dict:
    """Times the two layouts on one intra-op thread over ``weights`` random weights of ``shape`` (24 of 2,048 x
    1,024: 96 MB each way, so that a pass streams them from memory as a decode step does) at ``decode_rows``
    rows, and the pairs' kernel against unpacking for oneDNN's GEMM (two of the weights) at ``unpack_rows`` rows
    until unpacking is the faster. Returns the medians (ms a pass), ``pairs`` (faster summed over
    ``decode_rows``) and ``unpack_from_rows`` (``NEVER`` where unpacking never won)."""
    from radixserve.runtime.models.bf16_kernels import packed_ops, unpacked_product
    from radixserve.runtime.models.linear import PACK_BATCH_HINT
    from radixserve.runtime.threads import one_intra_op_thread

    ops = packed_ops()
    assert ops is not None, "measure needs the pairs' kernel (bf16_kernels.packed_ops)"
    gen = torch.Generator().manual_seed(0)
    none = torch.empty(0, dtype=torch.bfloat16)
    n, k = shape
    with one_intra_op_thread(), torch.inference_mode():
        plain = torch.randn(shape, generator=gen).to(torch.bfloat16)
        pairs = [ops.pack([plain.clone()], 1) for _ in range(weights)]
        onednn = [torch.ops.mkldnn._reorder_linear_weight(plain.clone(), PACK_BATCH_HINT) for _ in range(weights)]
        decode: dict[str, dict[str, float]] = {"pairs": {}, "onednn": {}}
        for rows in decode_rows:
            x = torch.randn((rows, k), generator=gen).to(torch.bfloat16)
            decode["pairs"][str(rows)], decode["onednn"][str(rows)] = _medians(
                lambda x=x: [ops.linear(x, w, none) for w in pairs],
                lambda x=x: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for w in onednn],
                rounds,
            )
        onednn.clear()  # their memory back before the larger products
        unpack: dict[str, dict[str, float]] = {}
        unpack_from = NEVER
        for rows in unpack_rows:
            x = torch.randn((rows, k), generator=gen).to(torch.bfloat16)
            kernel, gemm = _medians(
                lambda x=x: [ops.linear(x, w, none) for w in pairs[:2]],
                lambda x=x: [unpacked_product(x, w, None, False) for w in pairs[:2]],
                max(1, rounds // 2),
            )
            unpack[str(rows)] = {"pairs": kernel, "unpacked": gemm}
            if gemm < kernel:
                unpack_from = rows
                break
    faster = sum(decode["pairs"].values()) < sum(decode["onednn"].values())
    return {
        "pairs": faster,
        "unpack_from_rows": unpack_from,
        "decode_ms": decode,
        "unpack_ms": unpack,
        "weights": [weights, n, k],
    }
