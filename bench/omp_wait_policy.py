"""`radixserve serve` under each OpenMP wait policy: output throughput of concurrent chat requests over HTTP.

libgomp reads ``OMP_WAIT_POLICY`` once, when torch loads. ``default`` (the variable empty: idle workers spin
briefly, then sleep) is what `radixserve serve` runs with unless the environment says otherwise; ``PASSIVE``
(workers sleep at once) is what it used to force. Each round starts one server subprocess per policy, in turn,
sends ``--clients`` concurrent chat requests (every other one JSON-schema constrained, the rest streamed with EOS
ignored) ``--repeats`` times, and reports output tokens per second; medians over rounds.

    python -m bench.omp_wait_policy --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import httpx

from bench.common import format_table, machine_summary, wait_until_healthy
from radixserve.runtime.config import DEFAULT_MODEL
from radixserve.server.testing import free_port

POLICIES = ("default", "PASSIVE")


def _request(i: int, max_tokens: int) -> dict:
    body: dict = {
        "model": DEFAULT_MODEL,
        "messages": [{"role": "user", "content": f"Describe person number {i} as JSON."}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if i % 2 == 0:
        schema = {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                f"age{i}": {"type": "integer"},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 30},
            },
            "required": ["name", f"age{i}", "tags"],
        }
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    else:
        body.update(ignore_eos=True, stream=True, stream_options={"include_usage": True})
    return body


def _one(url: str, i: int, max_tokens: int, counts: list[int]) -> None:
    body = _request(i, max_tokens)
    if not body.get("stream"):
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        counts[i] = r.json()["usage"]["completion_tokens"]
        return
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[len("data: ") :]).get("usage")
                if usage:
                    counts[i] = usage["completion_tokens"]


def run_server(policy: str, args: argparse.Namespace) -> list[float]:
    env = dict(os.environ, OMP_WAIT_POLICY="" if policy == "default" else policy)
    port = free_port()
    cmd = [sys.executable, "-m", "radixserve.server.cli", "serve", "--port", str(port), "--model", args.model]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, url, what=f"the {policy} server")
        _one(url, 1, 8, [0, 0])  # warm-up
        rates = []
        for _ in range(args.repeats):
            counts = [0] * args.clients
            threads = [
                threading.Thread(target=_one, args=(url, i, args.max_tokens, counts)) for i in range(args.clients)
            ]
            start = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if not all(counts):
                raise RuntimeError(f"a request reported no output tokens: {counts}")
            rates.append(sum(counts) / (time.perf_counter() - start))
        return rates
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3, help="batches of requests per server start")
    p.add_argument("--rounds", type=int, default=2, help="server starts per policy, alternating")
    args = p.parse_args(argv)
    print(f"{time.strftime('%Y-%m-%d')} | {machine_summary()} | {args.clients} clients x {args.max_tokens} tokens")
    rates: dict[str, list[float]] = {policy: [] for policy in POLICIES}
    for r in range(args.rounds):
        for policy in POLICIES:
            got = run_server(policy, args)
            rates[policy] += got
            print(f"  round {r + 1} {policy}: " + ", ".join(f"{x:.1f}" for x in got) + " tok/s", flush=True)
    base = statistics.median(rates["PASSIVE"])
    rows = [[policy, statistics.median(v), statistics.median(v) / base] for policy, v in rates.items()]
    print(format_table(["OMP_WAIT_POLICY", "output tok/s (median)", "vs PASSIVE"], rows))


if __name__ == "__main__":
    main()
