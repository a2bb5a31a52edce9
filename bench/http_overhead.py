"""HTTP overhead: concurrent streaming clients over HTTP against the same requests through the in-process engine.

Two paths serve the same seeded workload (default: 64 prompts of 200 tokens cut from the built-in corpus, 64
output tokens each, greedy, EOS ignored), all requests at once:

  (a) ``in-process``  64 concurrent ``engine.stream(...)`` consumers on one asyncio loop;
  (b) ``http``        64 concurrent streaming clients (``httpx.AsyncClient``, one connection each) on
                      ``POST /v1/completions`` with token-id prompts and ``stream_options.include_usage``.

The server runs either on a thread of this process over the very engine that (a) uses (``--server thread``,
the default: same weights, same KV pool, and the clients' CPU counts against the server, which is the
pessimistic case on a small machine), or as a ``radixserve serve`` subprocess with the same engine flags
(``--server subprocess``: the clients run in another process, as they would in a deployment).

The paths alternate for ``--rounds`` rounds (a, b, b, a, a, b, ...), each run after a warm-up and with the prefix
cache flushed, so slow phases of a shared machine hit both. TTFT is the time from a request's start (just before
the HTTP request is sent / the stream is opened) to its first non-empty text, the first event an SSE client can
show. Under 64 concurrent prompts TTFT is mostly queueing behind the other prompts' prefill, so a last phase
(``--probes``) also sends single requests one at a time, alternating the paths with the cache flushed before each:
their paired TTFT difference is the fixed latency HTTP adds to one request. Targets (from the issue): the HTTP
path costs <= 10% of the output throughput and adds <= 20 ms to the median TTFT.

Run from the repository root::

    python -m bench.http_overhead --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import httpx
import torch

from bench.common import Request, format_table, machine_summary, make_workload, wait_until_healthy
from radixserve.runtime.config import DEFAULT_MODEL
from radixserve.runtime.engine import Engine
from radixserve.runtime.sampling_params import SamplingParams
from radixserve.server import ServerConfig, create_app
from radixserve.server.testing import ServerThread, free_port

SERVER_START_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 900.0
TARGET_TPUT_COST = 0.10  # the HTTP path may cost at most this share of the in-process output tok/s
TARGET_TTFT_ADD_MS = 20.0  # and add at most this much to the median TTFT
WARMUP_REQUESTS = 4
WARMUP_TOKENS = 8
PROBE_TOKENS = 4


@dataclass
class ReqStats:
    ttft_s: float
    output_tokens: int
    text: str


@dataclass
class Run:
    path: str
    round: int
    wall_s: float
    cpu_s: float
    reqs: list[ReqStats]
    load: float

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.reqs)

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def ttft_median_ms(self) -> float:
        return 1000 * statistics.median(r.ttft_s for r in self.reqs)

    @property
    def ttft_p90_ms(self) -> float:
        return 1000 * percentile([r.ttft_s for r in self.reqs], 0.9)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated ``q`` quantile (as numpy's default)."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _params(output_len: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)


# --- (a) in-process -----------------------------------------------------------------------------------------
async def _one_in_process(engine: Engine, req: Request) -> ReqStats:
    start = time.perf_counter()
    ttft: float | None = None
    text, tokens = [], 0
    async for out in engine.stream(req.prompt_ids, _params(req.output_len)):
        if ttft is None and out.text:
            ttft = time.perf_counter() - start
        text.append(out.text)
        if out.finished:
            if out.error:
                raise RuntimeError(f"request failed: {out.error}")
            tokens = out.completion_tokens
    assert ttft is not None, "no text came back"
    return ReqStats(ttft, tokens, "".join(text))


async def _all_in_process(engine: Engine, reqs: Sequence[Request]) -> list[ReqStats]:
    return list(await asyncio.gather(*(_one_in_process(engine, r) for r in reqs)))


# --- (b) HTTP ---------------------------------------------------------------------------------------------
async def _one_http(client: httpx.AsyncClient, model: str, req: Request) -> ReqStats:
    body = {
        "model": model,
        "prompt": req.prompt_ids,
        "max_tokens": req.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft: float | None = None
    text, tokens = [], 0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread()).decode()}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            for choice in event["choices"]:
                if ttft is None and choice["text"]:
                    ttft = time.perf_counter() - start
                text.append(choice["text"])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    assert ttft is not None, "no text came back"
    return ReqStats(ttft, tokens, "".join(text))


async def _all_http(base_url: str, model: str, reqs: Sequence[Request]) -> list[ReqStats]:
    limits = httpx.Limits(max_connections=len(reqs), max_keepalive_connections=len(reqs))
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=REQUEST_TIMEOUT_S) as client:
        return list(await asyncio.gather(*(_one_http(client, model, r) for r in reqs)))


# --- servers ----------------------------------------------------------------------------------------------
class Target:
    """Where (b) sends its requests, and how to flush that engine's prefix cache and read its CPU time."""

    def __init__(self, url: str, engine: Engine | None, proc: subprocess.Popen[bytes] | None) -> None:
        self.url, self.engine, self.proc = url, engine, proc

    def flush(self) -> None:
        if self.engine is not None:
            assert self.engine.flush_cache(), "flush refused: requests still running"
        else:
            httpx.post(self.url + "/flush_cache", timeout=60).raise_for_status()

    def cpu_s(self) -> float:
        """CPU seconds of the server subprocess (0 with a server thread: this process's time covers it)."""
        if self.proc is None:
            return 0.0
        try:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return float("nan")


