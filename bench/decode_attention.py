"""Decode attention in bfloat16 over the KV pool: the compiled kernel (``csrc/decode_attention.cpp``) for a step of
B rows, over ``--layers`` layers' pools, so that every call reads its keys and values from memory as a served
decode step does. The pools are one tensor allocated as the engine's ``KVPool`` is (on CPU on memory advised for
transparent huge pages; ``RADIXSERVE_KV_HUGE_PAGES=0`` for ``torch.empty``).

Slot layouts (each row's L slots, its prompt then its decoded tokens):

* ``served``: what the engine's allocator hands out: a prompt's slots in one descending run (the free list is
  popped from its end), then each decoded token's slot from the step's block of B, so that a row's decoded tokens
  lie B slots apart;
* ``contiguous``: every row's slots in one ascending run.

Printed: milliseconds a step (all layers; median of ``--rounds``) and GB/s of keys and values read.

``--shared P``: every row's first P tokens are one prompt shared through the radix cache (the same slots), then its
own (served layout); the step is timed as whole rows and with the rows as one group (``groups``: the kernel attends
the prefix once for all of them, where it can), alternating.

``--busy MS/PERIOD`` runs a busy loop in another process for MS of every PERIOD milliseconds (a front end or a
client on one of the cores), to see how much of that the kernels lose beyond the time taken from them.

    python -m bench.decode_attention                       # SmolLM2-135M's heads: 16 rows of 663 tokens
    python -m bench.decode_attention --batch 1 --length 4000
    python -m bench.decode_attention --busy 1/8
    python -m bench.decode_attention --length 1330 --decoded 30 --shared 1300   # the shared-prompt workload
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch

from bench.common import busy_neighbour, format_table, machine_summary
from radixserve.runtime.attention.cpu_kernels import decode_attention_op
from radixserve.runtime.kv_pool import KVPool


def layouts(batch: int, length: int, decoded: int) -> dict[str, torch.Tensor]:
    prompt = length - decoded
    served = [
        torch.cat([torch.arange((b + 1) * prompt - 1, b * prompt - 1, -1),
                   batch * prompt + b + batch * torch.arange(decoded)])
        for b in range(batch)
    ]  # fmt: skip
    contiguous = [torch.arange(b * length, (b + 1) * length) for b in range(batch)]
    return {"served": torch.stack(served), "contiguous": torch.stack(contiguous)}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16, help="decode rows in the step")
    p.add_argument("--length", type=int, default=663, help="tokens in each row's context")
    p.add_argument("--decoded", type=int, default=63, help="of them, tokens decoded (slots B apart when served)")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--busy", default="", help="MS/PERIOD: a busy loop in another process (e.g. 1/8)")
    p.add_argument("--shared", type=int, default=0, help="tokens of one prompt every row starts with")
    args = p.parse_args(argv)
    op = decode_attention_op()
    if op is None:
        raise SystemExit("the decode-attention kernel is not available on this machine")
    batch, length, dim = args.batch, args.length, args.head_dim
    decoded = min(args.decoded, length)
    slots_needed = batch * length + batch
    pool = KVPool(slots_needed, args.layers, args.kv_heads, dim, torch.bfloat16, torch.device("cpu"))
    for kv in pool.kv:
        kv.copy_(torch.randn(kv.shape))
    pools = pool.kv
    q = torch.randn(batch, args.heads, dim).to(torch.bfloat16)
    lens = torch.full((batch,), length, dtype=torch.int64)
    shared = min(args.shared, length - 1)
    if shared:
        own = layouts(batch, length - shared, decoded)["served"] + shared  # after the prefix's slots
        slots = torch.cat([torch.arange(shared - 1, -1, -1).expand(batch, -1), own], dim=1).contiguous()
        groups = torch.tensor([[0, shared]] * batch)
        cases = {"served, whole rows": (slots, None), "served, one group": (slots, groups)}
    else:
        cases = {name: (slots, None) for name, slots in layouts(batch, length, decoded).items()}
    # keys and values each row reads (a shared prefix counted once)
    nbytes = 2 * (batch * (length - shared) + shared) * args.kv_heads * dim * 2 * args.layers
    times: dict[str, list[float]] = {name: [] for name in cases}
    with busy_neighbour(args.busy):
        for _ in range(args.rounds):
            for name, (slots, groups) in cases.items():  # alternating, so that both see the same machine
                start = time.perf_counter()
                for kv in pools:
                    op(q, kv, slots, lens, dim**-0.5, groups)
                times[name].append(time.perf_counter() - start)
    print(f"# decode attention, {batch} rows of {length} tokens ({decoded} decoded), {args.heads} query heads, "
          f"{args.kv_heads} KV heads, head_dim {dim}, {args.layers} layers, bfloat16"
          f"{f', {shared} of them shared' if shared else ''}"
          f"{f', busy neighbour {args.busy} ms' if args.busy else ''}; {machine_summary()}")  # fmt: skip
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append([name, f"{med * 1e3:.2f}", f"{nbytes / med / 1e9:.1f}"])
    print(format_table(["slots", "ms a step", "GB/s"], rows))


if __name__ == "__main__":
    main()
