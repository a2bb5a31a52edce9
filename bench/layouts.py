"""The timings behind the kernel choices a first start makes on a CPU with AMX, run here on any CPU and printed.

On a CPU with AMX the engine times, once per machine, which layout serves bfloat16 weights
(``runtime/models/bf16_layout.py``: radixserve's pairs of K or oneDNN's packed layout, and from how many rows a
product over the pairs runs on the AMX tiles or unpacks for oneDNN's GEMM) and which prefill attention serves
bfloat16 (``runtime/attention/cpu_kernels.py``: the compiled kernel, on vdpbf16ps or on AMX tiles, or SDPA), and
keeps what it found beside the compiled kernels. Without AMX it measures neither (the pairs and the kernel serve;
there are no tiles to time). This script runs the same timings, as the engine would, on a thread of its own with
every intra-op thread, ``--rounds`` times, and prints each run's figures and what the engine would choose from
them, so that the choice can be checked (and its noise seen) on any machine:

    python -m bench.layouts
    python -m bench.layouts --rounds 3 --threads 2
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from bench.common import format_table, machine_summary
from radixserve.runtime.attention import cpu_kernels
from radixserve.runtime.cpu_features import cpu_flags
from radixserve.runtime.models import bf16_layout
from radixserve.runtime.models.bf16_kernels import packed_ops
from radixserve.runtime.threads import on_a_thread_of_its_own

# The ways bf16_layout.measure times (``tiles`` with AMX only; ``unpacked`` from 64 rows).
WAYS = ("pairs", "tiles", "unpacked", "onednn")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="how many times to run each timing (default 3)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="intra-op threads")
    args = parser.parse_args(argv)
    amx = "amx_bf16" in cpu_flags()
    print(f"# {machine_summary()}; AMX: {'yes' if amx else 'no (the engine measures neither: pairs, kernel)'}")
    if packed_ops() is None:
        raise SystemExit("no AVX-512 BF16 kernels on this CPU: bfloat16 weights have no layout to choose")
    rows, choices = [], []
    for round_ in range(1, args.rounds + 1):
        found = on_a_thread_of_its_own(bf16_layout.measure, args.threads)
        decode, served = found["decode_ms"], found["served_ms"]
        timed = {r: {way: decode[way][r] for way in decode} for r in decode["onednn"]} | found["many_rows_ms"]
        for r, ways in timed.items():
            rows.append([round_, r, *(ways.get(way, "") for way in WAYS), served[r], served[r] / ways["onednn"]])
        never = bf16_layout.NEVER
        tiles, unpack = found["tiles_from_rows"], found["unpack_from_rows"]
        choices.append(
            f"round {round_}: {'pairs' if found['pairs'] else 'oneDNN'} (chunk {found['chunk_ratio']:.2f}x oneDNN's"
            f" in pairs); the tiles from {tiles if tiles < never else 'never'} rows, unpacking from"
            f" {unpack if unpack < never else 'never'}"
        )
    print(f"\n## bfloat16 weight layouts ({args.threads} threads; ms a pass over the weights, medians)")
    print(format_table(["round", "rows", *WAYS, "pairs served", "pairs / oneDNN"], rows))
    print("\n".join(["", *choices]))

    ops = cpu_kernels.prefill_ops()  # the kernel, and with AMX its form on tiles
    if not ops:
        return
    rows = []
    for _ in range(args.rounds):
        found = on_a_thread_of_its_own(lambda: cpu_kernels.prefill_timings(ops), args.threads)
        sdpa = found["sdpa_ms"]
        for chunk in sdpa:
            rows.append([chunk, *(found[f"{name}_ms"][chunk] for name in ops), sdpa[chunk]])
    print(f"\n## bfloat16 prefill attention ({args.threads} threads; 16 query heads, 4 KV heads, head size 64)")
    print(format_table(["chunk (q_len/kv_len)", *(f"{name} ms" for name in ops), "SDPA ms"], rows))

if __name__ == "__main__":
    main()
