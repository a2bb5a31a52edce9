"""Offline throughput: our ``Engine`` against HuggingFace ``generate`` on the same prompts, dtype and threads.

Three systems run in one process on one seeded workload (prompts cut from a built-in English/code corpus):

  (a) ``hf-single``   HuggingFace ``generate``, one request at a time;
  (b) ``hf-static``   HuggingFace ``generate`` on static, left-padded batches (``--hf-batch-size``); each
                      batch runs until its longest requested output, and only each request's own requested
                      tokens count as useful output -- the inherent cost of static batching;
  (c) ``radixserve``  our ``Engine``, all requests submitted at once (continuous batching, chunked prefill).

Every system decodes greedily and produces exactly each request's requested length (HF: ``min_new_tokens``
= ``max_new_tokens``; ours: ``ignore_eos=True``). Each system is warmed up once before it is timed.

Run from the repository root::

    python -m bench.throughput --dtypes float32,bfloat16
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.common import Request, format_table, hf_model, machine_summary, make_workload, parse_range, timer
from radixserve.runtime.config import DEFAULT_MODEL
from radixserve.runtime.engine import Engine
from radixserve.runtime.model_source import resolve_model
from radixserve.runtime.sampling_params import SamplingParams
from radixserve.runtime.weights import load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WARMUP_TEXT = "Benchmark warm-up: a short sentence that no measured prompt starts with."


@dataclass
class RunResult:
    """One system's timed run over (a prefix of) the workload."""

    system: str
    wall_s: float
    cpu_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int  # useful tokens only: what the requests asked for
    outputs: list[list[int]]
    note: str = ""
    load: float = field(default_factory=lambda: os.getloadavg()[0])  # 1-min load average when the run ended

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s


# --- HuggingFace --------------------------------------------------------------------------------------
def load_hf(folder: str, dtype: torch.dtype) -> Any:
    return hf_model(folder, dtype)


@torch.inference_mode()
def hf_generate(model: Any, batch: Sequence[Request], new_tokens: int, pad_id: int) -> torch.Tensor:
    """Greedy ``generate`` on a left-padded batch; returns only the generated ids ``[B, new_tokens]``."""
    width = max(len(r.prompt_ids) for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, r in enumerate(batch):
        ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
        mask[i, width - len(r.prompt_ids) :] = 1
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=pad_id,
    )
    return out[:, width:]


def run_hf_single(model: Any, reqs: Sequence[Request], pad_id: int) -> RunResult:
    outputs: list[list[int]] = []
    with timer() as t:
        for r in reqs:
            outputs.append(hf_generate(model, [r], r.output_len, pad_id)[0].tolist())
    return _result("(a) hf-single", t, reqs, outputs, "batch size 1")


def run_hf_static(model: Any, reqs: Sequence[Request], batch_size: int, pad_id: int) -> RunResult:
    outputs: list[list[int]] = []
    computed = 0
    with timer() as t:
        for i in range(0, len(reqs), batch_size):
            batch = reqs[i : i + batch_size]
            longest = max(r.output_len for r in batch)
            gen = hf_generate(model, batch, longest, pad_id)
            computed += longest * len(batch)
            outputs.extend(gen[j, : r.output_len].tolist() for j, r in enumerate(batch))
    useful = sum(r.output_len for r in reqs)
    note = f"batch {batch_size}, {computed} tokens decoded for {useful} useful ({useful / computed:.0%})"
    return _result("(b) hf-static", t, reqs, outputs, note)


# --- ours ---------------------------------------------------------------------------------------------
def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def build_engine(args: argparse.Namespace, dtype: str) -> Engine:
    engine = Engine(
        model=args.model,
        dtype=dtype,
        device="cpu",
        max_total_tokens=args.max_total_tokens,
        chunked_prefill_size=args.chunked_prefill_size,
        max_running_requests=args.max_running_requests,
    )
    warm = engine.tokenizer.encode(WARMUP_TEXT, add_special_tokens=False)
    engine.generate(input_ids=[warm, warm[:5]], sampling_params=[greedy(8), greedy(8)])
    engine.flush_cache()  # the measured run starts with an empty prefix cache
    return engine


def run_ours(engine: Engine, reqs: Sequence[Request]) -> RunResult:
    with timer() as t:
        results = engine.generate(
            input_ids=[r.prompt_ids for r in reqs], sampling_params=[greedy(r.output_len) for r in reqs]
        )
    assert isinstance(results, list)
    outputs = [res["output_ids"] for res in results]
    for res, r in zip(results, reqs, strict=True):
        if res["meta_info"]["error"] or len(res["output_ids"]) != r.output_len:
            raise RuntimeError(f"request failed or produced the wrong length: {res['meta_info']}")
    cached = sum(res["meta_info"]["cached_tokens"] for res in results)
    return _result("(c) radixserve", t, reqs, outputs, f"{cached} prompt tokens hit the prefix cache")


# --- reporting ----------------------------------------------------------------------------------------
def _result(
    system: str, times: list[float], reqs: Sequence[Request], outputs: list[list[int]], note: str
) -> RunResult:
    return RunResult(
        system=system,
        wall_s=times[0],
        cpu_s=times[1],
        num_requests=len(reqs),
        prompt_tokens=sum(len(r.prompt_ids) for r in reqs),
        output_tokens=sum(r.output_len for r in reqs),
        outputs=outputs,
        note=note,
    )


