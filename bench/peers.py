"""radixserve against the engines users would pick instead, over HTTP, in one run: vLLM's CPU build and
llama.cpp's llama-server (through the scripts in ``../shared/peers/``), one engine busy at a time, each started
fresh and warmed up with one request.

    python -m bench.peers                                  # SmolLM2-135M, all engines and workloads
    python -m bench.peers --engines radixserve,vllm --workloads shared,single --radixserve-args "--dtype bfloat16"

Workloads (``bench/peer_workloads.py``): 48 requests sharing a ~1,300-token system prompt (32 tokens out, 16
clients); 48 distinct ~600-token prompts (64 out, 16 clients); 8 conversations x 4 turns (48 a turn); one user
(5 requests in turn, 128 out each). llama-server serves the model's GGUF dequantized to BF16 (``--gguf-type``;
``--gguf`` names another file), the weights vLLM serves from the bfloat16 folder. Printed per engine and workload:
wall time, output tok/s, TTFT p50/p90, one-user decode tok/s, cached prompt tokens; then radixserve's ratio to
each peer (throughput: higher is better; TTFT: ours / theirs).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from bench import llamacpp_peer as llama
from bench.common import format_table, safetensors_folder, stop_process, wait_until_healthy
from bench.peer_workloads import WORKLOADS, Result, Workload, run
from radixserve.runtime.model_source import resolve_model
from radixserve.runtime.weights import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT.parent / "shared" / "peers"
SERVED = "bench-model"
T = TypeVar("T")
C = TypeVar("C")


@contextmanager
def _process(argv: Sequence[str], port: int, what: str, env: dict[str, str] | None = None) -> Iterator[str]:
    log = tempfile.NamedTemporaryFile("w+b", prefix=f"bench-{what}-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        start = time.perf_counter()
        wait_until_healthy(proc, url, timeout_s=900, what=what)
        print(f"  {what} ready after {time.perf_counter() - start:.1f} s (log: {log.name})", flush=True)
        yield url
    except RuntimeError:
        log.seek(0)
        print(log.read().decode(errors="replace")[-3000:], file=sys.stderr)
        raise
    finally:
        stop_process(proc)
        log.close()


def radixserve(model: str, extra: str) -> contextmanager:
    port = llama.free_port()
    argv = [sys.executable, "-m", "radixserve.server.cli", "serve", "--model", model, "--port", str(port),
            "--served-model-name", SERVED, *shlex.split(extra)]  # fmt: skip
    return _process(argv, port, "radixserve")


def vllm(folder: Path, extra: str) -> contextmanager:
    port = llama.free_port()
    argv = ["bash", str(PEERS / "vllm-cpu.sh"), str(folder), str(port), "--served-model-name", SERVED,
            *shlex.split(extra)]  # fmt: skip
    return _process(argv, port, "vllm")


def llama_server(gguf: Path, extra: str, parallel: int = 16, ctx_per_slot: int = 4096) -> contextmanager:
    binary = subprocess.run(["bash", str(PEERS / "llama-server.sh")], capture_output=True, text=True, check=True)
    port = llama.free_port()
    kind = llama.ServerKind("llama-server", (binary.stdout.strip().splitlines()[-1],))
    argv = llama.server_argv(kind, gguf, port, os.cpu_count() or 2, parallel, ctx_per_slot)
    return _process([*argv, "--alias", SERVED, *shlex.split(extra)], port, "llama-server")


def alternating_rounds(
    engines: Sequence[str], rounds: int, start: Callable[[str], Any], run: Callable[[str, Any], T]
) -> list[dict[str, T]]:
    """``run(engine, start(engine))`` for every engine, ``rounds`` times, alternating (one engine busy at a time,
    so drift hits all alike); an engine that fails to start or to run is reported and left out of its round."""
    out: list[dict[str, T]] = []
    for i in range(rounds):
        print(f"round {i + 1} of {rounds}", flush=True)
        results: dict[str, T] = {}
        for engine in engines:
            try:
                results[engine] = run(engine, start(engine))
            except (RuntimeError, OSError) as exc:
                print(f"{engine} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        out.append(results)
    return out


async def closed_loop(
    calls: Sequence[C], clients: int, send: Callable[[int, C], Awaitable[None]]
) -> tuple[float, list[float]]:
    """``send(k, calls[k])`` for every call from ``clients`` concurrent clients, each taking the next call once its
    last one is answered; the wall time and each call's latency, in seconds."""
    todo = list(enumerate(calls))
    latencies: list[float] = []

    async def client() -> None:
        while todo:
            k, call = todo.pop(0)
            start = time.perf_counter()
            await send(k, call)
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return time.perf_counter() - start, latencies