@contextlib.contextmanager
def serve(args: argparse.Namespace, engine: Engine) -> Iterator[Target]:
    if args.server == "thread":
        with ServerThread(create_app(engine, ServerConfig(served_model_name=args.model))) as srv:
            yield Target(srv.url, engine, None)
        return
    port = free_port()
    cmd = [
        sys.executable, "-m", "radixserve.server.cli", "serve", "--model", args.model, "--device", "cpu",
        "--dtype", args.dtype, "--max-total-tokens", str(args.max_total_tokens),
        "--max-running-requests", str(args.clients), "--served-model-name", args.model,
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, url, SERVER_START_TIMEOUT_S)
        yield Target(url, None, proc)
    finally:
        proc.terminate()
        proc.wait(60)


# --- measuring --------------------------------------------------------------------------------------------
def measure(path: str, rnd: int, engine: Engine, target: Target, model: str, reqs: Sequence[Request]) -> Run:
    flush(path, engine, target)
    cpu0, server_cpu0 = time.process_time(), target.cpu_s()
    start = time.perf_counter()
    if path == "in-process":
        stats = asyncio.run(_all_in_process(engine, reqs))
    else:
        stats = asyncio.run(_all_http(target.url, model, reqs))
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu0 + target.cpu_s() - server_cpu0
    for req, st in zip(reqs, stats):
        assert st.output_tokens == req.output_len, f"{path}: {st.output_tokens} tokens for {req.output_len} asked"
    run = Run(path, rnd, wall, cpu, stats, os.getloadavg()[0])
    print(
        f"  round {rnd} {path:>10}: {wall:6.1f} s, {run.output_tps:6.1f} output tok/s, TTFT median "
        f"{run.ttft_median_ms:7.1f} ms p90 {run.ttft_p90_ms:7.1f} ms, load {run.load:.1f}",
        file=sys.stderr,
        flush=True,
    )
    return run


def report(runs: list[Run], rounds: int) -> str:
    paths = ("in-process", "http")
    by_path = {p: [r for r in runs if r.path == p] for p in paths}
    per_round = format_table(
        ["round", "path", "wall s", "cpu s", "output tok/s", "TTFT median ms", "TTFT p90 ms", "load"],
        [
            [r.round, r.path, r.wall_s, r.cpu_s, r.output_tps, r.ttft_median_ms, r.ttft_p90_ms, r.load]
            for r in sorted(runs, key=lambda r: (r.round, paths.index(r.path)))
        ],
    )
    summary_rows = []
    for p in paths:
        rs = by_path[p]
        summary_rows.append(
            [
                p,
                len(rs),
                statistics.median(r.wall_s for r in rs),
                statistics.median(r.cpu_s for r in rs),
                statistics.median(r.output_tps for r in rs),
                statistics.median(r.ttft_median_ms for r in rs),
                statistics.median(r.ttft_p90_ms for r in rs),
            ]
        )
    summary = format_table(
        ["path", "runs", "wall s", "cpu s", "output tok/s", "TTFT median ms", "TTFT p90 ms"], summary_rows
    )
    inproc, http = summary_rows
    cost = 1 - http[4] / inproc[4]
    added = http[5] - inproc[5]
    # Paired by round (the two runs of a round ran back to back): steadier on a shared machine.
    pairs = list(zip(by_path["in-process"], by_path["http"]))
    paired_cost = statistics.median(1 - h.output_tps / a.output_tps for a, h in pairs)
    paired_added = statistics.median(h.ttft_median_ms - a.ttft_median_ms for a, h in pairs)
    cpu_ratio = http[3] / inproc[3] if inproc[3] else float("nan")
    same = sum(a.text == h.text for ra, rh in pairs for a, h in zip(ra.reqs, rh.reqs))
    total = sum(len(ra.reqs) for ra, _ in pairs)

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    lines = [
        "per run:",
        per_round,
        "",
        f"median of {rounds} runs per path:",
        summary,
        "",
        f"throughput cost of HTTP: {100 * cost:.1f}% of output tok/s (median by round: {100 * paired_cost:.1f}%); "
        f"target <= {100 * TARGET_TPUT_COST:.0f}%: {verdict(max(cost, paired_cost) <= TARGET_TPUT_COST)}",
        f"TTFT added by HTTP: {added:+.1f} ms at the median (median by round: {paired_added:+.1f} ms); "
        f"target <= {TARGET_TTFT_ADD_MS:.0f} ms: {verdict(max(added, paired_added) <= TARGET_TTFT_ADD_MS)}",
        f"CPU seconds, http / in-process: {cpu_ratio:.2f}x",
        f"identical greedy text, http vs in-process of the same round: {same}/{total} requests",
    ]
    return "\n".join(lines)


