"""Per-system results of ``bench/shared_prefix.py`` and the tables and target checks it prints."""

from __future__ import annotations

import os
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any

from bench.common import format_table
from bench.shared_prefix_workloads import Workload

REFERENCE_S = {("1", "llama.cpp"): 35.6, ("2", "llama.cpp"): 15.6, ("3", "llama.cpp"): 41.6, ("1", "hf"): 143.5}


@dataclass
class Record:
    """One request (one turn of one session), times from ``time.perf_counter``."""

    session: int
    turn: int
    prompt_len: int
    queued_at: float
    sent_at: float
    first_at: float
    done_at: float
    output_ids: list[int]
    cached: int | None = None  # prompt tokens served from the system's cache
    computed: int | None = None  # prompt tokens it computed (llama.cpp reports both)


@dataclass
class SystemRun:
    system: str
    wall_s: float
    records: list[Record]
    started_at: float
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # prompt tokens served from a cache; None when the system has no such count
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    load: float = field(default_factory=lambda: os.getloadavg()[0])  # 1-minute load average when it finished

    @property
    def output_tokens(self) -> int:
        return sum(len(r.output_ids) for r in self.records)

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def hit_rate(self) -> float | None:
        if self.cached_tokens is None or not self.prompt_tokens:
            return None
        return self.cached_tokens / self.prompt_tokens

    def ttft_sent(self) -> float:
        return statistics.median(r.first_at - r.sent_at for r in self.records)

    def ttft_queued(self) -> float:
        return statistics.median(r.first_at - r.queued_at for r in self.records)

    def outputs(self) -> list[list[int]]:
        return [r.output_ids for r in sorted(self.records, key=lambda r: (r.session, r.turn))]


def _check(system: str, rec: Record, want: int) -> None:
    if len(rec.output_ids) != want:
        raise RuntimeError(f"{system}: session {rec.session} turn {rec.turn} produced {len(rec.output_ids)} tokens")


def _log(wl: Workload, run: SystemRun) -> None:
    print(
        f"  ({wl.key}) {run.system}: {run.wall_s:.1f} s, {run.output_tps:.1f} output tok/s", file=sys.stderr, flush=True
    )


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def workload_table(wl: Workload, runs: list[SystemRun]) -> str:
    headers = [
        "system",
        "wall s",
        "output tok/s",
        "TTFT p50 s (sent)",
        "TTFT p50 s (queued)",
        "prompt hit rate",
        "load 1m",
        "notes",
    ]
    rows = [
        [r.system, r.wall_s, r.output_tps, r.ttft_sent(), r.ttft_queued(), _pct(r.hit_rate), f"{r.load:.1f}", r.note]
        for r in runs
    ]
    prompt = sum(r.prompt_len for r in runs[0].records) if runs else 0
    head = (
        f"({wl.key}) {wl.name}: {wl.description}; {wl.num_requests} requests, {prompt} prompt tokens, "
        f"{wl.num_requests * wl.output_len} output tokens"
    )
    return head + "\n" + format_table(headers, rows)


@dataclass
class Target:
    workload: str
    what: str
    value: float | None
    goal: str
    met: bool | None
    source: str = ""


def _wall(runs: dict[str, SystemRun], key: str, name: str, use_reference: bool) -> tuple[float | None, str]:
    if name in runs:
        return runs[name].wall_s, ""
    ref = REFERENCE_S.get((key, name.split("/")[0])) if use_reference else None
    return (ref, f"vs an earlier run's {ref} s, not this run") if ref is not None else (None, "")


def targets(results: dict[str, dict[str, SystemRun]], use_reference: bool) -> list[Target]:
    """The target ratios; a skipped peer is replaced by its earlier reference time when ``use_reference``."""
    out: list[Target] = []

    def speedup(key: str, what: str, other: str, goal: float) -> None:
        runs = results.get(key, {})
        on = runs.get("ours/cache-on")
        wall, source = _wall(runs, key, other, use_reference)
        value = wall / on.wall_s if on is not None and wall is not None else None
        out.append(Target(key, what, value, f">= {goal:g}x", None if value is None else value >= goal, source))

    if "1" in results:
        speedup("1", "cache-on vs cache-off speedup", "ours/cache-off", 4.0)
        on = results["1"].get("ours/cache-on")
        rate = on.hit_rate if on is not None else None
        out.append(Target("1", "prompt cache hit rate", rate, ">= 90%", None if rate is None else rate >= 0.9))
        speedup("1", "ours vs HF static speedup", "hf/static", 10.0)
        speedup("1", "ours vs llama.cpp speedup", "llama.cpp", 2.0)
    if "2" in results:
        speedup("2", "ours vs llama.cpp speedup", "llama.cpp", 2.0)
    if "3" in results:
        runs = results["3"]
        if "ours/cache-on" in runs and "ours/cache-off" in runs:
            diff = runs["ours/cache-on"].wall_s / runs["ours/cache-off"].wall_s - 1.0
            out.append(Target("3", "cache-on wall time vs cache-off", diff, "<= +5%", diff <= 0.05))
        else:
            out.append(Target("3", "cache-on wall time vs cache-off", None, "<= +5%", None))
    return out


def targets_table(items: list[Target]) -> str:
    rows = []
    for t in items:
        if t.value is None:
            shown = "n/a"
        elif "hit rate" in t.what:
            shown = _pct(t.value)
        elif t.goal.endswith("%"):
            shown = f"{100 * t.value:+.1f}%"
        else:
            shown = f"{t.value:.2f}x"
        met = "n/a" if t.met is None else ("yes" if t.met else "NO")
        rows.append([f"({t.workload})", t.what, shown, t.goal, met, t.source])
    return format_table(["workload", "ratio", "measured", "target", "met", "note"], rows)


def agreement(runs: dict[str, SystemRun], eos: set[int]) -> list[str]:
    """Requests whose greedy output equals ours (cache on), compared up to the first EOS in either."""
    ref = runs.get("ours/cache-on")
    if ref is None:
        return []
    mine = ref.outputs()
    lines = []
    for name, run in runs.items():
        if name == ref.system:
            continue
        same = 0
        theirs = run.outputs()
        for a, b in zip(mine, theirs):
            cut = next((i for i, t in enumerate(a) if t in eos), len(a))
            cut = min(cut, next((i for i, t in enumerate(b) if t in eos), len(b)))
            same += a[:cut] == b[:cut]
        lines.append(f"{name} {same}/{min(len(mine), len(theirs))}")
    return lines