def agreement(ours: list[list[int]], ref: list[list[int]], eos: set[int]) -> tuple[int, int]:
    """Requests whose greedy output equals the reference, compared up to the first EOS we emitted.

    HF masks EOS under ``min_new_tokens``; with ``ignore_eos`` we may emit it and continue after it.
    """
    same = 0
    for mine, theirs in zip(ours, ref, strict=False):
        cut = next((i for i, t in enumerate(mine) if t in eos), len(mine))
        same += mine[:cut] == theirs[:cut]
    return same, min(len(ours), len(ref))


def _per_token_cpu(r: RunResult) -> float:
    return r.cpu_s / r.output_tokens


def report(dtype: str, results: list[RunResult]) -> str:
    ours = next(r for r in results if r.system.endswith("radixserve"))
    headers = [
        "system", "requests", "wall s", "cpu s", "output tok/s", "total tok/s", "ours speedup", "cpu-time speedup",
        "load", "notes",
    ]
    rows = [
        [r.system, r.num_requests, r.wall_s, r.cpu_s, r.output_tps, r.total_tps,
         f"{ours.output_tps / r.output_tps:.2f}x", f"{_per_token_cpu(r) / _per_token_cpu(ours):.2f}x", r.load,
         r.note]
        for r in results
    ]
    return f"dtype {dtype}\n" + format_table(headers, rows)


# --- main ---------------------------------------------------------------------------------------------
def run_dtype(args: argparse.Namespace, dtype: str, reqs: list[Request], folder: str, eos: set[int]) -> str:
    results: list[RunResult] = []
    if not args.skip_hf:
        model = load_hf(folder, DTYPES[dtype])
        pad_id = min(eos)
        hf_generate(model, [Request(reqs[0].prompt_ids[:16], 4)] * 2, 4, pad_id)  # warm-up
        if not args.skip_hf_single:
            single_reqs = reqs[: args.hf_single_requests] if args.hf_single_requests else reqs
            results.append(_log(run_hf_single(model, single_reqs, pad_id)))
        results.append(_log(run_hf_static(model, reqs, args.hf_batch_size, pad_id)))
        del model
        gc.collect()
    engine = build_engine(args, dtype)
    try:
        ours = _log(run_ours(engine, reqs))
    finally:
        engine.shutdown()
    results.append(ours)
    lines = [report(dtype, results)]
    for ref in results[:-1]:
        same, n = agreement(ours.outputs, ref.outputs, eos)
        lines.append(f"greedy agreement with {ref.system}: {same}/{n} requests identical up to our first EOS")
    return "\n".join(lines)


def _log(result: RunResult) -> RunResult:
    print(
        f"  {result.system}: {result.wall_s:.1f} s, {result.output_tps:.1f} output tok/s, load {result.load:.1f}",
        file=sys.stderr,
    )
    return result


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="local HF folder, .gguf file or built-in name")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="dtype of every system")
    p.add_argument("--dtypes", default="", help="comma-separated dtypes to run in turn; overrides --dtype")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=parse_range, default=(50, 600), help="uniform range LO-HI, in tokens")
    p.add_argument("--output-len", type=parse_range, default=(16, 128), help="uniform range LO-HI, in tokens")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--hf-batch-size", type=int, default=16, help="static batch size of (b)")
    p.add_argument("--skip-hf-single", action="store_true", help="skip (a), which is slow")
    p.add_argument("--hf-single-requests", type=int, default=0,
                   help="run (a) on only the first N requests (0: all); its tok/s still compare")
    p.add_argument("--skip-hf", action="store_true", help="run only our engine (for profiling)")
    p.add_argument("--max-total-tokens", type=int, default=65536, help="our KV pool size in tokens")
    p.add_argument("--chunked-prefill-size", type=int, default=2048, help="our prefill token budget per step")
    p.add_argument("--max-running-requests", type=int, default=64, help="our batch size cap")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads for every system")
    args = p.parse_args(argv)
    args.dtype_list = [d.strip() for d in args.dtypes.split(",") if d.strip()] or [args.dtype]
    bad = [d for d in args.dtype_list if d not in DTYPES]
    if bad:
        p.error(f"unknown dtype(s) {bad}; choose from {sorted(DTYPES)}")
    if args.num_requests < 1 or args.hf_batch_size < 1:
        p.error("--num-requests and --hf-batch-size must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    folder = str(resolve_model(args.model))
    tokenizer = load_tokenizer(folder)
    reqs = make_workload(tokenizer, args.num_requests, args.prompt_len, args.output_len, args.seed)
    eos = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else {0}
    print(
        f"{time.strftime('%Y-%m-%d')} | {machine_summary()} | model {args.model} | {len(reqs)} requests, "
        f"{sum(len(r.prompt_ids) for r in reqs)} prompt + {sum(r.output_len for r in reqs)} output tokens "
        f"(prompt {args.prompt_len[0]}-{args.prompt_len[1]}, output {args.output_len[0]}-"
        f"{args.output_len[1]}, seed {args.seed})",
        flush=True,
    )
    for dtype in args.dtype_list:
        print(f"running {dtype} ...", file=sys.stderr, flush=True)
        print("\n" + run_dtype(args, dtype, reqs, folder, eos), flush=True)


if __name__ == "__main__":
    main()
