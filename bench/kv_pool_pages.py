"""Decode attention over a KV pool on 4 KB pages against one on transparent huge pages (``runtime.kv_pool``).

``--rows`` decode rows, each with ``--context`` tokens, attend over every layer of a bfloat16 pool shaped like a
model's (SmolLM2-135M's by default), with the compiled decode kernel the engine runs. Slots come from the engine's
own ``SlotAllocator`` in the order a served batch takes them: each prompt's slots at once, then one slot per row
per decode step (``--decode`` steps), so that rows interleave at the end, as in the engine. The two pools are timed
alternately in one process, median of ``--rounds``; printed: ms per step (every layer once) and the rate at which
the keys and values are read.

    python -m bench.kv_pool_pages
    python -m bench.kv_pool_pages --layers 16 --kv-heads 8 --head-dim 64 --rows 16 --context 1000   # 1B Llama
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import format_table, machine_summary
from radixserve.runtime.attention.cpu_kernels import decode_attention_op
from radixserve.runtime.kv_pool import SlotAllocator, _huge_page_empty


def served_slots(rows: int, context: int, decode: int, num_slots: int) -> torch.Tensor:
    """[rows, context] slots as a fresh allocator hands them to a batch: prompts first, then decode steps."""
    alloc = SlotAllocator(num_slots)
    prompt = context - decode
    table = [alloc.alloc(prompt) or [] for _ in range(rows)]
    for _ in range(decode):
        for row in table:
            row.extend(alloc.alloc(1) or [])
    return torch.tensor(table, dtype=torch.int64)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--heads", type=int, default=9, help="query heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--context", type=int, default=660)
    p.add_argument("--decode", type=int, default=60, help="of the context, tokens added one step at a time")
    p.add_argument("--slots", type=int, default=200_000, help="the pool's size in tokens")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    op = decode_attention_op()
    if op is None:
        raise SystemExit("the compiled decode-attention kernel is not available on this machine")
    shape = (args.layers, 2, args.kv_heads, args.slots, args.head_dim)
    huge = _huge_page_empty(shape, torch.bfloat16)
    if huge is None:
        raise SystemExit("this platform has no transparent huge page advice")
    pools = {"4 KB pages": torch.empty(shape, dtype=torch.bfloat16), "huge pages": huge}
    for pool in pools.values():
        pool.normal_()  # commits every page, so no timed call takes a page fault
    slots = served_slots(args.rows, args.context, args.decode, args.slots)
    lens = torch.full((args.rows,), args.context, dtype=torch.int64)
    q = torch.randn(args.rows, args.heads, args.head_dim).to(torch.bfloat16)
    scale = args.head_dim**-0.5

    def step(pool: torch.Tensor) -> float:
        start = time.perf_counter()
        for layer in pool.unbind(0):
            op(q, layer, slots, lens, scale)
        return time.perf_counter() - start

    times: dict[str, list[float]] = {name: [] for name in pools}
    for _ in range(args.rounds):
        for name, pool in pools.items():
            times[name].append(step(pool))
    nbytes = args.rows * args.context * args.layers * 2 * args.kv_heads * args.head_dim * 2
    base = statistics.median(times["4 KB pages"])
    table = []
    for name, ts in times.items():
        med = statistics.median(ts)
        table.append([name, f"{med * 1e3:.2f}", f"{nbytes / med / 1e9:.1f}", f"{base / med:.2f}"])
    print(f"# {args.rows} decode rows of {args.context} tokens, {args.layers} layers x {args.kv_heads} KV heads x "
          f"{args.head_dim}, bfloat16; {machine_summary()}")
    print(format_table(["pool", "ms a step", "GB/s read", "x 4 KB pages"], table))


if __name__ == "__main__":
    main()
