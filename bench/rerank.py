"""Cross-encoder reranking over HTTP: radixserve against vLLM's CPU build, both ``--runner pooling`` on a
Qwen3-Reranker-shaped model loaded as vLLM loads Qwen3-Reranker as published (the language model read at its "no"
and "yes" tokens), with the same score template, the same ``/rerank`` traffic in one run, one engine busy at a
time, each started fresh and warmed up.

The model is ``bench.embeddings``' random-weight Qwen3-0.6B shape (its shards, linked) saved as a causal LM with
a tied head, SmolLM2's tokenizer; speed depends on the shape, not on the values. Both engines get
``--hf-overrides`` with ``classifier_from_token: ["no", "yes"]`` and ``is_original_qwen3_reranker`` and a
``--chat-template`` in Qwen3-Reranker's shape (system prompt, instruction, query, document). Workloads:

* ``rerank``: 8 queries of 20-40 tokens, each against 16 documents of 120-200 tokens (a retriever's top 16), one
  ``/rerank`` call per query, 4 clients;
* ``rerank-long``: 4 queries that quote a 600-800-token context (a chat's history or a long question), each
  against 12 documents of 100-150 tokens, 2 clients.

Printed per engine and workload: wall time, pairs/s, call latency p50/p90 and the cached tokens reported; then
radixserve's ratio to vLLM and the largest difference between the two engines' scores of the same pairs (both
compute in bf16).

    python -m bench.rerank --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.common import _prompt_ids, format_table
from bench.embeddings import write_model as write_embedding_model
from bench.peers import SERVED, alternating_rounds, closed_loop, radixserve, versus, vllm
from radixserve.runtime import envs
from radixserve.runtime.weights import load_tokenizer

OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
             "is_original_qwen3_reranker": True}  # fmt: skip
TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
    "<Instruct>: {{ instruction | default('Given a web search query, retrieve relevant passages that answer the "
    "query') }}\n<Query>: {{ (messages | selectattr('role', 'eq', 'query') | first).content }}\n"
    "<Document>: {{ (messages | selectattr('role', 'eq', 'document') | first).content }}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


def write_model() -> Path:
    """The reranker's folder: the embedding benchmark's shards (linked) under a causal LM's config, and the score
    template next to it."""
    source = write_embedding_model()
    out = envs.cache_dir() / "bench-models" / "random-qwen3-reranker-0.6b"
    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.suffix in (".safetensors", ".json") and f.name not in ("config.json", "modules.json"):
            target = out / f.name
            if not target.exists():
                target.symlink_to(f)
    (out / "score_template.jinja").write_text(TEMPLATE)
    config = json.loads((source / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config, indent=2))  # (a causal LM with a tied head, no recipe)
    return out


@dataclass(frozen=True)
class Workload:
    name: str
    calls: tuple[tuple[str, tuple[str, ...]], ...]  # (query, documents) per call
    clients: int

    @property
    def pairs(self) -> int:
        return sum(len(docs) for _, docs in self.calls)


def workloads(tokenizer: object) -> list[Workload]:
    rng = random.Random(0)

    def text(lo: int, hi: int) -> str:
        return tokenizer.decode(_prompt_ids(tokenizer, rng, rng.randint(lo, hi)))  # type: ignore[attr-defined]

    short = tuple((text(20, 40), tuple(text(120, 200) for _ in range(16))) for _ in range(8))
    long = tuple((text(600, 800), tuple(text(100, 150) for _ in range(12))) for _ in range(4))
    return [Workload("rerank", short, 4), Workload("rerank-long", long, 2)]


@dataclass
class Result:
    wall_s: float = 0.0
    latencies: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    prompt_tokens: int = 0
    scores: list[float] = field(default_factory=list)  # the first call's, by document
    errors: list[str] = field(default_factory=list)

    def p(self, q: float) -> float:
        return statistics.quantiles(self.latencies, n=100)[int(q * 100) - 1] if len(self.latencies) > 1 else 0.0


async def run(url: str, wl: Workload) -> Result:
    res = Result()
    async with httpx.AsyncClient(timeout=600) as client:

        async def send(k: int, call: tuple[str, tuple[str, ...]]) -> None:
            query, docs = call
            resp = await client.post(url + "/rerank", json={"model": SERVED, "query": query, "documents": docs})
            if resp.status_code != 200:
                res.errors.append(resp.text[:200])
                return
            data = resp.json()
            usage = data.get("usage") or {}
            res.prompt_tokens += usage.get("total_tokens") or 0
            res.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            if k == 0:
                by_index = {r["index"]: r["relevance_score"] for r in data["results"]}
                res.scores = [by_index[i] for i in range(len(docs))]

        res.wall_s, res.latencies = await closed_loop(wl.calls, wl.clients, send)
    return res


def bench_engine(name: str, server: object, wls: list[Workload]) -> dict[str, Result]:
    print(f"{name}:", flush=True)
    out = {}
    with server as url:  # type: ignore[attr-defined]
        asyncio.run(run(url, Workload("warm-up", (("warm", ("up",)),), 1)))
        for wl in wls:
            res = out[wl.name] = asyncio.run(run(url, wl))
            errors = f", ERRORS {res.errors[:2]}" if res.errors else ""
            print(f"  {wl.name}: {res.wall_s:.2f} s, {wl.pairs / res.wall_s:.1f} pairs/s, latency p50 "
                  f"{res.p(0.5) * 1e3:.0f} ms, cached {res.cached_tokens}/{res.prompt_tokens}{errors}",
                  flush=True)  # fmt: skip
    return out


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default="radixserve,vllm")
    p.add_argument("--rounds", type=int, default=1, help="every engine this many times, alternating; medians")
    p.add_argument("--radixserve-args", default="")
    p.add_argument("--vllm-args", default="")
    args = p.parse_args(argv)
    folder = write_model()
    wls = workloads(load_tokenizer(folder))
    template = folder / "score_template.jinja"
    common = f"--runner pooling --hf-overrides '{json.dumps(OVERRIDES)}' --chat-template {template}"

    def start(engine: str) -> object:
        if engine == "radixserve":
            return radixserve(str(folder), f"{common} --dtype bfloat16 {args.radixserve_args}")
        if engine == "vllm":
            return vllm(folder, f"{common} {args.vllm_args}")
        raise SystemExit(f"unknown engine {engine!r}")

    engines = args.engines.split(",")
    rounds = alternating_rounds(engines, args.rounds, start, lambda engine, server: bench_engine(engine, server, wls))
    rows = []
    for wl in wls:
        for engine in args.engines.split(","):
            got = [r[engine][wl.name] for r in rounds if engine in r]
            if got:
                rows.append([wl.name, engine, statistics.median(x.wall_s for x in got),
                             statistics.median(wl.pairs / x.wall_s for x in got),
                             statistics.median(x.p(0.5) * 1e3 for x in got),
                             statistics.median(x.p(0.9) * 1e3 for x in got),
                             f"{got[-1].cached_tokens}/{got[-1].prompt_tokens}"])  # fmt: skip
    print()
    print(format_table(["workload", "engine", "wall s", "pairs/s", "p50 ms", "p90 ms", "cached"], rows))
    if "radixserve" in args.engines and "vllm" in args.engines:
        ratio_rows = []
        for wl in wls:
            found = versus(rounds, wl.name)
            if found is not None:
                row, ours, theirs = found
                diff = max((abs(a - b) for a, b in zip(ours.scores, theirs.scores)), default=float("nan"))
                ratio_rows.append([*row, diff])
        print()
        print(format_table(["workload", "throughput x vllm", "each round", "p50 latency ours/theirs",
                            "max score difference"], ratio_rows))  # fmt: skip


if __name__ == "__main__":
    main()
