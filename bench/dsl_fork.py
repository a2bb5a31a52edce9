"""DSL fork benchmark: a fork-heavy program through the DSL vs. the same calls as independent requests.

The program: a system turn holding a ~1,000-token document, then ``s.fork(8)``; each branch asks its own question
and generates exactly ``--max-tokens`` tokens (EOS ignored, so every system generates the same number). Decode
steps cost the same in every system, so the longer the answers, the smaller the speed-up: the table shows it.

Systems (two in-process servers over HTTP on loopback, one with the cache and one without; the systems take
turns within each repetition so that outside load hits them alike):

  dsl/cache-on          the program through ``RuntimeEndpoint``: the fork sends the shared prefix once (a
                        prefill-only request), then the 8 branches run concurrently and hit the prefix cache;
  independent/cache-on  the 8 branch requests the DSL sent (recorded), replayed concurrently as independent
                        ``/generate`` calls on a server with the cache on (no prefill request first);
  independent/cache-off the same replay on a server started with ``disable_radix_cache=True`` (the baseline).

The cache is flushed before every measured run. The prefix-cache counters of ``/server_info`` show how many prompt
tokens each run computed: the DSL computes the shared document once.

Run from the repository root::

    python -m bench.dsl_fork                        # 8 branches, 1,000-token context, 8 and 16 output tokens
    python -m bench.dsl_fork --branches 4 --max-tokens 32 --reps 3
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from bench.common import CORPUS, format_table, machine_summary
from radixserve.lang import RuntimeEndpoint, assistant, function, gen, system, user
from radixserve.lang.backend.base import GenOutput
from radixserve.runtime.config import DEFAULT_MODEL
from radixserve.runtime.engine import Engine
from radixserve.server import ServerConfig, create_app
from radixserve.server.testing import ServerThread

QUESTIONS = (
    "Which empire is mentioned first?",
    "What does the recipe say about the oven temperature?",
    "What does the SQL query select?",
    "Who is waiting at the landing?",
    "What does a central bank do when prices rise?",
    "How high is Mount Everest?",
    "What does the word_counts function return?",
    "Why was the parcel delayed?",
    "What is plate tectonics about?",
    "What does the backup script do?",
    "Where did the violin family develop?",
    "How do honeybees communicate?",
)


@function
def fork_qa(s, document: str, questions: list[str], max_tokens: int) -> list[str]:
    s += system("Answer questions about this document.\n\n" + document)
    forks = s.fork(len(questions))
    for branch, question in zip(forks, questions):
        branch += user(question)
        branch += assistant(gen("answer", max_tokens=max_tokens, ignore_eos=True, temperature=0))
    return [branch["answer"] for branch in forks]


class RecordingEndpoint(RuntimeEndpoint):
    """A ``RuntimeEndpoint`` that remembers the generation calls it sent (prompt text and sampling)."""

    def __init__(self, base_url: str) -> None:
        super().__init__(base_url)
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def generate(self, prompt: str, sampling: dict[str, Any], **kwargs: Any) -> GenOutput:
        self.calls.append((prompt, dict(sampling)))
        return super().generate(prompt, sampling, **kwargs)


@dataclass
class Run:
    seconds: float
    prompt_tokens: int
    cached_tokens: int

    @property
    def computed(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@contextmanager
def serving(cache: bool) -> Iterator[RuntimeEndpoint]:
    engine = Engine(model=DEFAULT_MODEL, device="cpu", max_total_tokens=32768, disable_radix_cache=not cache)
    try:
        with ServerThread(create_app(engine, ServerConfig())) as srv:
            yield RuntimeEndpoint(srv.url)
    finally:
        engine.shutdown()


def measure(endpoint: RuntimeEndpoint, work: Callable[[], Any]) -> Run:
    """Flush the cache (waiting until the server is idle), run ``work``, and read the counters around it."""
    deadline = time.monotonic() + 60
    while True:
        info = endpoint.server_info()
        if info["num_running_requests"] + info["num_waiting_requests"] == 0:
            break
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not become idle")
        time.sleep(0.05)
    endpoint.flush_cache()
    before = endpoint.cache_stats()
    start = time.perf_counter()
    work()
    seconds = time.perf_counter() - start
    after = endpoint.cache_stats()
    return Run(
        seconds,
        int(after["prompt_tokens"] - before["prompt_tokens"]),
        int(after["cached_prompt_tokens"] - before["cached_prompt_tokens"]),
    )


def replay(endpoint: RuntimeEndpoint, calls: list[tuple[str, dict[str, Any]]]) -> None:
    """Send ``calls`` at once, as independent requests (one client thread each)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        list(pool.map(lambda call: endpoint.generate(call[0], call[1]), calls))


