"""What ``--enable-deterministic-inference`` costs: prefill and decode with and without it, on the built-in model.

For each prompt length, one engine with the flag and one without, in process, taking turns (median of
``--rounds``): the time to prefill the prompt (``max_new_tokens=1``, cache flushed first), and decode tok/s of 64
greedy tokens for one user and for 8 at once (prompts cached first, so the time is the decode's). Printed: the
times and the ratio flag / no flag, and whether a prompt gives the same greedy tokens computed whole and after half
of it was cached (the property the flag buys).

    python -m bench.deterministic                   # --dtype auto (bfloat16 where the CPU has native bf16)
    python -m bench.deterministic --dtype float32
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

from bench.common import format_table
from radixserve.runtime.engine import Engine
from radixserve.runtime.sampling_params import SamplingParams

TEXT = (
    "The printing press spread across Europe within decades of its invention. Printers in Venice, Lyon and "
    "Antwerp competed on type, paper and price, and the books they made carried new ideas quickly. "
)


def _prompt(engine: Engine, tokens: int, salt: int) -> list[int]:
    ids = engine.tokenizer.encode(f"Document {salt}. " + TEXT * (tokens // 30 + 2))
    return ids[:tokens]


def _prefill(engine: Engine, ids: list[int]) -> float:
    engine.flush_cache()
    start = time.perf_counter()
    engine.generate(input_ids=ids, sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0))
    return time.perf_counter() - start


def _decode(engine: Engine, prompts: list[list[int]], tokens: int) -> float:
    engine.flush_cache()
    engine.generate(input_ids=prompts, sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0))
    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    return sum(len(o["output_ids"]) for o in outs) / (time.perf_counter() - start)


def _cache_invariant(engine: Engine, ids: list[int]) -> bool:
    params = SamplingParams(max_new_tokens=32, temperature=0.0)
    engine.flush_cache()
    whole = engine.generate(input_ids=ids, sampling_params=params)["output_ids"]
    engine.flush_cache()
    engine.generate(input_ids=ids[: len(ids) // 2], sampling_params=SamplingParams(max_new_tokens=1))
    return engine.generate(input_ids=ids, sampling_params=params)["output_ids"] == whole


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--lengths", default="512,2048")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    common = dict(model=args.model, device="cpu", dtype=args.dtype, max_total_tokens=32768)
    engines = {"default": Engine(**common), "deterministic": Engine(**common, deterministic_inference=True)}
    rows = []
    try:
        plain = engines["default"]
        for length in (int(x) for x in args.lengths.split(",")):
            prompt = _prompt(plain, length, 0)
            many = [_prompt(plain, length, i) for i in range(8)]
            timings: dict[str, dict[str, list[float]]] = {k: {"prefill": [], "one": [], "eight": []} for k in engines}
            for _ in range(args.rounds):
                for label, engine in engines.items():
                    timings[label]["prefill"].append(_prefill(engine, prompt))
                    timings[label]["one"].append(_decode(engine, [prompt], 64))
                    timings[label]["eight"].append(_decode(engine, many, 64))
            med = {k: {m: statistics.median(v) for m, v in t.items()} for k, t in timings.items()}
            same = {k: _cache_invariant(e, prompt) for k, e in engines.items()}
            d, x = med["default"], med["deterministic"]
            rows.append([f"{length}-token prefill (s)", d["prefill"], x["prefill"], x["prefill"] / d["prefill"], ""])
            rows.append([f"{length}: decode, 1 user (tok/s)", d["one"], x["one"], x["one"] / d["one"], ""])
            rows.append([f"{length}: decode, 8 users (tok/s)", d["eight"], x["eight"], x["eight"] / d["eight"], ""])
            rows.append(
                [f"{length}: same tokens, half cached", "", "", "", f"{same['default']} / {same['deterministic']}"]
            )
    finally:
        for engine in engines.values():
            engine.shutdown()
    print(f"# {args.model}, --dtype {args.dtype}, median of {args.rounds} rounds")
    print(format_table(["measure", "default", "deterministic", "ratio", "default / deterministic"], rows))


if __name__ == "__main__":
    main()