def versus(
    rounds: list[dict[str, dict[str, Any]]], workload: str, ours: str = "radixserve", peer: str = "vllm"
) -> tuple[list[Any], Any, Any] | None:
    """Over the rounds that ran both engines: ``[workload, median throughput ratio (ours over the peer's), each
    round's, median call latency p50 ratio (ours / theirs)]``, and the last such round's two results (results
    with ``wall_s`` and ``p(q)``); None where no round ran both."""
    pairs = [(r[ours][workload], r[peer][workload]) for r in rounds if {ours, peer} <= set(r)]
    if not pairs:
        return None
    speed = [v.wall_s / o.wall_s for o, v in pairs]
    lat = [o.p(0.5) / v.p(0.5) for o, v in pairs if v.p(0.5) > 0]
    row = [workload, statistics.median(speed), " ".join(f"{x:.2f}" for x in speed),
           statistics.median(lat) if lat else float("nan")]  # fmt: skip
    return row, pairs[-1][0], pairs[-1][1]


def _warm_up(url: str, tokenizer: object, model: str = SERVED) -> None:
    asyncio.run(run(url, model, Workload("warm-up", (((1, 2, 3, 4),),), 8, 1), tokenizer))


def bench_engine(
    name: str, server: contextmanager, workloads: list[Workload], tokenizer: object, model: str = SERVED
) -> dict[str, Result]:
    """``model``: the name requests send (a LoRA adapter's, say)."""
    print(f"{name}:", flush=True)
    out: dict[str, Result] = {}
    with server as url:
        _warm_up(url, tokenizer, model)
        for wl in workloads:
            res = asyncio.run(run(url, model, wl, tokenizer))
            out[wl.name] = res
            errors = f", ERRORS {res.errors[:2]}" if res.errors else ""
            print(
                f"  {wl.name}: {res.wall_s:.2f} s, {res.tok_s:.1f} output tok/s, "
                f"TTFT p50 {res.ttft(0.5) * 1e3:.0f} ms, cached {res.cached_tokens}/{res.prompt_tokens}{errors}",
                flush=True,
            )
    return out


def report(results: dict[str, dict[str, Result]], workloads: list[Workload]) -> str:
    rows = []
    for engine, by_wl in results.items():
        for wl in workloads:
            r = by_wl.get(wl.name)
            if r is None:
                continue
            rows.append([engine, wl.name, r.wall_s, r.tok_s, r.ttft(0.5) * 1e3, r.ttft(0.9) * 1e3, r.decode,
                         f"{r.cached_tokens}/{r.prompt_tokens}", len(r.errors)])  # fmt: skip
    text = format_table(
        ["engine", "workload", "wall s", "out tok/s", "TTFT p50 ms", "TTFT p90 ms", "decode tok/s", "cached", "errors"],
        rows,
    )
    ratio_rows = ratios(results, workloads)
    if ratio_rows:
        text += "\n\nradixserve / peer:\n" + format_table(
            ["peer", "workload", "throughput x", "TTFT p50 ours/theirs", "decode x"], ratio_rows
        )
    return text


