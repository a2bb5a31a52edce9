"""Speculative decoding (n-gram prompt lookup, or a draft model) against plain decoding, in process.

Three workloads, written here: ``rag`` (documents whose answers quote them: "repeat the paragraph that mentions
X", "copy the record of X"), ``free`` (nothing to copy: stories, explanations) and the same ``rag`` prompts at 16
concurrent users. For each, one engine with ``--speculative-algorithm ngram`` (or ``draft``) and one without, run
one after the other in rounds (the median of the rounds is reported), greedy, ``max_new_tokens`` fixed. Prints
decode tok/s per engine, the ratio, the acceptance rate and tokens per verification, and whether the outputs were
identical.

    python -m bench.speculative                        # dtype auto (bfloat16 where the CPU has native bf16)
    python -m bench.speculative --dtype float32 --rounds 3
    python -m bench.speculative --quantization none     # plain bfloat16 weights instead of the GGUF's blocks
    python -m bench.speculative --identity              # greedy identity only: 32 prompts x 128 tokens, float32
    python -m bench.speculative --identity --deterministic   # ... with --enable-deterministic-inference
    python -m bench.speculative --quantization none --algorithm draft --draft-model smollm2-135m-instruct
        # plain bfloat16 weights, drafted by the GGUF's Q4_1 blocks of the same model

``--identity`` checks exactness instead of speed: 32 prompts (24 RAG, 8 free text) x ``--max-new-tokens``, greedy,
radix cache on, all at once and one at a time, and 8 of them under a JSON schema; every output of the speculative
engine must equal the plain engine's (``--dtype float32`` unless given).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

from bench.common import format_table
from radixserve.runtime.engine import Engine
from radixserve.runtime.sampling_params import SamplingParams

SUBJECTS = ["the harbor", "the orchard", "the observatory", "the library", "the railway", "the bakery"]
VERBS = ["opened", "closed", "was rebuilt", "was painted", "welcomed visitors", "hosted a fair"]
WHEN = ["in the spring of 1894", "after the long winter", "on a rainy Tuesday", "during the festival"]
FREE = [
    "Write a short story about a dragon who is afraid of the dark.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give three tips for learning a new language.",
    "Describe a day in the life of a lighthouse keeper.",
    "What are the benefits of regular exercise?",
    "Invent a recipe for a soup made from autumn vegetables.",
]


def _paragraph(rng: random.Random, subject: str) -> str:
    sentences = [
        f"{subject.capitalize()} {rng.choice(VERBS)} {rng.choice(WHEN)}, and the town talked about it for weeks."
    ]
    for _ in range(3):
        other = rng.choice(SUBJECTS)
        sentences.append(f"Near {other}, people {rng.choice(['met', 'walked', 'sang', 'traded'])} {rng.choice(WHEN)}.")
    return " ".join(sentences)


def rag_prompts(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        subjects = rng.sample(SUBJECTS, len(SUBJECTS))
        paragraphs = [_paragraph(rng, s) for s in subjects]
        target = subjects[i % len(subjects)]
        docs = "\n\n".join(f"[{k + 1}] {p}" for k, p in enumerate(paragraphs))
        if i % 2 == 0:
            ask = f"Repeat, word for word, the paragraph that starts with {target.capitalize()}."
        else:
            ask = (
                f"From the documents, copy the first sentence about {target} exactly, then copy it once more in quotes."
            )
        prompts.append([{"role": "user", "content": f"Documents:\n\n{docs}\n\n{ask}"}])
    return prompts


def free_prompts(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": FREE[i % len(FREE)]}] for i in range(n)]


def _ids(engine: Engine, messages: list[list[dict[str, str]]]) -> list[list[int]]:
    tok = engine.tokenizer
    return [tok.encode(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False)) for m in messages]


def _run(engine: Engine, prompts: list[list[int]], params: SamplingParams, concurrent: bool) -> tuple[float, list]:
    """(decode tok/s, outputs): one request at a time, or all at once. For one user the prompt is prefilled
    (and cached) first, so the time is the decode's (the prefill is the same for both engines)."""
    engine.flush_cache()
    if concurrent:
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        seconds = time.perf_counter() - start
        return sum(len(o["output_ids"]) for o in outs) / seconds, [o["output_ids"] for o in outs]
    tokens, seconds, outs = 0, 0.0, []
    one = SamplingParams(max_new_tokens=1, temperature=0.0)
    for p in prompts:
        engine.generate(input_ids=p, sampling_params=one)  # the prefill, cached for the timed run
        start = time.perf_counter()
        out = engine.generate(input_ids=p, sampling_params=params)  # the prompt is cached: decode time
        seconds += time.perf_counter() - start
        tokens += len(out["output_ids"])
        outs.append(out["output_ids"])
    return tokens / seconds, outs


IDENTITY_SCHEMA = {
    "type": "object",
    "properties": {"place": {"type": "string"}, "year": {"type": "integer"}, "summary": {"type": "string"}},
    "required": ["place", "year", "summary"],
}


