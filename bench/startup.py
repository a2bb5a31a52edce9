"""Cached start to ready: from the command to the first 200 from ``/health``, radixserve against llama-server.

Each server is started ``--runs`` times in turn (the first start of each is a warm-up that fills caches and is
not counted), polled every 20 ms; printed: the median and each run's seconds, and the ratio to llama-server.

    python -m bench.startup                       # the built-in SmolLM2-135M, 5 runs
    python -m bench.startup --radixserve-args "--no-engine-process"
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from bench import llamacpp_peer as llama
from bench.common import format_table, stop_process
from bench.peers import PEERS
from radixserve.runtime.model_source import resolve_model


def time_to_ready(argv: Sequence[str], port: int, timeout_s: float = 300.0) -> float:
    start = time.perf_counter()
    proc = subprocess.Popen(list(argv), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{argv[0]} exited with status {proc.returncode}: {shlex.join(argv)}")
            with contextlib.suppress(OSError):
                if health_status(port) == 200:
                    return time.perf_counter() - start
            if time.perf_counter() - start > timeout_s:
                raise RuntimeError(f"not ready within {timeout_s:.0f} s: {shlex.join(argv)}")
            time.sleep(0.02)
    finally:
        stop_process(proc)


def health_status(port: int) -> int:
    """One plain ``GET /health``. Not ``httpx.get``: that builds an SSL context per call, and polled every 20 ms it
    took ~60% of a core, a third of a 2-core machine, from the server being timed."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    finally:
        conn.close()


def radixserve_argv(model: str, extra: str = "") -> Callable[[int], list[str]]:
    """The command that starts radixserve on a given port."""
    return lambda port: [sys.executable, "-m", "radixserve.server.cli", "serve", "--model", model,
                         "--port", str(port), *shlex.split(extra)]  # fmt: skip


def start_times(engines: dict[str, Callable[[int], list[str]]], runs: int) -> dict[str, list[float]]:
    """Seconds to ready of each engine, ``runs`` times, interleaved (so drift hits all alike), after one start each
    that warms the caches up and is not counted."""
    times: dict[str, list[float]] = {name: [] for name in engines}
    for run in range(runs + 1):
        for name, make in engines.items():
            port = llama.free_port()
            seconds = time_to_ready(make(port), port)
            if run:
                times[name].append(seconds)
    return times


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--radixserve-args", default="")
    p.add_argument("--skip-llama", action="store_true")
    args = p.parse_args(argv)
    folder = resolve_model(args.model)  # converted once, before anything is timed

    engines = {"radixserve": radixserve_argv(args.model, args.radixserve_args)}
    if not args.skip_llama:
        found = subprocess.run(["bash", str(PEERS / "llama-server.sh")], capture_output=True, text=True, check=True)
        kind = llama.ServerKind("llama-server", (found.stdout.strip().splitlines()[-1],))
        gguf = folder / "model.gguf"
        engines["llama-server"] = lambda port: llama.server_argv(kind, gguf, port, os.cpu_count() or 2, 8, 4096)
    times = start_times(engines, args.runs)
    rows = [[name, statistics.median(ts), " ".join(f"{t:.2f}" for t in ts)] for name, ts in times.items()]
    print(f"# cached start to the first 200 from /health, {args.model}, {args.runs} runs each")
    print(format_table(["server", "median s", "runs"], rows))
    if "llama-server" in times:
        ratio = statistics.median(times["radixserve"]) / statistics.median(times["llama-server"])
        print(f"radixserve / llama-server: {ratio:.1f}x")


if __name__ == "__main__":
    main()
