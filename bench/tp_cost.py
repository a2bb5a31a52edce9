"""What tensor parallelism costs per step: decode and prefill step times at ``--tp 1`` and each ``--tp N`` asked.

    python -m bench.tp_cost [--model NAME] [--tps 1,3] [--batch 8] [--prompt-len 256] [--new-tokens 32]

For each tp, one engine serves ``--batch`` greedy requests of ``--prompt-len`` prompt tokens and ``--new-tokens``
output tokens (EOS ignored) ``--rounds`` times; the table gives the median wall time, the time per forward step
(decode dominated) and the ratio to tp 1. On a machine with one CPU socket every rank shares the same cores and
memory bandwidth, so this measures the overhead (two all-reduces per layer, the command broadcast and the logits
gather), not a speed-up: TP pays off where each rank has a device of its own.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Sequence

from bench.common import format_table, machine_summary, make_workload
from radixserve.runtime.engine import Engine
from radixserve.runtime.sampling_params import SamplingParams


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tps", default="1,3", help="comma-separated tensor-parallel sizes; the first is the baseline")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    tps = [int(x) for x in args.tps.split(",")]
    rows = []
    base = None
    for tp in tps:
        engine = Engine(model=args.model, device="cpu", dtype="float32", max_total_tokens=16384, tp=tp)
        reqs = make_workload(engine.tokenizer, args.batch, (args.prompt_len,) * 2, (args.new_tokens,) * 2, seed=0)
        params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
        walls, per_step = [], []
        for _ in range(args.rounds):
            engine.flush_cache()
            steps0 = engine.server_info()["cache_stats"]["forward_steps"]
            start = time.perf_counter()
            engine.generate(input_ids=[r.prompt_ids for r in reqs], sampling_params=params)
            wall = time.perf_counter() - start
            steps = engine.server_info()["cache_stats"]["forward_steps"] - steps0
            walls.append(wall)
            per_step.append(wall / steps * 1000)
        engine.shutdown()
        wall, step = statistics.median(walls), statistics.median(per_step)
        base = base or wall
        rows.append([tp, wall, step, wall / base])
    print(f"{time.strftime('%Y-%m-%d')} | {machine_summary()} | model {args.model} | {args.batch} requests x "
          f"{args.prompt_len} prompt + {args.new_tokens} output tokens, {args.rounds} rounds\n")
    print(format_table(["tp", "wall s", "ms per step", f"time vs tp {tps[0]}"], rows))


if __name__ == "__main__":
    main()