def flush(path: str, engine: Engine, target: Target) -> None:
    if path == "in-process":
        assert engine.flush_cache(), "flush refused: requests still running"
    else:
        target.flush()


def probe_ttft(
    engine: Engine, target: Target, model: str, reqs: Sequence[Request], n: int, prompt_len: int
) -> dict[str, list[float]]:
    """TTFT in seconds of ``n`` requests per path sent one at a time (nothing else running), alternating, the
    cache flushed before each: the fixed latency HTTP adds to a request, which the TTFT of the concurrent runs
    (seconds of queueing behind the other prompts' prefill) cannot resolve. Short prompts keep the engine's
    share, and with it the noise of a shared machine, small."""
    ttft: dict[str, list[float]] = {"in-process": [], "http": []}
    for k in range(n):
        req = Request(reqs[k % len(reqs)].prompt_ids[:prompt_len], PROBE_TOKENS)
        for path in ("in-process", "http") if k % 2 == 0 else ("http", "in-process"):
            flush(path, engine, target)
            if path == "in-process":
                stats = asyncio.run(_all_in_process(engine, [req]))
            else:
                stats = asyncio.run(_all_http(target.url, model, [req]))
            ttft[path].append(stats[0].ttft_s)
    return ttft


def probe_report(ttft: dict[str, list[float]], prompt_len: int) -> str:
    a, h = ttft["in-process"], ttft["http"]
    added = 1000 * statistics.median(y - x for x, y in zip(a, h))
    ok = "met" if added <= TARGET_TTFT_ADD_MS else "NOT met"
    return (
        f"single-request TTFT ({len(a)} requests per path, {prompt_len}-token prompts, one at a time, alternating): "
        "in-process median "
        f"{1000 * statistics.median(a):.1f} ms, http median {1000 * statistics.median(h):.1f} ms; added by HTTP "
        f"(median of paired differences): {added:+.1f} ms; target <= {TARGET_TTFT_ADD_MS:.0f} ms: {ok}"
    )


def warm_up(engine: Engine, target: Target, model: str, reqs: Sequence[Request]) -> None:
    few = [Request(r.prompt_ids[:32], WARMUP_TOKENS) for r in reqs[:WARMUP_REQUESTS]]
    asyncio.run(_all_in_process(engine, few))
    asyncio.run(_all_http(target.url, model, few))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="local HF folder, .gguf file or built-in name")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--clients", type=int, default=64, help="concurrent requests (one per client)")
    p.add_argument("--prompt-len", type=int, default=200, help="prompt tokens of every request")
    p.add_argument("--output-len", type=int, default=64, help="output tokens of every request (EOS ignored)")
    p.add_argument("--rounds", type=int, default=3, help="runs of each path, alternating (0: only the probes)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--probes", type=int, default=32, help="single requests per path for the unloaded TTFT (0: none)")
    p.add_argument("--probe-prompt-len", type=int, default=32, help="prompt tokens of those single requests")
    p.add_argument("--max-total-tokens", type=int, default=32768, help="KV pool size in tokens")
    p.add_argument("--threads", type=int, default=2, help="torch threads (of the server subprocess too)")
    p.add_argument("--server", default="thread", choices=("thread", "subprocess"),
                   help="HTTP server on a thread over the same engine, or a `radixserve serve` subprocess")  # fmt: skip
    args = p.parse_args(argv)
    if min(args.clients, args.prompt_len, args.output_len, args.probe_prompt_len) < 1:
        p.error("--clients, --prompt-len, --output-len and --probe-prompt-len must be >= 1")
    if min(args.rounds, args.probes) < 0 or args.rounds + args.probes == 0:
        p.error("--rounds and --probes must be >= 0, and not both 0")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    engine = Engine(
        model=args.model,
        device="cpu",
        dtype=args.dtype,
        max_total_tokens=args.max_total_tokens,
        max_running_requests=args.clients,
    )
    try:
        reqs = make_workload(engine.tokenizer, args.clients, (args.prompt_len,) * 2, (args.output_len,) * 2, args.seed)
        print(
            f"{time.strftime('%Y-%m-%d')} | {machine_summary()} | model {args.model} {args.dtype} | "
            f"{args.clients} concurrent streams, {args.prompt_len} prompt + {args.output_len} output tokens each, "
            f"greedy, EOS ignored | server: {args.server} | {args.rounds} rounds, alternating",
            flush=True,
        )
        with serve(args, engine) as target:
            warm_up(engine, target, args.model, reqs)
            runs: list[Run] = []
            for rnd in range(1, args.rounds + 1):
                order = ("in-process", "http") if rnd % 2 else ("http", "in-process")
                for path in order:
                    runs.append(measure(path, rnd, engine, target, args.model, reqs))
            probe = None
            if args.probes:
                probe = probe_ttft(engine, target, args.model, reqs, args.probes, args.probe_prompt_len)
        if runs:
            print("\n" + report(runs, args.rounds), flush=True)
        if probe is not None:
            print(probe_report(probe, args.probe_prompt_len), flush=True)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
