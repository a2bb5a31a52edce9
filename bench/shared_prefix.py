"""Shared-prefix workloads: what the radix cache buys, against HuggingFace and llama.cpp on the same prompts.

Three seeded workloads of token-id prompts (the same ids go to every system), 32 greedy output tokens per
request, exactly (EOS is ignored):

  (1) ``shared``      64 chat requests that share one ~1,000-token system prompt with few-shot examples and
                      differ in a ~30-token question;
  (2) ``multiturn``   8 conversations of 4 turns, run concurrently; each turn resends the whole history (turn
                      t+1's prompt = turn t's prompt + its answer + a new user message);
  (3) ``distinct``    64 requests with no shared prefix (~300-token prompts).

Systems, each started fresh for each workload so that nothing is cached at the start:

  ours/cache-on   our ``Engine``, every request (or conversation) submitted at once, streamed with ``Engine.stream``;
  ours/cache-off  the same with ``disable_radix_cache=True``;
  hf/static-B     HuggingFace ``generate`` on static, left-padded batches of B requests (B from
                  ``--hf-batch-sizes``; the best B is reported; for (2) a batch is one turn of 8 conversations);
  llama.cpp       llama.cpp's server as a subprocess on an F32 GGUF of the same weights, with ``--llamacpp-parallel``
                  slots and as many concurrent clients over loopback (see bench/llamacpp_peer.py; optional).

Per workload and system: wall time, output throughput, median time to first token (TTFT) counted from when the
request was sent and from when it became available (all of (1)/(3) at the start, a conversation's next turn when
its previous answer arrived; the two differ only where requests wait on the client side: llama.cpp's clients,
HF's later batches), and the prompt-token cache hit rate (ours: ``server_info()["cache_stats"]``; llama.cpp: its
``cache_n`` timings). Then the ratios that the targets name.

Run from the repository root::

    python -m bench.shared_prefix                      # all workloads and systems
    python -m bench.shared_prefix --workloads 1,3 --skip-hf --skip-llamacpp
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import queue
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers.utils import logging as transformers_logging

from bench import llamacpp_peer as peer
from bench.common import hf_model, machine_summary
from bench.shared_prefix_report import (
    Record,
    SystemRun,
    _check,
    _log,
    agreement,
    targets,
    targets_table,
    workload_table,
)
from bench.shared_prefix_workloads import (
    BUILDERS,
    SHAPE_ARGS,
    Session,
    Workload,
)
from radixserve.runtime.config import DEFAULT_MODEL
from radixserve.runtime.engine import Engine
from radixserve.runtime.model_source import resolve_model
from radixserve.runtime.sampling_params import SamplingParams
from radixserve.runtime.weights import load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WARMUP_TEXT = "Benchmark warm-up: a short sentence that no measured prompt starts with."
# Earlier measurements on the 2-core reference machine, for ratios when a system is skipped (labelled as such).

# Flags that change the workloads; the reference times above hold only for their defaults.
# --- ours ---------------------------------------------------------------------------------------------
def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def build_engine(args: argparse.Namespace, cache: bool) -> Engine:
    engine = Engine(
        model=args.model,
        dtype=args.dtype,
        device="cpu",
        max_total_tokens=args.max_total_tokens,
        chunked_prefill_size=args.chunked_prefill_size,
        max_running_requests=args.max_running_requests,
        schedule_policy=args.schedule_policy,
        disable_radix_cache=not cache,
    )
    warm = engine.tokenizer.encode(WARMUP_TEXT, add_special_tokens=False)
    engine.generate(input_ids=[warm, warm[:5]], sampling_params=[greedy(8), greedy(8)])
    engine.flush_cache()  # the measured run starts with an empty prefix cache
    return engine


async def _ours_session(
    engine: Engine, idx: int, sess: Session, out_len: int, t0: float, records: list[Record]
) -> None:
    prompt: list[int] = []
    queued = t0
    for turn, piece in enumerate(sess.turns):
        prompt = prompt + list(piece)
        sent = time.perf_counter()
        first = 0.0
        ids: list[int] = []
        cached = 0
        async for out in engine.stream(prompt, greedy(out_len)):
            if out.token_ids and not first:
                first = time.perf_counter()
            ids.extend(out.token_ids)
            if out.finished:
                if out.error:
                    raise RuntimeError(f"ours: session {idx} turn {turn} failed: {out.error}")
                cached = out.cached_tokens
        done = time.perf_counter()
        records.append(Record(idx, turn, len(prompt), queued, sent, first, done, ids, cached))
        prompt += ids
        queued = done


async def _ours_all(engine: Engine, wl: Workload, records: list[Record]) -> float:
    t0 = time.perf_counter()
    await asyncio.gather(*(_ours_session(engine, i, s, wl.output_len, t0, records) for i, s in enumerate(wl.sessions)))
    return t0


def run_ours(args: argparse.Namespace, wl: Workload, cache: bool) -> SystemRun:
    engine = build_engine(args, cache)
    try:
        before = engine.server_info()["cache_stats"]
        records: list[Record] = []
        t0 = asyncio.run(_ours_all(engine, wl, records))
        wall = max(r.done_at for r in records) - t0
        info = engine.server_info()
    finally:
        engine.shutdown()
    after = info["cache_stats"]
    prompt = int(after["prompt_tokens"] - before["prompt_tokens"])
    cached = int(after["cached_prompt_tokens"] - before["cached_prompt_tokens"])
    name = "ours/cache-on" if cache else "ours/cache-off"
    for r in records:
        _check(name, r, wl.output_len)
    per_request = sum(r.cached or 0 for r in records)
    note = f"{int(after['forward_steps'] - before['forward_steps'])} steps"
    if after["retractions"]:
        note += f", {int(after['retractions'])} retractions"
    if per_request != cached:
        note += f", per-request cached_tokens sum {per_request}"
    return SystemRun(name, wall, records, t0, prompt, cached, note, {"kv": info["kv_cache"]})


# --- HuggingFace --------------------------------------------------------------------------------------
class _FirstStepTimer:
    """A logits processor that notes when the first set of logits (the end of prefill) is ready."""

    def __init__(self) -> None:
        self.at = 0.0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if not self.at:
            self.at = time.perf_counter()
        return scores


def load_hf(folder: str, dtype: torch.dtype) -> Any:
    return hf_model(folder, dtype)


@torch.inference_mode()
def hf_generate(
    model: Any, prompts: Sequence[Sequence[int]], new_tokens: int, pad_id: int
) -> tuple[list[list[int]], float]:
    """Greedy ``generate`` on a left-padded batch: the generated ids per prompt and when the first token was ready."""
    from transformers import LogitsProcessorList

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(list(p))
        mask[i, width - len(p) :] = 1
    first = _FirstStepTimer()
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=pad_id,
        logits_processor=LogitsProcessorList([first]),
    )
    return out[:, width:].tolist(), first.at


def run_hf_static(model: Any, wl: Workload, batch_size: int, pad_id: int) -> SystemRun:
    records: list[Record] = []
    t0 = time.perf_counter()
    for b in range(0, len(wl.sessions), batch_size):
        batch = wl.sessions[b : b + batch_size]
        prompts = [list(s.turns[0]) for s in batch]
        queued = [t0] * len(batch)
        for turn in range(max(len(s.turns) for s in batch)):
            if turn:
                prompts = [
                    p + r.output_ids + list(s.turns[turn]) for p, r, s in zip(prompts, records[-len(batch) :], batch)
                ]
            sent = time.perf_counter()
            outs, first = hf_generate(model, prompts, wl.output_len, pad_id)
            done = time.perf_counter()
            for j, (p, o) in enumerate(zip(prompts, outs)):
                records.append(Record(b + j, turn, len(p), queued[j], sent, first, done, o))
            queued = [done] * len(batch)
    wall = time.perf_counter() - t0
    return SystemRun(f"hf/static-{batch_size}", wall, records, t0, note=f"batch {batch_size}")


def run_hf_best(folder: str, args: argparse.Namespace, wl: Workload, pad_id: int) -> SystemRun:
    model = load_hf(folder, DTYPES[args.dtype])
    try:
        hf_generate(model, [list(wl.sessions[0].turns[0][:16])] * 2, 4, pad_id)  # warm-up
        runs = []
        for bs in args.hf_batch_sizes:
            bs = min(bs, len(wl.sessions))
            if any(r.extra.get("bs") == bs for r in runs):
                continue
            run = run_hf_static(model, wl, bs, pad_id)
            run.extra["bs"] = bs
            _log(wl, run)
            runs.append(run)
    finally:
        del model
        gc.collect()
    best = min(runs, key=lambda r: r.wall_s)
    if len(runs) > 1:
        best.note += " (best of " + ", ".join(f"{r.extra['bs']}: {r.wall_s:.1f} s" for r in runs) + ")"
    best.system = "hf/static"
    return best


def on_own_thread(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on a thread that ends with it. Each thread that runs multi-threaded torch ops gets an OpenMP
    team, which lives as long as the thread; with HF's team left behind on the main thread, the process would
    hold more OpenMP threads than cores, libgomp would stop letting idle workers spin, and every later engine
    here would run slower than it does alone (workload (2) after (1)'s HF run: 7.7 s instead of 6.9 s)."""
    result: list[Any] = []
    error: list[BaseException] = []

    def body() -> None:
        try:
            result.append(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            error.append(exc)

    thread = threading.Thread(target=body, name="hf-baseline")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


# --- llama.cpp ----------------------------------------------------------------------------------------
def run_llamacpp(
    kind: peer.ServerKind, gguf: Path, args: argparse.Namespace, wl: Workload, tokenizer: Any
) -> SystemRun:
    eos = int(tokenizer.eos_token_id)
    records: list[Record] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in range(len(wl.sessions)):
        todo.put(i)

    def session(port: int, idx: int, t0: float) -> None:
        prompt: list[int] = []
        queued = t0
        for turn, piece in enumerate(wl.sessions[idx].turns):
            prompt = prompt + list(piece)
            c = peer.complete(port, kind, args.llamacpp_api, prompt, wl.output_len, eos, tokenizer)
            rec = Record(
                idx, turn, len(prompt), queued, c.sent_at, c.first_at, c.done_at, c.token_ids,
                c.prompt_cached, c.prompt_computed,
            )  # fmt: skip
            with lock:
                records.append(rec)
            prompt += c.token_ids
            queued = c.done_at

    def client(port: int, t0: float) -> None:
        try:
            while True:
                try:
                    idx = todo.get_nowait()
                except queue.Empty:
                    return
                session(port, idx, t0)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)

    policy = None if args.llamacpp_omp_wait_policy == "unset" else args.llamacpp_omp_wait_policy
    server = peer.LlamaServer(
        kind, gguf, args.threads, args.llamacpp_parallel, args.llamacpp_ctx_per_slot, omp_wait_policy=policy
    )
    with server as srv:
        peer.complete(srv.port, kind, args.llamacpp_api, tokenizer.encode(WARMUP_TEXT), 4, eos, tokenizer)
        t0 = time.perf_counter()
        threads = [threading.Thread(target=client, args=(srv.port, t0)) for _ in range(args.llamacpp_clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    cached = [r.cached for r in records]
    computed = [r.computed for r in records]
    known = None not in cached and None not in computed
    note = f"{args.llamacpp_parallel} slots, {args.llamacpp_clients} clients" if kind.native else "1 slot (serial)"
    note += f", OMP_WAIT_POLICY {args.llamacpp_omp_wait_policy}"
    wrong = sum(len(r.output_ids) != wl.output_len for r in records)
    if wrong:
        note += f", {wrong} answers re-tokenized to != {wl.output_len} tokens"
    prompt = sum(r.prompt_len for r in records)
    return SystemRun(
        "llama.cpp",
        wall,
        records,
        t0,
        prompt,
        sum(c or 0 for c in cached) if known else None,
        note,
    )


# --- main ---------------------------------------------------------------------------------------------
def run_workload(
    args: argparse.Namespace, wl: Workload, folder: str, tokenizer: Any, llama: tuple[peer.ServerKind, Path] | None
) -> dict[str, SystemRun]:
    runs: dict[str, SystemRun] = {}

    def add(run: SystemRun) -> None:
        _log(wl, run)
        runs[run.system] = run

    add(run_ours(args, wl, cache=True))
    if not args.skip_cache_off:
        add(run_ours(args, wl, cache=False))
    if not args.skip_hf:
        runs["hf/static"] = on_own_thread(run_hf_best, folder, args, wl, int(tokenizer.eos_token_id))
    if llama is not None:
        add(run_llamacpp(llama[0], llama[1], args, wl, tokenizer))
    return runs


def prepare_llamacpp(args: argparse.Namespace) -> tuple[tuple[peer.ServerKind, Path] | None, str]:
    if args.skip_llamacpp:
        return None, "llama.cpp skipped (--skip-llamacpp)"
    kind, note = peer.find_server(args.llamacpp_server)
    if kind is None:
        return None, note
    gguf = Path(args.llamacpp_gguf) if args.llamacpp_gguf else peer.plain_gguf(args.model)
    if gguf is None:
        return None, f"llama.cpp skipped: no GGUF for {args.model}; pass --llamacpp-gguf"
    route = {"native": "/completion", "openai": "/v1/completions"}[args.llamacpp_api] if kind.native else "text prompts"
    return (kind, gguf), f"{note}, model {gguf.name}, {route}"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="local HF folder, .gguf file or built-in name")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="dtype of ours and HF")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads, and llama.cpp's --threads")
    p.add_argument("--workloads", default="1,2,3", help="comma-separated subset of 1,2,3")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--output-len", type=int, default=32, help="tokens generated per request (EOS ignored)")
    g = p.add_argument_group("workload shapes")
    g.add_argument("--num-requests", type=int, default=64, help="requests of (1) and (3)")
    g.add_argument("--system-tokens", type=int, default=1000, help="(1): shared chat head, in tokens")
    g.add_argument("--few-shot", type=int, default=3, help="(1): few-shot question/answer pairs in the head")
    g.add_argument("--question-tokens", type=int, default=30, help="(1): distinct question, in tokens")
    g.add_argument("--conversations", type=int, default=8, help="(2): concurrent conversations")
    g.add_argument("--turns", type=int, default=4, help="(2): turns per conversation")
    g.add_argument("--document-tokens", type=int, default=300, help="(2): document in the first message")
    g.add_argument("--follow-up-tokens", type=int, default=30, help="(2): later user messages, in tokens")
    g.add_argument("--distinct-tokens", type=int, default=300, help="(3): prompt length (+-10%%)")
    g = p.add_argument_group("systems")
    g.add_argument("--skip-cache-off", action="store_true", help="skip ours with disable_radix_cache=True")
    g.add_argument("--skip-hf", action="store_true", help="skip HuggingFace generate")
    g.add_argument("--skip-llamacpp", action="store_true", help="skip llama.cpp")
    g.add_argument("--max-total-tokens", type=int, default=65536, help="ours: KV pool size in tokens")
    g.add_argument("--chunked-prefill-size", type=int, default=2048, help="ours: prefill token budget per step")
    g.add_argument("--max-running-requests", type=int, default=64, help="ours: batch size cap")
    g.add_argument("--schedule-policy", default="lpm", choices=("lpm", "fcfs"), help="ours: admission order")
    g.add_argument("--hf-batch-sizes", default="16", help="comma-separated static batch sizes; the best counts")
    g.add_argument("--llamacpp-server", default=None, help="path of llama.cpp's llama-server binary")
    g.add_argument("--llamacpp-gguf", default=None, help="GGUF to serve (default: F32 GGUF made from --model)")
    g.add_argument("--llamacpp-parallel", type=int, default=8, help="llama-server --parallel (slots)")
    g.add_argument("--llamacpp-clients", type=int, default=8, help="concurrent client connections")
    g.add_argument("--llamacpp-ctx-per-slot", type=int, default=2048, help="context per slot (--ctx-size / slots)")
    g.add_argument(
        "--llamacpp-omp-wait-policy",
        default="passive",
        choices=("passive", "active", "unset"),
        help="OMP_WAIT_POLICY of the llama.cpp server: passive keeps its idle threads from spinning, which is "
        "several times faster on a shared, oversubscribed CPU; try unset on a quiet machine",
    )
    g.add_argument(
        "--llamacpp-api",
        default="native",
        choices=("native", "openai"),
        help="llama-server route: native /completion (streams token ids) or /v1/completions (text)",
    )
    args = p.parse_args(argv)
    args.default_shapes = all(getattr(args, k) == p.get_default(k) for k in SHAPE_ARGS)
    args.workload_keys = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not args.workload_keys or any(w not in BUILDERS for w in args.workload_keys):
        p.error("--workloads takes a comma-separated subset of 1,2,3")
    try:
        args.hf_batch_sizes = [int(b) for b in args.hf_batch_sizes.split(",") if b.strip()]
    except ValueError:
        p.error("--hf-batch-sizes takes comma-separated integers")
    if not args.hf_batch_sizes or min(args.hf_batch_sizes) < 1:
        p.error("--hf-batch-sizes needs at least one size >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    transformers_logging.set_verbosity_error()  # the corpus is tokenized in one piece, longer than the context
    folder = str(resolve_model(args.model))
    tokenizer = load_tokenizer(folder)
    llama, llama_note = prepare_llamacpp(args)
    print(
        f"{time.strftime('%Y-%m-%d')} | {machine_summary()} | model {args.model} | dtype {args.dtype} "
        f"(llama.cpp: F32 GGUF) | {args.output_len} greedy output tokens per request, seed {args.seed}\n"
        f"{llama_note}",
        flush=True,
    )
    eos = {int(tokenizer.eos_token_id)}
    results: dict[str, dict[str, SystemRun]] = {}
    for key in args.workload_keys:
        wl = BUILDERS[key](tokenizer, args)
        print(f"running ({key}) {wl.name} ...", file=sys.stderr, flush=True)
        runs = run_workload(args, wl, folder, tokenizer, llama)
        results[key] = runs
        print("\n" + workload_table(wl, list(runs.values())), flush=True)
        same = agreement(runs, eos)
        if same:
            print("greedy outputs identical to ours/cache-on (up to the first EOS): " + ", ".join(same), flush=True)
    print("\n" + targets_table(targets(results, args.default_shapes and args.seed == 0)), flush=True)


if __name__ == "__main__":
    main()
