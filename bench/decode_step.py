"""Decode-step time of the engine: B requests decoding together over contexts of about L tokens.

Two measurements, each the median over many steps:

* ``runner``: ``ModelRunner.run`` replays one decode ``BatchPlan`` (metadata, forward pass, logits, sampling).
  Replaying is exact repetition: the plan rewrites the same KV slots with the same values each time.
* ``engine``: ``EngineCore.step()`` while the B requests decode with ``ignore_eos`` (adds scheduling, applying
  the tokens, detokenizing); the contexts grow by one token per step.

``--baseline REF`` also loads the engine code of git revision REF (read with ``git archive`` into a temporary
folder and imported under another package name) and alternates the two implementations block by block in this
one process, so both see the same machine load; the table then gives the speedup over REF. Both step on one thread
that did not load the models, as the engine's loop thread does. ``--profile`` prints a torch.profiler breakdown
of runner replays (top ops by self CPU time).

    python -m bench.decode_step --lengths 1500,500,200 --baseline HEAD
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import io
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from bench.common import format_table, machine_summary, make_workload

REPO = Path(__file__).resolve().parent.parent
BASELINE_PKG = "runtime_baseline"


def import_baseline(ref: str) -> str:
    """Extract ``runtime/`` at git revision ``ref`` (read-only) into a temp folder as package ``BASELINE_PKG``,
    with its ``runtime`` imports renamed, and put that folder on ``sys.path``. Returns the package name."""
    tar = subprocess.run(["git", "-C", str(REPO), "archive", ref, "runtime"], check=True, capture_output=True).stdout
    root = Path(tempfile.mkdtemp(prefix="decode-step-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
        tf.extractall(root, filter="data")
    pkg = root / BASELINE_PKG
    (root / "runtime").rename(pkg)
    for f in pkg.rglob("*.py"):
        # Revisions before the radixserve.* namespace import ``runtime``, later ones ``radixserve.runtime``.
        text = re.sub(
            r"^(\s*)(from|import) (radixserve\.)?runtime\b", rf"\1\2 {BASELINE_PKG}", f.read_text(), flags=re.M
        )
        f.write_text(text)
    sys.path.insert(0, str(root))
    return BASELINE_PKG


# Every implementation steps on this one thread. Like the engine's loop thread it is not the thread that loaded the
# models, and it is the process's only OpenMP team (see ``runtime.threads.one_intra_op_thread``): a team per
# implementation would slow all of them.
STEP_THREAD = ThreadPoolExecutor(1, thread_name_prefix="step")


@dataclass
class Impl:
    """One implementation's engine, driven synchronously on ``STEP_THREAD`` (its own engine thread is stopped)."""

    name: str
    pkg: str
    core: Any = None
    tokenizer: Any = None
    reqs: list[Any] = field(default_factory=list)
    plan: Any = None
    runner_ms: list[float] = field(default_factory=list)
    engine_ms: list[float] = field(default_factory=list)

    def mod(self, name: str) -> ModuleType:
        return importlib.import_module(f"{self.pkg}.{name}")

    def load(self, args: argparse.Namespace, slots: int) -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # a baseline's loader may not do this itself
        try:
            engine = self._engine(args, slots)
        finally:
            torch.set_num_threads(threads)
        # Loading is all we want from Engine: stop its thread so the core is ours alone (its loop would
        # otherwise step our requests between measurements).
        engine.shutdown()
        self.core, self.tokenizer = engine.core, engine.tokenizer

    def _engine(self, args: argparse.Namespace, slots: int) -> Any:
        return self.mod("engine").Engine(
            model=args.model,
            device="cpu",
            dtype=args.dtype,
            quantization=args.quantization,
            max_total_tokens=slots,
            max_running_requests=max(64, args.batch),
        )

    def start(self, prompts: list[list[int]], max_new: int, warmup: int) -> None:
        """Prefill the prompts, then decode ``warmup`` steps (interleaving the decode slots as serving does)."""
        params_cls = self.mod("sampling_params").SamplingParams
        req_cls = self.mod("request").Req
        self.reqs = []
        for i, ids in enumerate(prompts):
            req = req_cls(f"{self.name}-{i}", list(ids), params_cls(max_new_tokens=max_new, temperature=0.0,
                                                                    ignore_eos=True))
            self.core.add(req)
            self.reqs.append(req)
        while not all(r.num_computed > 0 and r.total - r.num_computed == 1 for r in self.reqs):
            self.core.step()
        for _ in range(warmup):
            self.core.step()

    def time_engine(self, steps: int) -> None:
        for _ in range(steps):
            t = time.perf_counter()
            self.core.step()
            self.engine_ms.append((time.perf_counter() - t) * 1e3)

    def stop(self) -> None:
        """Abort the requests and empty the cache."""
        for req in self.reqs:
            if not req.finished:
                self.core.abort(req.rid)
        self.core.flush_cache()

    def make_plan(self) -> None:
        """One decode plan over every request; replaying it leaves the requests untouched but for its slots."""
        self.plan = self.core.scheduler.schedule()
        assert all(c.is_decode for c in self.plan.chunks) and len(self.plan.chunks) == len(self.reqs)

    def time_runner(self, steps: int) -> None:
        for _ in range(steps):
            t = time.perf_counter()
            self.core.runner.run(self.plan)
            self.runner_ms.append((time.perf_counter() - t) * 1e3)

    def tokens(self) -> list[list[int]]:
        return [list(r.output_ids) for r in self.reqs]

    def on_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the stepping thread."""
        return STEP_THREAD.submit(fn, *args).result()


def alternate(impls: list[Impl], fn: Callable[[Impl], None], rounds: int) -> None:
    """Run ``fn`` on each implementation in turn, ``rounds`` times, reversing the order every round."""
    for r in range(rounds):
        for impl in impls if r % 2 == 0 else impls[::-1]:
            fn(impl)


def profile(impl: Impl, steps: int, rows: int) -> str:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    impl.time_runner(2)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        impl.time_runner(steps)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def summarize(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=10) if len(values) >= 2 else [values[0]] * 9
    return statistics.median(values), q[0], q[-1]


def new_tokens(args: argparse.Namespace, length: int) -> int:
    """max_new_tokens per request: enough that none finishes while measured. Requests that finish their prefill
    early decode while the others still prefill (chunked), up to one step per prefill chunk."""
    prefill_steps = -(-args.batch * length // 2048) + 1
    return prefill_steps + args.warmup + args.rounds * args.engine_steps + 4


def run_length(impls: list[Impl], args: argparse.Namespace, length: int, max_new: int) -> list[list[Any]]:
    lo = max(1, int(length * (1 - args.spread)))
    work = make_workload(impls[0].tokenizer, args.batch, (lo, length), (1, 1), seed=args.seed)
    prompts = [w.prompt_ids for w in work]
    for impl in impls:
        impl.runner_ms, impl.engine_ms = [], []
        impl.on_thread(impl.start, prompts, max_new, args.warmup)
    alternate(impls, lambda i: i.on_thread(i.time_engine, args.engine_steps), args.rounds)
    same = all(impl.tokens() == impls[0].tokens() for impl in impls)
    for impl in impls:
        impl.on_thread(impl.make_plan)
        impl.on_thread(impl.time_runner, 2)  # warm-up of this exact shape
    alternate(impls, lambda i: i.on_thread(i.time_runner, args.runner_steps), args.rounds)
    if args.profile:
        print(f"\n# torch.profiler, {impls[0].name}, B={args.batch}, L={length}, {args.runner_steps} runner steps")
        print(impls[0].on_thread(profile, impls[0], args.runner_steps, args.profile_rows))
    rows = []
    base = {m: statistics.median(getattr(impls[-1], f"{m}_ms")) for m in ("runner", "engine")}
    for impl in impls:
        for mode in ("runner", "engine"):
            med, p10, p90 = summarize(getattr(impl, f"{mode}_ms"))
            speedup = f"{base[mode] / med:.2f}x" if len(impls) > 1 else "-"
            rows.append([length, mode, impl.name, med, p10, p90, args.batch * 1e3 / med, speedup])
    for impl in impls:  # free the pool for the next length
        impl.on_thread(impl.stop)
    if len(impls) > 1:
        rows.append([length, "tokens", "same greedy tokens" if same else "DIFFERENT greedy tokens", "", "", "", "",
                     ""])
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or auto (the engine's --dtype)")
    p.add_argument("--quantization", default="none", help="the engine's --quantization (none: plain weights)")
    p.add_argument("--batch", type=int, default=8, help="decoding rows per step")
    p.add_argument("--lengths", default="1500,200", help="comma-separated context lengths L")
    p.add_argument("--spread", type=float, default=0.2, help="prompt lengths are uniform in [L*(1-spread), L]")
    p.add_argument("--rounds", type=int, default=6, help="alternation rounds per measurement")
    p.add_argument("--runner-steps", type=int, default=5, help="runner replays per round")
    p.add_argument("--engine-steps", type=int, default=5, help="engine steps per round")
    p.add_argument("--warmup", type=int, default=4, help="decode steps before measuring")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave torch's default)")
    p.add_argument("--baseline", default=None, help="git revision to compare against, e.g. HEAD")
    p.add_argument("--profile", action="store_true", help="print a torch.profiler table of runner replays")
    p.add_argument("--profile-rows", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    max_new = new_tokens(args, max(lengths))
    slots = args.batch * (max(lengths) + max_new) + 64
    impls = [Impl("current", "radixserve.runtime")]
    if args.baseline:
        impls.append(Impl(f"baseline {args.baseline}", import_baseline(args.baseline)))
    for impl in impls:
        impl.load(args, slots)
    rows: list[list[Any]] = []
    for length in lengths:
        rows += run_length(impls, args, length, max_new)
    policy = os.environ.get("OMP_WAIT_POLICY", "unset")
    print(f"\n# decode step, B={args.batch}, {machine_summary()}, OMP_WAIT_POLICY {policy}")
    print(format_table(["L", "mode", "impl", "ms/step p50", "p10", "p90", "tok/s", "speedup"], rows))


if __name__ == "__main__":
    main()