def _speculative(args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = dict(speculative_algorithm=args.algorithm, speculative_num_draft_tokens=args.draft_tokens)
    if args.algorithm == "draft":
        kw.update(speculative_draft_model=args.draft_model, speculative_draft_quantization=args.draft_quantization)
    return kw


def identity(args: argparse.Namespace, common: dict[str, Any]) -> None:
    """Greedy outputs of the speculative engine against the plain one (see the module doc); one line per mode."""
    from radixserve.constrained import ConstraintSpec

    engines = {
        "plain": Engine(**common),
        "spec": Engine(**common, **_speculative(args)),
    }
    try:
        plain = engines["plain"]
        prompts = _ids(plain, rag_prompts(24, seed=2) + free_prompts(8))
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
        spec = ConstraintSpec("json_schema", IDENTITY_SCHEMA)
        schema = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0, constraint=spec)
        modes = [("all at once", prompts, params, True), ("one at a time", prompts, params, False)]
        modes.append(("JSON schema, all at once", prompts[:8], schema, True))
        for name, batch, p, together in modes:
            outs = {}
            for label, engine in engines.items():
                engine.flush_cache()
                if together:
                    outs[label] = [o["output_ids"] for o in engine.generate(input_ids=batch, sampling_params=p)]
                else:
                    outs[label] = [engine.generate(input_ids=q, sampling_params=p)["output_ids"] for q in batch]
            same = sum(a == b for a, b in zip(outs["plain"], outs["spec"]))
            tokens = sum(len(o) for o in outs["spec"])
            print(f"{name}: {same}/{len(batch)} identical ({tokens} tokens)", flush=True)
        stats = engines["spec"].server_info()["cache_stats"]
        print(
            f"{args.algorithm} engine: {stats['spec_steps']} verifications, {stats['spec_accepted_tokens']} of "
            f"{stats['spec_draft_tokens']} draft tokens accepted"
        )
    finally:
        for engine in engines.values():
            engine.shutdown()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="auto", help="auto: the GGUF's blocks; none: plain --dtype weights")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=6, help="prompts per one-user workload")
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft-tokens", type=int, default=3)
    parser.add_argument("--algorithm", default="ngram", choices=("ngram", "draft"))
    parser.add_argument("--draft-model", default="", help="draft: the draft model (as --model)")
    parser.add_argument("--draft-quantization", default="auto", help="draft: its weight format (auto: a GGUF's blocks)")
    parser.add_argument("--identity", action="store_true", help="check greedy identity instead of timing")
    parser.add_argument(
        "--deterministic", action="store_true", help="both engines with --enable-deterministic-inference"
    )
    args = parser.parse_args(argv)
    dtype = "float32" if args.identity and args.dtype == "auto" else args.dtype
    common: dict[str, Any] = dict(
        model=args.model,
        device="cpu",
        dtype=dtype,
        quantization=args.quantization,
        max_total_tokens=32768,
        deterministic_inference=args.deterministic,
    )
    if args.identity:
        identity(args, common)
        return
    engines = {
        "plain": Engine(**common),
        "spec": Engine(**common, **_speculative(args)),
    }
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    plain = engines["plain"]
    workloads = [
        ("rag, one user", _ids(plain, rag_prompts(args.requests)), False),
        ("free text, one user", _ids(plain, free_prompts(args.requests)), False),
        (f"rag, {args.users} users", _ids(plain, rag_prompts(args.users, seed=1)), True),
    ]
    rows = []
    try:
        for name, prompts, concurrent in workloads:
            rates: dict[str, list[float]] = {"plain": [], "spec": []}
            outputs: dict[str, list] = {}
            before = engines["spec"].server_info()["cache_stats"]
            for _ in range(args.rounds):
                for label, engine in engines.items():
                    rate, outs = _run(engine, prompts, params, concurrent)
                    rates[label].append(rate)
                    outputs[label] = outs
            after = engines["spec"].server_info()["cache_stats"]
            drafts = after["spec_draft_tokens"] - before["spec_draft_tokens"]
            accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
            steps = after["spec_steps"] - before["spec_steps"]
            p, s = statistics.median(rates["plain"]), statistics.median(rates["spec"])
            rows.append(
                [
                    name,
                    f"{p:.1f}",
                    f"{s:.1f}",
                    f"{s / p:.2f}x",
                    f"{100 * accepted / drafts:.0f}%" if drafts else "-",
                    f"{(accepted + steps) / steps:.2f}" if steps else "-",
                    "yes" if outputs["plain"] == outputs["spec"] else "NO",
                ]
            )
            print(" | ".join(rows[-1]), flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
    headers = ["workload", "plain tok/s", f"{args.algorithm} tok/s", "ratio", "accepted", "tokens/verify"]
    headers.append("same output")
    print()
    print(format_table(headers, rows))


if __name__ == "__main__":
    main()
