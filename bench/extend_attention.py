"""Prefill attention in bfloat16: the compiled kernel (``csrc/extend_attention.cpp``) against SDPA.

Causal attention of prefill chunks over their keys in a bfloat16 pool, one layer, a model's heads (SmolLM2-135M's by
default: 9 query heads, 3 KV heads, 64 dimensions). Cases: one fresh prompt; several prompts in one 2,048-token
chunk (what a step of the distinct-prompts workload runs); the second half of a prompt over its cached first half;
one 2,048-token prompt. The kernel takes every chunk of a case in one call, reading keys at their pool slots; SDPA
(what the engine runs where the kernel is off) takes each chunk on its own, on keys already gathered. Printed:
milliseconds (median of ``--rounds``), GFLOP/s counting the causal half (4 x head_dim FLOPs per query head and
visible key), and SDPA's time over the kernel's.

    python -m bench.extend_attention
    python -m bench.extend_attention --heads 32 --kv-heads 8 --head-dim 64   # the 1B Llama
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.common import format_table, machine_summary
from radixserve.runtime.attention.cpu_kernels import extend_attention_op

CASES = {
    "1 x 600 tokens": [(600, 600)],
    "3 x 600 + 248 (one chunk)": [(600, 600)] * 3 + [(248, 248)],
    "300 after 300 cached": [(300, 600)],
    "1 x 2,048 tokens": [(2048, 2048)],
}


def median_ms(fn: Callable[[], object], rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def time_case(op: Callable, chunks: list[tuple[int, int]], h: int, n_kv: int, d: int, rounds: int) -> list[str]:
    """The kernel and SDPA on ``chunks`` [(q_len, kv_len)]: ms, GFLOP/s, and their ratio, as table cells."""
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(2, n_kv, sum(kv_len for _, kv_len in chunks) + 64, d, generator=gen).bfloat16()
    q = torch.randn(sum(q_len for q_len, _ in chunks), h, d, generator=gen).bfloat16()
    rows, slots, q_start, first = [], [], 0, 0
    for q_len, kv_len in chunks:
        rows.append([q_start, q_len, kv_len, len(slots)])
        slots.extend(range(first + kv_len - 1, first - 1, -1))  # descending, as a fresh allocator hands them
        q_start, first = q_start + q_len, first + kv_len
    slot_t, seqs = torch.tensor(slots), torch.tensor(rows)
    visible = sum(sum(kv_len - q_len + i + 1 for i in range(q_len)) for q_len, kv_len in chunks)
    flops = 4 * d * h * visible

    def sdpa() -> None:
        for q_start, q_len, kv_len, offset in rows:
            idx = slot_t[offset : offset + kv_len]
            keys, values = kv[0][:, idx].unsqueeze(0), kv[1][:, idx].unsqueeze(0)
            qs = q[q_start : q_start + q_len].transpose(0, 1).unsqueeze(0)
            mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
            F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, enable_gqa=True)

    kernel_ms = median_ms(lambda: op(q, kv, slot_t, seqs, d**-0.5, 0), rounds)
    sdpa_ms = median_ms(sdpa, max(3, rounds // 3))
    return [f"{kernel_ms:.3f}", f"{flops / kernel_ms / 1e6:.0f}", f"{sdpa_ms:.3f}", f"{flops / sdpa_ms / 1e6:.0f}",
            f"{sdpa_ms / kernel_ms:.2f}"]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    op = extend_attention_op()
    if op is None:
        raise SystemExit("the prefill-attention kernel is not used on this machine (it needs AVX-512 BF16, no AMX)")
    h, n_kv, d = args.heads, args.kv_heads, args.head_dim
    table = [[name, *time_case(op, chunks, h, n_kv, d, args.rounds)] for name, chunks in CASES.items()]
    print(f"# prefill attention, {h} query heads, {n_kv} KV heads, head_dim {d}, bfloat16, one layer; "
          f"{machine_summary()}")
    print(format_table(["case", "kernel ms", "kernel GFLOP/s", "SDPA ms", "SDPA GFLOP/s", "SDPA / kernel"], table))


if __name__ == "__main__":
    main()