def ratios(results: dict[str, dict[str, Result]], workloads: list[Workload]) -> list[list]:
    """[peer, workload, throughput ours / theirs, TTFT p50 ours / theirs, one-user decode ours / theirs]."""
    ours = results.get("radixserve")
    rows: list[list] = []
    for peer, by_wl in results.items():
        if ours is None or peer == "radixserve":
            continue
        for wl in workloads:
            a, b = ours.get(wl.name), by_wl.get(wl.name)
            if a is None or b is None or not b.tok_s:
                continue
            decode = a.decode / b.decode if wl.clients == 1 else float("nan")
            rows.append([peer, wl.name, a.tok_s / b.tok_s, a.ttft(0.5) / b.ttft(0.5), decode])
    return rows


def summary(rounds: list[dict[str, dict[str, Result]]], workloads: list[Workload]) -> str:
    """The median of each ratio over the rounds, and every round's value (machines are noisy: a round runs every
    engine once, so each ratio compares engines measured minutes apart, not a session apart)."""
    per: dict[tuple[str, str], list[list[float]]] = {}
    for results in rounds:
        for peer, wl, *values in ratios(results, workloads):
            per.setdefault((peer, wl), []).append(values)
    rows = []
    for (peer, wl), values in per.items():
        cols = list(zip(*values, strict=True))
        rows.append([peer, wl, *(f"{statistics.median(c):.2f} ({' '.join(f'{v:.2f}' for v in c)})" for c in cols)])
    return format_table(["peer", "workload", "throughput x", "TTFT p50 ours/theirs", "decode x"], rows)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="built-in name or HF folder (radixserve, vLLM)")
    p.add_argument("--gguf", default="", help="GGUF for llama-server (default: the model's, in --gguf-type)")
    p.add_argument(
        "--gguf-type",
        default="bf16",
        choices=llama.PLAIN_TYPES,
        help="llama-server's weights when --gguf is not given: the model's GGUF dequantized to this, "
        "written once (bf16: the weights vLLM and radixserve's bfloat16 serve)",
    )
    p.add_argument("--engines", default="radixserve,vllm,llama-server")
    p.add_argument("--workloads", default="shared,distinct,multiturn,single", help=f"of {','.join(WORKLOADS)}")
    p.add_argument("--radixserve-args", default="", help="extra flags for `radixserve serve`")
    p.add_argument("--vllm-args", default="")
    p.add_argument("--llama-args", default="")
    p.add_argument("--rounds", type=int, default=1, help="run every engine this many times, alternating; medians")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    folder = resolve_model(args.model)
    tokenizer = load_tokenizer(folder)
    workloads = [WORKLOADS[w](tokenizer) for w in args.workloads.split(",")]
    rounds = []
    for i in range(args.rounds):
        if args.rounds > 1:
            print(f"round {i + 1} of {args.rounds}")
        results = bench_round(args, folder, workloads, tokenizer)
        rounds.append(results)
        print()
        print(report(results, workloads))
    if args.rounds > 1:
        print(f"\nmedians over {args.rounds} rounds (each round's value in brackets):")
        print(summary(rounds, workloads))


def bench_round(args: argparse.Namespace, folder: Path, workloads: list[Workload], tokenizer) -> dict:  # noqa: ANN001
    results: dict[str, dict[str, Result]] = {}
    for engine in args.engines.split(","):
        if engine == "radixserve":
            server = radixserve(args.model, args.radixserve_args)
        elif engine == "vllm":
            server = vllm(safetensors_folder(folder), args.vllm_args)
        elif engine == "llama-server":
            gguf = Path(args.gguf) if args.gguf else llama.plain_gguf(args.model, args.gguf_type)
            if gguf is None:
                print("llama-server: no GGUF of this model; pass --gguf", file=sys.stderr)
                continue
            server = llama_server(gguf, args.llama_args)
        else:
            raise SystemExit(f"unknown engine {engine!r}")
        try:
            results[engine] = bench_engine(engine, server, workloads, tokenizer)
        except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:  # report what the others measured
            print(f"{engine} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    return results


if __name__ == "__main__":
    main()
