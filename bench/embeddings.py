"""Embeddings over HTTP: radixserve (``--runner pooling``) against vLLM's CPU build (``--runner pooling``), the same
``/v1/embeddings`` traffic in one run, one engine busy at a time, each started fresh and warmed up.

The model is random-weight and of Qwen3-Embedding-0.6B's shape (28 layers, hidden 1,024, q/k norms) with SmolLM2's
tokenizer, saved as sentence-transformers saves Qwen3-Embedding (last-token pooling, normalized), bf16; written
once under the benchmark cache. Speed depends on the shape, not on the values. Workloads (token ids, so both
engines see the same tokens):

* ``documents``: indexing, 32 passages of 200-300 tokens, 8 per call, 4 clients;
* ``queries``: retrieval, 128 queries of Qwen3-Embedding's instruction (19 tokens here) and a 10-20-token
  question, one per call, 8 clients;
* ``contextual``: contextual-retrieval indexing, 8 documents' 8 chunks of 80-120 tokens, each chunk after its
  document's 300-400-token context (as Anthropic's recipe prepends it), a document's chunks per call, 4 clients.

Printed per engine and workload: wall time, input tokens/s, call latency p50/p90, the cached tokens the engine
reported; then radixserve's ratio to vLLM, and the cosine similarity between the two engines' embeddings of the
same inputs (both compute in bf16: near 1 says they pool the same way).

    python -m bench.embeddings --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch
from safetensors.torch import save_file

from bench.common import _prompt_ids, format_table
from bench.peers import SERVED, alternating_rounds, closed_loop, radixserve, versus, vllm
from bench.real_models import layer_tensors
from radixserve.runtime import envs
from radixserve.runtime.model_source import resolve_model
from radixserve.runtime.weights import load_tokenizer

# Qwen3-Embedding-0.6B's layers, SmolLM2's vocabulary.
SHAPE = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
         "num_key_value_heads": 8, "head_dim": 128}  # fmt: skip
VOCAB = 49152
INSTRUCTION = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"


def write_model() -> Path:
    out = envs.cache_dir() / "bench-models" / "random-qwen3-embedding-0.6b"
    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    source = resolve_model("smollm2-135m-instruct")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / f, out / f)
    h, inter, layers = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_hidden_layers"]
    heads, kv, hd = SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"], SHAPE["head_dim"]
    gen = torch.Generator().manual_seed(0)

    def rand(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=gen) * 0.02).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n).bfloat16()

    index: dict[str, str] = {}
    for layer in range(-1, layers):
        if layer < 0:
            tensors = {"model.embed_tokens.weight": rand(VOCAB, h), "model.norm.weight": ones(h)}
        else:
            tensors = layer_tensors(f"model.layers.{layer}.", h, inter, heads, kv, hd, rand, qk_norm=True)
        shard = f"model-{layer + 1:05d}-of-{layers + 1:05d}.safetensors"
        save_file(tensors, str(out / shard), metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, shard))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir(exist_ok=True)
    pooling = {"word_embedding_dimension": h, "pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False,
               "pooling_mode_cls_token": False, "include_prompt": True}  # fmt: skip
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": VOCAB, **SHAPE,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "attention_bias": False,
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))  # last: a finished folder has it
    return out


@dataclass(frozen=True)
class Workload:
    name: str
    calls: tuple[tuple[tuple[int, ...], ...], ...]  # each call's inputs (token ids)
    clients: int

    @property
    def tokens(self) -> int:
        return sum(len(x) for call in self.calls for x in call)


def workloads(tokenizer: object) -> list[Workload]:
    rng = random.Random(0)
    docs = [tuple(_prompt_ids(tokenizer, rng, rng.randint(200, 300))) for _ in range(32)]
    head = tokenizer.encode(INSTRUCTION, add_special_tokens=False)  # type: ignore[attr-defined]
    queries = [tuple(head + _prompt_ids(tokenizer, rng, rng.randint(10, 20))) for _ in range(128)]
    contexts = [_prompt_ids(tokenizer, rng, rng.randint(300, 400)) for _ in range(8)]
    chunked = tuple(
        tuple(tuple(c + _prompt_ids(tokenizer, rng, rng.randint(80, 120))) for _ in range(8)) for c in contexts
    )
    return [
        Workload("documents", tuple(tuple(docs[i : i + 8]) for i in range(0, len(docs), 8)), 4),
        Workload("queries", tuple((q,) for q in queries), 8),
        Workload("contextual", chunked, 4),
    ]


@dataclass
class Result:
    wall_s: float = 0.0
    latencies: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    vectors: list[list[float]] = field(default_factory=list)  # the first call's, to compare engines
    errors: list[str] = field(default_factory=list)

    def p(self, q: float) -> float:
        return statistics.quantiles(self.latencies, n=100)[int(q * 100) - 1] if len(self.latencies) > 1 else 0.0


async def run(url: str, wl: Workload) -> Result:
    res = Result()
    async with httpx.AsyncClient(timeout=600) as client:

        async def send(k: int, inputs: tuple[tuple[int, ...], ...]) -> None:
            body = {"model": SERVED, "input": [list(x) for x in inputs], "encoding_format": "float"}
            resp = await client.post(url + "/v1/embeddings", json=body)
            if resp.status_code != 200:
                res.errors.append(resp.text[:200])
                return
            data = resp.json()
            details = (data.get("usage") or {}).get("prompt_tokens_details") or {}
            res.cached_tokens += details.get("cached_tokens") or 0
            if k == 0:
                res.vectors = [d["embedding"] for d in sorted(data["data"], key=lambda d: d["index"])]

        res.wall_s, res.latencies = await closed_loop(wl.calls, wl.clients, send)
    return res


def bench_engine(name: str, server: object, wls: list[Workload]) -> dict[str, Result]:
    print(f"{name}:", flush=True)
    out = {}
    with server as url:  # type: ignore[attr-defined]
        asyncio.run(run(url, Workload("warm-up", (((1, 2, 3, 4),),), 1)))
        for wl in wls:
            res = out[wl.name] = asyncio.run(run(url, wl))
            errors = f", ERRORS {res.errors[:2]}" if res.errors else ""
            print(f"  {wl.name}: {res.wall_s:.2f} s, {wl.tokens / res.wall_s:.0f} tok/s, latency p50 "
                  f"{res.p(0.5) * 1e3:.0f} ms, cached {res.cached_tokens}/{wl.tokens}{errors}", flush=True)  # fmt: skip
    return out


def cosine(a: list[list[float]], b: list[list[float]]) -> float:
    if not a or not b:
        return float("nan")
    x, y = torch.tensor(a), torch.tensor(b)
    return torch.nn.functional.cosine_similarity(x, y, dim=-1).min().item()


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default="radixserve,vllm")
    p.add_argument("--rounds", type=int, default=1, help="every engine this many times, alternating; medians")
    p.add_argument("--radixserve-args", default="")
    p.add_argument("--vllm-args", default="")
    args = p.parse_args(argv)
    folder = write_model()
    wls = workloads(load_tokenizer(folder))

    def start(engine: str) -> object:
        if engine == "radixserve":
            return radixserve(str(folder), f"--runner pooling --dtype bfloat16 {args.radixserve_args}")
        if engine == "vllm":
            return vllm(folder, f"--runner pooling {args.vllm_args}")
        raise SystemExit(f"unknown engine {engine!r}")

    engines = args.engines.split(",")
    rounds = alternating_rounds(engines, args.rounds, start, lambda engine, server: bench_engine(engine, server, wls))
    rows = []
    for wl in wls:
        for engine in args.engines.split(","):
            got = [r[engine][wl.name] for r in rounds if engine in r]
            if not got:
                continue
            rows.append([wl.name, engine, statistics.median(x.wall_s for x in got),
                         statistics.median(wl.tokens / x.wall_s for x in got),
                         statistics.median(x.p(0.5) * 1e3 for x in got), statistics.median(x.p(0.9) * 1e3 for x in got),
                         f"{got[-1].cached_tokens}/{wl.tokens}"])  # fmt: skip
    print()
    print(format_table(["workload", "engine", "wall s", "tok/s", "p50 ms", "p90 ms", "cached"], rows))
    if "radixserve" in args.engines and "vllm" in args.engines:
        ratio_rows = []
        for wl in wls:
            found = versus(rounds, wl.name)
            if found is not None:
                row, ours, theirs = found
                ratio_rows.append([*row, cosine(ours.vectors, theirs.vectors)])
        print()
        print(format_table(["workload", "throughput x vllm", "each round", "p50 latency ours/theirs",
                            "min cosine ours vs vllm"], ratio_rows))  # fmt: skip


if __name__ == "__main__":
    main()
