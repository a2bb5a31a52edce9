"""The KV tier (``--enable-hierarchical-cache``): a RAG workload larger than the KV pool, and a warm restart.

RAG (in process, the same engine with and without the tier, one after the other): ``--docs`` documents of
``--doc-tokens`` tokens each (the corpus of ``bench.common``), each asked about ``--rounds`` times, every round in
a new shuffled order, against a pool of ``--pool`` tokens that holds a fraction of them. A request is a short
system line, the document and a question that differs per round; ``--out-tokens`` greedy tokens. Requests go one
at a time, so each TTFT is that request's own prefill (or load). Printed: prompt tokens computed (admitted prompt
tokens minus those served from a cache), TTFT p50 over the re-asked documents (rounds 2 on), and whether every
output equals the run without the tier.

Warm restart (``radixserve serve`` as a subprocess, streamed ``/v1/completions``): a server with an empty tier
folder answers a request whose prompt starts with a ``--restart-tokens``-token document (the cold TTFT, the first
request of a fresh process), is stopped with SIGTERM (it saves the radix cache), and a new server on the same folder
answers the same request (the warm TTFT). Same outputs required.

    python -m bench.kv_tier                           # both parts, the built-in model, --dtype auto
    python -m bench.kv_tier --docs 20 --skip-restart  # a quick RAG run
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from bench.common import _prompt_ids, format_table, machine_summary, stop_process, wait_until_healthy
from radixserve.runtime.engine import Engine
from radixserve.runtime.request import ReqOutput
from radixserve.runtime.sampling_params import SamplingParams


def rag_requests(tokenizer: Any, docs: int, doc_tokens: int, rounds: int, seed: int) -> list[tuple[int, list[int]]]:
    """``(document index, prompt ids)`` in the order sent: round after round, each a shuffle of every document."""
    rng = random.Random(seed)
    system = tokenizer.encode("Answer from the document below.\n\n", add_special_tokens=False)
    documents = [_prompt_ids(tokenizer, rng, doc_tokens) for _ in range(docs)]
    out = []
    for r in range(rounds):
        order = list(range(docs))
        rng.shuffle(order)
        for d in order:
            question = tokenizer.encode(f"\n\nQuestion {r}: what does part {r + 1} say?", add_special_tokens=False)
            out.append((d, system + documents[d] + question))
    return out


def run_rag(args: argparse.Namespace, tier_dir: Path | None) -> dict[str, Any]:
    options: dict[str, Any] = {"model": args.model, "dtype": args.dtype, "max_total_tokens": args.pool}
    if tier_dir is not None:
        options.update(enable_hierarchical_cache=True, hicache_dir=str(tier_dir))
    engine = Engine(**options)
    try:
        requests = rag_requests(engine.tokenizer, args.docs, args.doc_tokens, args.rounds, args.seed)
        params = SamplingParams(max_new_tokens=args.out_tokens, temperature=0.0, ignore_eos=True)
        ttft, outputs = [], []
        begin = time.perf_counter()
        for _, ids in requests:
            done: Future[list[int]] = Future()
            first: list[float] = []
            tokens: list[int] = []

            def sink(out: ReqOutput, first=first, tokens=tokens, done=done) -> None:
                if not first and out.token_ids:
                    first.append(time.perf_counter())
                tokens.extend(out.token_ids)
                if out.finished:
                    done.set_result(tokens)

            sent = time.perf_counter()
            engine.submit(ids, params, sink)
            outputs.append(done.result(600))
            ttft.append(first[0] - sent)
        wall = time.perf_counter() - begin
        info = engine.server_info()
        engine.check_kv()
    finally:
        engine.shutdown()
    stats = info["cache_stats"]
    return {
        "wall": wall,
        "ttft": ttft,
        "outputs": outputs,
        "prompt_tokens": int(stats["prompt_tokens"]),
        "computed": int(stats["prompt_tokens"] - stats["cached_prompt_tokens"]),
        "tier": info.get("kv_tier"),
    }


def rag(args: argparse.Namespace) -> None:
    first_round = args.docs
    tier_dir = Path(tempfile.mkdtemp(prefix="radixserve-kv-tier-"))
    try:
        base = run_rag(args, None)
        tier = run_rag(args, tier_dir)
    finally:
        shutil.rmtree(tier_dir, ignore_errors=True)
    rows = []
    for name, run in (("radix cache only", base), ("radix cache + disk tier", tier)):
        again = run["ttft"][first_round:]
        rows.append([name, run["wall"], run["prompt_tokens"], run["computed"], 1000 * statistics.median(again)])
    print(format_table(["run", "wall s", "prompt tokens", "computed", "TTFT p50 re-asked ms"], rows))
    fall = 1 - tier["computed"] / base["computed"]
    ratio = statistics.median(tier["ttft"][first_round:]) / statistics.median(base["ttft"][first_round:])
    same = sum(a == b for a, b in zip(base["outputs"], tier["outputs"]))
    print(f"prompt tokens computed fall by {100 * fall:.1f}% (target >= 60%)")
    print(f"TTFT p50 on re-asked documents: {100 * ratio:.1f}% of recomputing (target <= 40%)")
    print(f"outputs identical: {same}/{len(base['outputs'])}")
    print("tier:", json.dumps(tier["tier"]))


def _stream_ttft(url: str, prompt: list[int], out_tokens: int) -> tuple[float, str, int]:
    import httpx

    body = {"prompt": prompt, "max_tokens": out_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    sent = time.perf_counter()
    ttft, text, cached = None, "", -1
    with httpx.Client(timeout=600) as http, http.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or []:
                if choice.get("text") and ttft is None:
                    ttft = time.perf_counter() - sent
                text += choice.get("text") or ""
            if event.get("usage"):
                cached = ((event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    assert ttft is not None, "no token streamed"
    return ttft, text, cached


def restart(args: argparse.Namespace) -> None:
    from radixserve.server.testing import free_port

    tier_dir = Path(tempfile.mkdtemp(prefix="radixserve-kv-tier-"))
    rows, texts = [], []
    try:
        for name in ("cold start (empty tier)", "warm restart"):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            cmd = [sys.executable, "-m", "radixserve.server.cli", "serve", "--model", args.model, "--port", str(port)]
            cmd += ["--dtype", args.dtype, "--enable-hierarchical-cache", "--hicache-dir", str(tier_dir)]
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                wait_until_healthy(proc, url)
                prompt = restart_prompt(args)
                ttft, text, cached = _stream_ttft(url, prompt, args.out_tokens)
            finally:
                stop_process(proc)
            rows.append([name, len(prompt), cached, 1000 * ttft])
            texts.append(text)
    finally:
        shutil.rmtree(tier_dir, ignore_errors=True)
    print(format_table(["server", "prompt tokens", "cached tokens", "TTFT ms"], rows))
    print(f"warm TTFT: {100 * rows[1][3] / rows[0][3]:.1f}% of the cold start's (target <= 30%)")
    print(f"same output: {texts[0] == texts[1]}")


def restart_prompt(args: argparse.Namespace) -> list[int]:
    from radixserve.runtime.model_source import resolve_model
    from radixserve.runtime.weights import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(args.model))
    rng = random.Random(args.seed + 1)
    doc = _prompt_ids(tokenizer, rng, args.restart_tokens)
    return doc + tokenizer.encode("\n\nSummarize the text above.", add_special_tokens=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--docs", type=int, default=100)
    parser.add_argument("--doc-tokens", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pool", type=int, default=40960, help="KV pool tokens")
    parser.add_argument("--out-tokens", type=int, default=8)
    parser.add_argument("--restart-tokens", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-rag", action="store_true")
    parser.add_argument("--skip-restart", action="store_true")
    args = parser.parse_args()
    print(machine_summary())
    if not args.skip_rag:
        rag(args)
    if not args.skip_restart:
        restart(args)


if __name__ == "__main__":
    main()
