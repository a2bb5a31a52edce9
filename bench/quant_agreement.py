"""How closely serving a GGUF's blocks follows its float32 dequantization, for us and for llama.cpp.

Greedy outputs of 64 prompts x 32 tokens, each system against itself: radixserve with the blocks kept
(``--quantization auto``) against radixserve on the dequantized float32 weights (``none``); llama-server on the
quantized GGUF against llama-server on its F32 conversion. Printed per system: the share of prompts whose 32 tokens
all agree, and the mean share of tokens before the first disagreement.

    python -m bench.quant_agreement                     # the built-in SmolLM2-135M (Q4_1)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
from torch import nn

from bench import llamacpp_peer as llama
from bench.common import format_table, make_workload
from bench.peers import llama_server
from radixserve.runtime.engine import Engine
from radixserve.runtime.model_source import resolve_model
from radixserve.runtime.sampling_params import SamplingParams
from radixserve.runtime.weights import load_tokenizer


def prompts(tokenizer: object, n: int, seed: int = 5) -> list[list[int]]:
    return [r.prompt_ids for r in make_workload(tokenizer, n, (24, 96), (1, 1), seed)]


def ours(
    model: str, quantization: str, ids: list[list[int]], n_out: int, prepare: Callable[[nn.Module], None] | None = None
) -> list[list[int]]:
    """Greedy outputs of radixserve, float32 activations; ``prepare`` may alter the loaded model first."""
    engine = Engine(model=model, device="cpu", dtype="float32", quantization=quantization, max_total_tokens=16384)
    try:
        if prepare is not None:
            prepare(engine.core.runner.model)
        params = SamplingParams(max_new_tokens=n_out, temperature=0.0, ignore_eos=True)
        return [r["output_ids"] for r in engine.generate(input_ids=ids, sampling_params=params)]
    finally:
        engine.shutdown()


async def _llama_outputs(url: str, ids: list[list[int]], n_out: int) -> list[list[int]]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        outs = []
        for p in ids:  # one at a time: the same conditions for every prompt
            body = {"prompt": p, "n_predict": n_out, "temperature": 0, "ignore_eos": True, "cache_prompt": False,
                    "return_tokens": True}  # fmt: skip
            resp = await client.post("/completion", json=body)
            outs.append(list(json.loads(resp.text)["tokens"]))
        return outs


def theirs(gguf: Path, ids: list[list[int]], n_out: int) -> list[list[int]]:
    with llama_server(gguf, "", parallel=1) as url:
        return asyncio.run(_llama_outputs(url, ids, n_out))


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, float]:
    exact = sum(x == y for x, y in zip(a, b)) / len(a)
    prefix = []
    for x, y in zip(a, b):
        n = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        prefix.append(n / max(1, len(x)))
    return exact, statistics.mean(prefix)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--skip-llama", action="store_true")
    args = p.parse_args(argv)
    folder = resolve_model(args.model)
    ids = prompts(load_tokenizer(folder), args.prompts)
    rows = []
    q, f = ours(args.model, "auto", ids, args.tokens), ours(args.model, "none", ids, args.tokens)
    rows.append(["radixserve blocks vs its float32", *agreement(q, f)])
    if not args.skip_llama:
        quantized = folder / "model.gguf"
        f32 = llama.plain_gguf(args.model)
        if f32 is not None:
            lq, lf = theirs(quantized, ids, args.tokens), theirs(f32, ids, args.tokens)
            rows.append(["llama-server quantized vs its F32", *agreement(lq, lf)])
            rows.append(["radixserve blocks vs llama-server F32", *agreement(q, lf)])
    print(f"# greedy agreement, {args.prompts} prompts x {args.tokens} tokens, {args.model}")
    print(format_table(["pair", "prompts identical", "mean share before first difference"], rows))
    if len(rows) > 1:
        print(paired(q, f, lq, lf))


def paired(q: list[list[int]], f: list[list[int]], lq: list[list[int]], lf: list[list[int]]) -> str:
    """McNemar's test on the prompts that come out identical: the same prompts for both systems, so only those
    where exactly one of them agrees with its float32 run tell them apart. |z| < 2 is within sampling noise."""
    ours_only = sum(a == b and c != d for a, b, c, d in zip(q, f, lq, lf))
    theirs_only = sum(a != b and c == d for a, b, c, d in zip(q, f, lq, lf))
    z = (ours_only - theirs_only) / math.sqrt(ours_only + theirs_only) if ours_only + theirs_only else 0.0
    return f"prompts identical for radixserve only: {ours_only}, for llama.cpp only: {theirs_only}; z = {z:+.2f}"


if __name__ == "__main__":
    main()
