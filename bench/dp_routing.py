"""Data-parallel routing: cache_aware vs round_robin over replicas, on a workload of a few long shared prefixes.

``--replicas`` (default 2) ``radixserve serve`` subprocesses of the same model (``--threads`` torch threads
each), then for each system, in turn for ``--rounds`` rounds, with every replica's prefix cache flushed first:

  * ``cache_aware``: the router (``server.router``, on a thread of this process) with the cache-aware policy;
  * ``round_robin``: the same router with the round-robin policy;
  * ``single``: the first replica alone, no router (a reference for the hit rate one cache gets).

Workload (seeded): ``--prefixes`` system prompts of ``--prefix-len`` tokens cut from the built-in corpus, each
with ``--questions`` distinct user questions, in a shuffled order, as chat completions through the official
``openai`` client, ``--concurrency`` at a time; ``--max-tokens`` output tokens each (EOS ignored).

Reported per system: wall seconds, requests/s, output and total (prompt + output) tokens/s, and the prefix
cache hit rate: cached / all prompt tokens, from the deltas of every replica's /server_info counters. The last
lines give cache_aware / round_robin ratios. Run from the repository root::

    python -m bench.dp_routing                         # the default model
    python -m bench.dp_routing --model <tiny dir>      # a quick run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

from bench.common import CORPUS, format_table, wait_until_healthy
from radixserve.runtime.config import DEFAULT_MODEL
from radixserve.server.router.config import RouterConfig, RoutingConfig
from radixserve.server.router.process import build_http_router
from radixserve.server.testing import ServerThread, free_port

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 600
SYSTEMS = ("cache_aware", "round_robin", "single")


@dataclass
class Run:
    system: str
    wall_s: float
    requests: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@contextlib.contextmanager
def replicas(args: argparse.Namespace) -> Iterator[list[str]]:
    procs, urls = [], []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)}
    try:
        for _ in range(args.replicas):
            port = free_port()
            cmd = [
                sys.executable, "-m", "radixserve.server.cli", "serve", "--model", args.model, "--device", "cpu",
                "--dtype", args.dtype, "--max-total-tokens", str(args.max_total_tokens),
                "--served-model-name", "bench", "--port", str(port), "--log-level", "warning",
            ]  # fmt: skip
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env))
            urls.append(f"http://127.0.0.1:{port}")
        for proc, url in zip(procs, urls):  # started together, so waiting in turn costs no extra time
            wait_until_healthy(proc, url, START_TIMEOUT_S, what=f"replica {url}")
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(60)


def _tokenize(url: str, text: str) -> list[int]:
    return httpx.post(url + "/tokenize", json={"prompt": text}, timeout=60).json()["tokens"]


def make_prompts(args: argparse.Namespace, tokenizer_url: str) -> list[list[dict[str, str]]]:
    """The workload's chat messages, in their (seeded, shuffled) order."""
    rng = random.Random(args.seed)
    systems = []
    for i in range(args.prefixes):
        order = list(CORPUS)
        rng.shuffle(order)
        text = f"You are assistant {i}. Use the reference below.\n\n" + "\n\n".join(order)
        ids = _tokenize(tokenizer_url, text)
        while len(ids) > args.prefix_len:  # cut the text in proportion until it is --prefix-len tokens or fewer
            text = text[: int(len(text) * args.prefix_len / len(ids))]
            ids = _tokenize(tokenizer_url, text)
        systems.append(text)
    requests = [
        [
            {"role": "system", "content": systems[p]},
            {"role": "user", "content": f"Question {q} about part {p}: summarize point {q + 1} in one line."},
        ]
        for p in range(args.prefixes)
        for q in range(args.questions)
    ]
    rng.shuffle(requests)
    return requests


def cache_counters(urls: Sequence[str]) -> tuple[int, int]:
    prompt = cached = 0
    for url in urls:
        stats = httpx.get(url + "/server_info", timeout=60).json()["cache_stats"]
        prompt, cached = prompt + stats["prompt_tokens"], cached + stats["cached_prompt_tokens"]
    return prompt, cached


