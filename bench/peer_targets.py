"""Every target radixserve holds itself to against its peers, measured in one command, with a verdict per target.

The targets (bfloat16 weights on every side; ratios are radixserve's over the peer's, medians over the rounds):

* shared system prompt and multi-turn: >= 1.5x vLLM-CPU's throughput, TTFT p50 no worse than vLLM's;
* distinct prompts: >= 1.2x vLLM-CPU's throughput;
* one user: decode tok/s >= vLLM-CPU's and >= 0.8x llama-server's (on the model's GGUF in BF16);
* a ~1B Llama shape (random bfloat16 weights, written once by ``bench.real_models``), shared system prompt:
  >= 1.3x vLLM-CPU's throughput;
* a cached start to the first 200 from ``/health`` in <= 3 s.

    python -m bench.peer_targets                       # 2 rounds of each comparison, ~20 minutes on 2 cores
    python -m bench.peer_targets --rounds 3 --skip-1b

Each comparison is ``bench.peers`` (every engine started fresh, one busy at a time, alternating each round) and
``bench.startup``; their own output is printed as it comes, the verdicts at the end.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench import peers, real_models
from bench.common import format_table
from bench.peer_workloads import WORKLOADS
from bench.startup import radixserve_argv, start_times
from radixserve.runtime.model_source import resolve_model
from radixserve.runtime.weights import load_tokenizer


@dataclass(frozen=True)
class Target:
    what: str
    peer: str
    workload: str  # a key of WORKLOADS
    column: int  # in a ``peers.ratios`` row: 2 throughput, 3 TTFT p50 ours / theirs, 4 one-user decode
    bound: float
    at_least: bool  # the ratio must be >= bound (else <= bound)

    def met(self, value: float) -> bool:
        return value >= self.bound if self.at_least else value <= self.bound

    def goal(self) -> str:
        return f"{'>=' if self.at_least else '<='} {self.bound:g}x"


BATCHED = (
    Target("shared system prompt, throughput", "vllm", "shared", 2, 1.5, True),
    Target("shared system prompt, TTFT p50 ours / theirs", "vllm", "shared", 3, 1.0, False),
    Target("multi-turn, throughput", "vllm", "multiturn", 2, 1.5, True),
    Target("multi-turn, TTFT p50 ours / theirs", "vllm", "multiturn", 3, 1.0, False),
    Target("distinct prompts, throughput", "vllm", "distinct", 2, 1.2, True),
)
ONE_USER = (
    Target("one user, decode", "vllm", "single", 4, 1.0, True),
    Target("one user, decode", "llama-server", "single", 4, 0.8, True),
)
BIG_SHARED = (Target("~1B Llama, shared system prompt, throughput", "vllm", "shared", 2, 1.3, True),)
START_S = 3.0


def compare(
    model: str, engines: str, targets: Sequence[Target], rounds: int, radixserve_args: str, vllm_args: str
) -> list[list]:
    """Run ``bench.peers`` ``rounds`` times over the targets' workloads; a verdict row per target."""
    workload_keys = list(dict.fromkeys(t.workload for t in targets))
    argv = ["--model", model, "--engines", engines, "--workloads", ",".join(workload_keys),
            "--radixserve-args", radixserve_args, "--vllm-args", vllm_args]  # fmt: skip
    pargs = peers.parse_args(argv)
    folder = resolve_model(model)
    tokenizer = load_tokenizer(folder)
    workloads = [WORKLOADS[k](tokenizer) for k in workload_keys]
    names = dict(zip(workload_keys, (w.name for w in workloads), strict=True))
    per_round: list[dict[tuple[str, str], list]] = []
    for i in range(rounds):
        print(f"\n## {model}: {engines}, round {i + 1} of {rounds}", flush=True)
        results = peers.bench_round(pargs, folder, workloads, tokenizer)
        print(peers.report(results, workloads), flush=True)
        per_round.append({(row[0], row[1]): row for row in peers.ratios(results, workloads)})
    rows = []
    for t in targets:
        values = [r[(t.peer, names[t.workload])][t.column] for r in per_round if (t.peer, names[t.workload]) in r]
        rows.append(verdict(f"{t.what} vs {t.peer}", t.goal(), values, t.met))
    return rows


def verdict(what: str, goal: str, values: list[float], met: Callable[[float], bool]) -> list:
    if not values:
        return [what, goal, "not measured", "", "OPEN"]
    median = statistics.median(values)
    return [what, goal, f"{median:.2f}", " ".join(f"{v:.2f}" for v in values), "met" if met(median) else "NOT MET"]


def cached_start(runs: int) -> list:
    """``bench.startup``'s measure of radixserve as a user starts it (no flags), ``runs`` times."""
    model = "smollm2-135m-instruct"
    resolve_model(model)  # converted once, before anything is timed
    times = start_times({"radixserve": radixserve_argv(model)}, runs)["radixserve"]
    return verdict("cached start to ready, s", f"<= {START_S:g} s", times, lambda s: s <= START_S)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2, help="rounds of each comparison on SmolLM2 (medians)")
    p.add_argument("--rounds-1b", type=int, default=None, help="rounds on the ~1B shape (default: --rounds)")
    p.add_argument("--start-runs", type=int, default=7)
    p.add_argument("--skip-1b", action="store_true", help="leave out the ~1B shape (~4 minutes a round)")
    p.add_argument("--radixserve-args", default="--quantization none",
                   help="flags for `radixserve serve` (default: the GGUF's weights dequantized to bfloat16, as the "
                   "peers serve them)")  # fmt: skip
    p.add_argument("--vllm-args", default="")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    model = "smollm2-135m-instruct"
    rows = compare(model, "radixserve,vllm", BATCHED, args.rounds, args.radixserve_args, args.vllm_args)
    rows += compare(model, "radixserve,vllm,llama-server", ONE_USER, args.rounds, args.radixserve_args, args.vllm_args)
    if not args.skip_1b:
        # bfloat16 safetensors, which radixserve serves as they are (no GGUF to dequantize: no flags)
        big = str(real_models.write_model("1b"))
        rows += compare(big, "radixserve,vllm", BIG_SHARED, args.rounds_1b or args.rounds, "", args.vllm_args)
    rows.append(cached_start(args.start_runs))
    print("\n# targets against the peers (radixserve / peer, medians over the rounds)")
    print(format_table(["target", "goal", "median", "each round", "verdict"], rows))


if __name__ == "__main__":
    main()
