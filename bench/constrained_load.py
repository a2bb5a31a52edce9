"""Constrained decoding under load: the mask's cost at 16 concurrent requests, and a burst of bad constraints.

(A) Throughput. ``--num-requests`` chat requests (default 16) run at once, each asking for JSON under its own
    schema. Every schema demands more items (``minItems``) than ``--max-tokens`` can hold, so every request,
    constrained or not, writes exactly ``--max-tokens`` tokens (unconstrained ones ignore EOS): the modes differ
    only in what a step costs. Modes, alternated over ``--rounds`` rounds in one process (median reported):
      unconstrained          the same prompts without a constraint
      constrained, no jump   grammar masks on every step, jump-forward off: the cost of the masks alone
      constrained            the default: masks plus jump-forward over forced stretches (fewer forward passes)
(B) Burst. The same constrained requests alone, then again while ``--burst`` bad requests arrive at once: invalid
    regexes, invalid schemas, unsupported keywords, schemas over a grammar limit, regexes forcing huge stretches
    (refused when submitted), and regexes that outlast the compile timeout (``--grammar-compile-timeout``,
    shortened so the burst includes timeouts). Each bad
    constraint is unique, so no cached error helps. Every bad request must fail with a clear error and every good
    one must finish; the wall time of the good ones with and without the burst is compared. ``--fresh`` more
    requests with schemas not compiled yet are sent last, alone and during the burst: their time to first token
    is how long a new grammar waits behind the burst's compiles (``--grammar-screen off``: one queue, no slow lane).

    python -m bench.constrained_load [--model NAME] [--num-requests 16] [--max-tokens 96] [--rounds 3]
                                     [--fresh 4] [--grammar-screen auto|off]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from bench.common import format_table, machine_summary
from radixserve.constrained import ConstraintSpec
from radixserve.runtime.engine import Engine
from radixserve.runtime.request import FinishReason, ReqOutput
from radixserve.runtime.sampling_params import SamplingParams

DEFAULT_MODEL = "smollm2-135m-instruct"
TOPICS = (
    "books on a shelf", "cities to visit", "tasks for the week", "songs on an album", "planets and moons",
    "ingredients of a cake", "employees of a shop", "parts of a bicycle", "birds in a garden", "films of 1999",
    "rooms of a house", "players of a team", "tools in a workshop", "rivers of Europe", "courses at a school",
    "files in a folder",
)
# Item shapes: strings with bounds, enums, integers and numbers with bounds, booleans, patterns, nested objects.
FIELDS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("name", {"type": "string", "maxLength": 24}),
    ("kind", {"enum": ["small", "medium", "large", "unknown"]}),
    ("count", {"type": "integer", "minimum": 0, "maximum": 999}),
    ("price", {"type": "number", "minimum": 0}),
    ("done", {"type": "boolean"}),
    ("code", {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}),
    ("owner", {"type": "object", "properties": {"first": {"type": "string", "maxLength": 12},
                                                 "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["first", "age"], "additionalProperties": False}),
    ("tags", {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3}),
)


def schema_for(i: int, max_tokens: int) -> dict[str, Any]:
    """Request ``i``'s schema: an object holding a list of items whose fields rotate with ``i``."""
    fields = [FIELDS[(i + k) % len(FIELDS)] for k in range(3 + i % 3)]
    item = {
        "type": "object",
        "properties": dict(fields),
        "required": [name for name, _ in fields],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 40}, "items": {"type": "array", "items": item,
                                                                            "minItems": max_tokens}},
        "required": ["title", "items"],
        "additionalProperties": False,
    }


KINDS = ("invalid regex", "invalid schema", "unsupported keyword", "over a limit", "forced stretch", "compile timeout")


def bad_specs(n: int, seed: int, kinds: Sequence[str] = KINDS) -> list[tuple[str, ConstraintSpec]]:
    """``n`` unique bad constraints, cycling through ``kinds`` of failure (of ``KINDS``)."""
    out: list[tuple[str, ConstraintSpec]] = []
    for i in range(n):
        tag = f"{seed}x{i}"
        kind = kinds[i % len(kinds)]
        if kind == "invalid regex":
            spec = ConstraintSpec("regex", f"[0-9{tag}")
        elif kind == "invalid schema":
            spec = ConstraintSpec("json_schema", {"type": "object", "properties": {tag: {"type": "strin"}}})
        elif kind == "unsupported keyword":
            spec = ConstraintSpec("json_schema", {"type": "array", "items": {"const": tag}, "uniqueItems": True})
        elif kind == "over a limit":  # llguidance cannot build a number lexer for a bound past 64 bits
            spec = ConstraintSpec("json_schema", {"type": "integer", "minimum": 10**20 + i})
        elif kind == "forced stretch":  # forces 360 KB (~1 s of lexer work): refused when submitted
            spec = ConstraintSpec("regex", f"{tag}(b{{{600 + i}}}){{600}}")
        else:  # \p{L} hides it from the static check: ~120 ms of lexer work, past the shortened timeout
            spec = ConstraintSpec("regex", f"{tag}\\p{{L}}(b{{{600 + i}}}){{600}}")
        out.append((kind, spec))
    return out