def make_document(endpoint: RuntimeEndpoint, tokens: int) -> str:
    """About ``tokens`` tokens of the built-in corpus, cut at a paragraph boundary or later."""
    text = ""
    for paragraph in CORPUS * 4:
        text += paragraph + "\n\n"
        if len(endpoint.tokenize([text])[0]) >= tokens:
            break
    ids = endpoint.tokenize([text])[0]
    while len(ids) > tokens:  # trim whole words from the end until it fits
        text = text.rsplit(" ", 1)[0]
        ids = endpoint.tokenize([text])[0]
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--branches", type=int, default=8)
    parser.add_argument("--context-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", default="8,16", help="output tokens per branch; a comma list sweeps them")
    parser.add_argument("--reps", type=int, default=3, help="measured runs per system (the median is reported)")
    args = parser.parse_args()
    if not 1 <= args.branches <= len(QUESTIONS):
        parser.error(f"--branches must be in [1, {len(QUESTIONS)}]")
    lengths = [int(x) for x in args.max_tokens.split(",")]
    logging.basicConfig(level=logging.WARNING)
    questions = list(QUESTIONS[: args.branches])

    runs: dict[tuple[int, str], list[Run]] = {}
    calls: dict[int, list[tuple[str, dict[str, Any]]]] = {}
    with serving(cache=True) as on, serving(cache=False) as off:
        document = make_document(on, args.context_tokens)
        recorder = RecordingEndpoint(on.base_url)
        fork_qa.run(backend=recorder, document="Warm-up.", questions=questions[:2], max_tokens=2)
        replay(off, [(p, {**s, "max_new_tokens": 2}) for p, s in recorder.calls])
        for n in lengths:
            kwargs = dict(document=document, questions=questions, max_tokens=n)
            recorder.calls.clear()
            fork_qa.run(backend=recorder, **kwargs)  # records the branch calls (and warms this length up)
            calls[n] = list(recorder.calls)
        # Systems take turns within each repetition, so load from outside the benchmark hits them alike.
        for _ in range(args.reps):
            for n in lengths:
                kwargs = dict(document=document, questions=questions, max_tokens=n)
                for name, endpoint, work in (
                    ("dsl/cache-on", on, lambda kw=kwargs: fork_qa.run(backend=on, **kw)),
                    ("independent/cache-on", on, lambda n=n: replay(on, calls[n])),
                    ("independent/cache-off", off, lambda n=n: replay(off, calls[n])),
                ):
                    runs.setdefault((n, name), []).append(measure(endpoint, work))
        head = fork_qa.run(backend=on, document=document, questions=questions[:1], max_tokens=1)
        shared_tokens = len(on.tokenize([head.text().split("<|im_start|>user")[0]])[0])

    rows = []
    for n in lengths:
        baseline = statistics.median(r.seconds for r in runs[n, "independent/cache-off"])
        for name in ("dsl/cache-on", "independent/cache-on", "independent/cache-off"):
            measured = runs[n, name]
            seconds = statistics.median(r.seconds for r in measured)
            last = measured[-1]
            rows.append([n, name, seconds, last.prompt_tokens, last.cached_tokens, last.computed, baseline / seconds])
    print(f"\n{machine_summary()}; model {DEFAULT_MODEL}")
    print(
        f"{args.branches} branches sharing a {shared_tokens}-token prefix (system turn with the document); median "
        f"of {args.reps} runs, cache flushed before each\n"
    )
    headers = ["output tokens", "system", "wall s", "prompt tokens", "cached tokens", "computed tokens", "speed-up"]
    print(format_table(headers, rows))
    dsl = runs[lengths[-1], "dsl/cache-on"][-1]
    extra = dsl.computed - shared_tokens
    print(
        f"\nDSL: the shared {shared_tokens}-token prefix was computed once; the {args.branches} branches computed "
        f"{extra} more prompt tokens in all ({extra / args.branches:.0f} each: their question turn). Speed-up is "
        "against independent/cache-off at the same output length."
    )


if __name__ == "__main__":
    main()