async def drive(base_url: str, requests: list[list[dict[str, str]]], args: argparse.Namespace) -> tuple[float, int]:
    """Send every request, ``--concurrency`` at a time; (wall seconds, output tokens)."""
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=3600)
    gate = asyncio.Semaphore(args.concurrency)
    out = 0

    async def one(messages: list[dict[str, str]]) -> None:
        nonlocal out
        async with gate:
            resp = await client.chat.completions.create(
                model="bench", messages=messages, max_tokens=args.max_tokens, temperature=0.0,  # type: ignore[arg-type]
                extra_body={"ignore_eos": True},
            )
            out += resp.usage.completion_tokens if resp.usage else 0

    start = time.perf_counter()
    await asyncio.gather(*(one(m) for m in requests))
    wall = time.perf_counter() - start
    await client.close()
    return wall, out


def run_system(system: str, urls: list[str], requests: list[list[dict[str, str]]], args: argparse.Namespace) -> Run:
    used = urls[:1] if system == "single" else urls
    for url in urls:
        httpx.post(url + "/flush_cache", timeout=60).raise_for_status()
    before = cache_counters(used)
    if system == "single":
        wall, out = asyncio.run(drive(urls[0], requests, args))
    else:
        app = build_http_router(RouterConfig(worker_urls=tuple(urls)), RoutingConfig(policy=system))
        with ServerThread(app) as router:
            wall, out = asyncio.run(drive(router.url, requests, args))
    after = cache_counters(used)
    return Run(system, wall, len(requests), after[0] - before[0], after[1] - before[1], out)


def report(runs: list[Run]) -> str:
    rows = []
    for system in SYSTEMS:
        mine = [r for r in runs if r.system == system]
        if not mine:
            continue
        wall = statistics.median(r.wall_s for r in mine)
        r = mine[0]
        rows.append(
            [
                system, r.requests, wall, r.requests / wall, r.output_tokens / wall,
                (r.prompt_tokens + r.output_tokens) / wall, f"{statistics.median(x.hit_rate for x in mine):.3f}",
                r.prompt_tokens - r.cached_tokens,
            ]
        )  # fmt: skip
    headers = ["system", "requests", "wall s", "req/s", "output tok/s", "total tok/s", "hit rate", "computed prompt"]
    text = format_table(headers, rows)
    by = {row[0]: row for row in rows}
    if "cache_aware" in by and "round_robin" in by:
        ca, rr = by["cache_aware"], by["round_robin"]
        text += (
            f"\n\ncache_aware / round_robin: throughput (req/s) x{ca[3] / rr[3]:.2f}, "
            f"hit rate {ca[6]} vs {rr[6]}, computed prompt tokens x{ca[7] / max(1, rr[7]):.2f}"
        )
    return text


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="Model of every replica (default: %(default)s).")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="Torch threads per replica.")
    p.add_argument("--max-total-tokens", type=int, default=16384, help="KV pool of each replica, in tokens.")
    p.add_argument("--prefixes", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=1000, help="Tokens of each shared system prompt (about).")
    p.add_argument("--questions", type=int, default=8, help="Requests per prefix.")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=8, help="Output tokens per request (EOS ignored).")
    p.add_argument("--rounds", type=int, default=2, help="Each system runs once per round; medians are reported.")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="Comma-separated subset of: " + ", ".join(SYSTEMS))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown systems: {', '.join(sorted(unknown))}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    with replicas(args) as urls:
        requests = make_prompts(args, urls[0])
        for url in urls:  # warm-up: each replica's first forward passes are slower
            body = {"model": "bench", "prompt": "Hello, world. " * 50, "max_tokens": 4, "ignore_eos": True}
            httpx.post(url + "/v1/completions", json=body, timeout=600).raise_for_status()
        print(f"{len(requests)} requests, {args.prefixes} prefixes, {args.replicas} replicas", flush=True)
        runs = []
        for _ in range(args.rounds):
            for system in args.systems:
                run = run_system(system, urls, requests, args)
                print(f"  {system}: {run.wall_s:.1f} s, hit rate {run.hit_rate:.3f}", flush=True)
                runs.append(run)
    print()
    print(f"{platform.machine()}, {os.cpu_count()} cores, {args.replicas} replicas x {args.threads} torch threads, "
          f"model {Path(args.model).name}, {args.dtype}")  # fmt: skip
    print(report(runs))


if __name__ == "__main__":
    main()