def chat_ids(engine: Engine, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return engine.tokenizer.encode(text, add_special_tokens=False)


class _Outcome:
    """What one request produced, and when it finished (a sink for ``Engine.submit``)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.tokens = 0
        self.meta: ReqOutput | None = None
        self.first_at = 0.0
        self.finished_at = 0.0

    def __call__(self, out: ReqOutput) -> None:
        self.tokens += len(out.token_ids)
        if out.token_ids and not self.first_at:
            self.first_at = time.perf_counter()
        if out.finished:
            self.meta, self.finished_at = out, time.perf_counter()
            self.done.set()


def run_good(engine: Engine, prompts: list[list[int]], params: list[SamplingParams], bad: list[SamplingParams],
             bad_prompt: list[int], fresh: Sequence[SamplingParams] = ()) -> dict[str, Any]:
    """Submit ``bad`` then the good requests at the same moment; time the good ones to their last finish. ``fresh``
    requests (schemas not compiled yet) come last: their time to first token shows how long a new grammar waits."""
    steps0 = engine.server_info()["cache_stats"]["forward_steps"]
    start = time.perf_counter()
    bad_runs = [_Outcome() for _ in bad]
    for p, sink in zip(bad, bad_runs, strict=True):
        engine.submit(bad_prompt, p, sink)
    good_runs = [_Outcome() for _ in params]
    for ids, p, sink in zip(prompts, params, good_runs, strict=True):
        engine.submit(ids, p, sink)
    fresh_runs = [_Outcome() for _ in fresh]
    for ids, p, sink in zip(prompts, fresh, fresh_runs, strict=False):  # --fresh <= --num-requests (checked)
        engine.submit(ids, p, sink)
    for sink in good_runs + bad_runs + fresh_runs:
        sink.done.wait()
    steps = engine.server_info()["cache_stats"]["forward_steps"] - steps0
    for sink, p in zip(good_runs, params, strict=True):
        meta = sink.meta
        if meta is None or meta.finish_reason != FinishReason.LENGTH or sink.tokens != p.max_new_tokens:
            raise RuntimeError(f"a good request did not run to --max-tokens: {meta}")
    for sink in fresh_runs:
        if sink.meta is None or sink.meta.error or not sink.first_at:
            raise RuntimeError(f"a request with a new schema did not produce a token: {sink.meta}")
    unclear = [s.meta for s in bad_runs if s.meta is None or "invalid constraint" not in (s.meta.error or "")]
    if unclear:
        raise RuntimeError(f"a bad request did not fail with a clear error: {unclear[0]}")
    return {
        "wall": max(s.finished_at for s in good_runs) - start,
        "tokens": sum(s.tokens for s in good_runs),
        "steps": steps,
        "errors": [s.meta.error for s in bad_runs if s.meta is not None],
        "error_after": [s.finished_at - start for s in bad_runs],
        "fresh_first": [s.first_at - start for s in fresh_runs],
    }


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--burst", type=int, default=200, help="bad requests in the burst of (B)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated kinds of bad constraint, of {KINDS}")
    p.add_argument("--grammar-compile-timeout", type=float, default=0.1,
                   help="seconds, set after the warm-up; shortened so that the burst includes compile timeouts")
    p.add_argument("--fresh", type=int, default=4,
                   help="requests with schemas not compiled yet, sent after the good ones (alone and in the burst)")
    p.add_argument("--grammar-screen", choices=("auto", "off"), default="auto",
                   help="the compiler's screening into a slow lane under a queue (auto, the default) or none")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if not 0 <= args.fresh <= args.num_requests:
        p.error("--fresh takes 0 to --num-requests")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not kinds or set(kinds) - set(KINDS):
        p.error(f"--kinds takes names from {KINDS}")
    torch.set_num_threads(args.threads)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    engine = Engine(model=args.model, dtype=args.dtype, device="cpu")
    n, m = args.num_requests, args.max_tokens
    prompts = [chat_ids(engine, f"List {TOPICS[i % len(TOPICS)]} as JSON.") for i in range(n)]
    specs = [ConstraintSpec("json_schema", schema_for(i, m)) for i in range(n)]
    free = [SamplingParams(max_new_tokens=m, temperature=0.0, ignore_eos=True) for _ in range(n)]
    constrained = [SamplingParams(max_new_tokens=m, temperature=0.0, constraint=s) for s in specs]
    print(f"{time.strftime('%Y-%m-%d')} | {machine_summary()} | model {args.model} {args.dtype} | {n} requests x "
          f"{m} output tokens, {args.rounds} rounds, burst of {args.burst}", flush=True)
    run_good(engine, prompts, constrained, [], prompts[0])  # warm-up: compiles (then cached), first masks
    engine.grammar.compiler.timeout_s = args.grammar_compile_timeout  # for the burst only: the good ones are cached
    engine.grammar.compiler.screen = None if args.grammar_screen == "auto" else False

    def fresh(r: int, label: str) -> list[SamplingParams]:
        """Schemas no round compiled before (a unique comment); one token each, so they hardly add load."""
        return [SamplingParams(max_new_tokens=1, temperature=0.0, constraint=ConstraintSpec(
            "json_schema", {**schema_for(k, m), "$comment": f"{label} {r}-{k}"})) for k in range(args.fresh)]

    def mode(jump: bool) -> None:
        engine.call(lambda core: setattr(core, "jump_forward", jump))

    # The constrained runs as served ("jump") are also the good requests "alone" of (B).
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in ("free", "masked", "jump", "burst")}
    for r in range(args.rounds):
        engine.flush_cache()
        runs["free"].append(run_good(engine, prompts, free, [], prompts[0]))
        mode(False)
        engine.flush_cache()
        runs["masked"].append(run_good(engine, prompts, constrained, [], prompts[0]))
        mode(True)
        engine.flush_cache()
        runs["jump"].append(run_good(engine, prompts, constrained, [], prompts[0], fresh(r, "alone")))
        engine.flush_cache()
        bad = [SamplingParams(max_new_tokens=m, constraint=s) for _, s in bad_specs(args.burst, r, kinds)]
        runs["burst"].append(run_good(engine, prompts, constrained, bad, prompts[0], fresh(r, "burst")))
        print(f"  round {r + 1}: " + ", ".join(f"{k} {v[-1]['wall']:.1f} s" for k, v in runs.items()),
              file=sys.stderr, flush=True)

    def med(key: str, field: str) -> float:
        return statistics.median(x[field] for x in runs[key])

    base = med("free", "wall")
    rows = []
    for key, label in (("free", "unconstrained"), ("masked", "constrained, no jump-forward"),
                       ("jump", "constrained (default)")):
        wall = med(key, "wall")
        rows.append([label, wall, med(key, "tokens") / wall, int(med(key, "steps")), base / wall])
    print("\n(A) throughput at", n, "concurrent requests (median of rounds)\n")
    print(format_table(["mode", "wall s", "output tok/s", "forward passes", "throughput vs unconstrained"], rows))
    by_kind: dict[str, list[str]] = {}
    for (kind, _), meta in zip(bad_specs(args.burst, 0, kinds), runs["burst"][0]["errors"], strict=True):
        by_kind.setdefault(kind, []).append(meta)
    alone, burst = med("jump", "wall"), med("burst", "wall")
    print(f"\n(B) burst of {args.burst} bad constraints, all failed with a clear error; one message per kind:")
    for kind, messages in by_kind.items():
        print(f"  {len(messages)} x {kind}: {messages[0][:150]}")
    print()
    print(format_table(["good requests", "wall s", "output tok/s"],
                       [["alone", alone, med("jump", "tokens") / alone],
                        ["during the burst", burst, med("burst", "tokens") / burst]]))
    print(f"\nslowdown of the good requests during the burst: {burst / alone - 1:+.1%}")
    after = sorted(t for run in runs["burst"] for t in run["error_after"])
    print(f"bad requests answered after: median {statistics.median(after):.2f} s, max {after[-1]:.2f} s (timeouts "
          "queue behind the compiles they abandoned, which cannot be interrupted)")
    if args.fresh:
        alone_first = statistics.median(t for run in runs["jump"] for t in run["fresh_first"])
        burst_first = statistics.median(t for run in runs["burst"] for t in run["fresh_first"])
        print(f"requests with a new schema ({args.fresh} per round), first token after: median {alone_first:.2f} s "
              f"alone, {burst_first:.2f} s during the burst (--grammar-screen {args.grammar_screen})")
    engine.shutdown()


if __name__ == "__main__":
    main()
