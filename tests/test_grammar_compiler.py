"""The grammar compiler's pool with the real SmolLM2 tokenizer: timeouts, the slow lane, close, interpreter exit,
and the demotion of long compiles."""

from __future__ import annotations

import os
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest

from radixserve.constrained import ConstraintSpec, GrammarCompiler, GrammarError, TokenizerInfo
from radixserve.constrained.backend import LLGuidanceBackend
from tests.test_constrained import PERSON, encode


@pytest.fixture(scope="module")
def info() -> TokenizerInfo:
    from radixserve.runtime.model_source import resolve_model
    from radixserve.runtime.weights import load_tokenizer

    return TokenizerInfo.from_hf(load_tokenizer(resolve_model("smollm2-135m-instruct")))


class _StuckBackend:
    """A backend whose compile of the spec ``regex: stuck`` blocks until released (a compile that never ends)."""

    name = "stuck"

    def __init__(self, real: LLGuidanceBackend) -> None:
        self.real = real
        self.release = threading.Event()

    def compile(self, spec):
        if spec.value == "stuck":
            self.release.wait(30)
        return self.real.compile(spec)


def test_timeout_frees_the_caller_and_the_pool(info) -> None:
    backend = _StuckBackend(LLGuidanceBackend(info))
    compiler = GrammarCompiler(info, max_workers=1, timeout_s=0.3, backend=backend)
    try:
        start = time.monotonic()
        stuck: Future = compiler.submit(ConstraintSpec("regex", "stuck"))
        other = compiler.submit(ConstraintSpec("regex", "[a-z]+"))
        with pytest.raises(GrammarError, match="compile timeout after 0.3 s") as err:
            stuck.result(timeout=5)
        assert err.value.kind == "timeout" and time.monotonic() - start < 3
        assert other.result(timeout=5) is not None, "the slot is handed on at the deadline"
        assert compiler.info()["abandoned"] == 1
        again = compiler.submit(ConstraintSpec("regex", "stuck"))
        assert again.done() and again.exception().kind == "timeout", "timeouts are remembered for a while"
    finally:
        backend.release.set()
        compiler.close()


def test_expensive_grammars_move_to_the_slow_lane(info) -> None:
    """A new ordinary grammar does not wait behind a queue of expensive ones: they fail the screening on a tenth of
    the lexer budget and queue in the slow lane. Before, this schema waited for all 24 of them."""
    compiler = GrammarCompiler(info, timeout_s=30.0)
    try:
        # Python cannot parse \p{L}, so no static check stops these: ~120 ms each on the full budget.
        heavy = [compiler.submit(ConstraintSpec("regex", rf"{i}\p{{L}}(b{{{600 + i}}}){{600}}")) for i in range(24)]
        fresh = compiler.submit(ConstraintSpec("json_schema", {**PERSON, "title": "not cached yet"}))
        fresh.result(timeout=60)
        pending = sum(not f.done() for f in heavy)
        assert pending >= 12, f"only {pending} of 24 expensive compiles were still queued"
        for fut in heavy:
            assert isinstance(fut.exception(timeout=120), GrammarError)  # too complex for the full budget too
        # What the small budget cannot hold but the full one can is compiled in the slow lane, not refused.
        compiler.screen = True  # as if others queued behind it
        before = compiler.info()["slow_lane"]
        matcher = compiler.compile(ConstraintSpec("regex", r"\p{L}(b{200}){100}")).new_matcher()
        assert all(matcher.accept_token(t) for t in encode(info, "x" + "b" * 20000)) and matcher.can_terminate()
        assert compiler.info()["slow_lane"] == before + 1
        # Syntax errors are final at the screening: no slow-lane compile for them.
        with pytest.raises(GrammarError, match="invalid regex"):
            compiler.compile(ConstraintSpec("regex", "[0-9"))
        assert compiler.info()["slow_lane"] == before + 1
    finally:
        compiler.close()


def test_close_fails_a_job_the_screening_sends_to_the_slow_lane(info) -> None:
    """A job screened out after ``close`` emptied the queues was queued again, and its caller waited forever."""

    class Screening:
        name = "screening"

        def screen(self, spec):
            time.sleep(0.3)
            return False, ""

        def compile(self, spec):
            raise AssertionError("not reached")

    compiler = GrammarCompiler(info, max_workers=1, backend=Screening(), screen=True)
    future = compiler.submit(ConstraintSpec("regex", "a"))
    time.sleep(0.05)  # now being screened
    compiler.close()
    with pytest.raises(GrammarError, match="shut down"):
        future.result(timeout=10)


EXIT_DURING_COMPILES = """
from radixserve.constrained import ConstraintSpec, GrammarCompiler, GrammarError, TokenizerInfo
from radixserve.runtime.model_source import resolve_model
from radixserve.runtime.weights import load_tokenizer

info = TokenizerInfo.from_hf(load_tokenizer(resolve_model("smollm2-135m-instruct")))
compiler = GrammarCompiler(info, timeout_s=0.05)
# Python cannot parse \\p{L}, so these reach llguidance: ~120 ms each, abandoned at 50 ms.
futures = [compiler.submit(ConstraintSpec("regex", f"{i}\\p{{L}}(b{{{600 + i}}}){{600}}")) for i in range(4)]
for fut in futures:
    try:
        fut.result()
    except GrammarError as exc:
        assert exc.kind == "timeout", exc
print("exiting")
"""


def test_process_exits_cleanly_with_abandoned_compiles_running() -> None:
    """Abandoned compiles still inside llguidance at interpreter exit once killed the process (SIGSEGV / abort:
    a daemon thread re-taking the GIL during finalization); exit now waits for them."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-c", EXIT_DURING_COMPILES], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "exiting" in done.stdout, done.stderr[-2000:]


EXIT_WITH_A_QUEUE = """
import time
from radixserve.constrained import ConstraintSpec, GrammarCompiler, TokenizerInfo
from radixserve.runtime.model_source import resolve_model
from radixserve.runtime.weights import load_tokenizer

class Slow:
    name = "slow"

    def compile(self, spec):
        time.sleep(1.0)
        raise ValueError("never compiled")

compiler = GrammarCompiler(TokenizerInfo.from_hf(load_tokenizer(resolve_model("smollm2-135m-instruct"))),
                           max_workers=1, backend=Slow())
futures = [compiler.submit(ConstraintSpec("regex", f"x{i}")) for i in range(6)]
time.sleep(0.1)
print("exiting", time.time(), flush=True)
"""


def test_exit_waits_for_running_compiles_only() -> None:
    """Exit joins the compile threads, but queued compiles are not started any more: six queued 1 s compiles on
    one worker cost ~1 s at exit, not 6."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", EXIT_WITH_A_QUEUE], cwd=root, capture_output=True, text=True,
                          timeout=120)
    ended = time.time()
    assert done.returncode == 0, done.stderr[-2000:]
    printed = float(done.stdout.split()[-1])
    assert ended - printed < 3.5, f"exit took {ended - printed:.1f} s"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is a Linux feature")
def test_long_compiles_are_demoted(info) -> None:
    """A compile starts at normal priority; one still running after ``demote_after_s`` yields the CPU to decoding
    (its niceness is raised by ``nice`` and it moves to SCHED_IDLE, which any waking normal thread preempts)."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    normal = os.sched_getscheduler(0)
    seen: dict[str, list[tuple[int, int]]] = {}

    class Probe:
        name = "probe"

        def compile(self, spec):
            tid = threading.get_native_id()

            def priority() -> tuple[int, int]:
                return os.getpriority(os.PRIO_PROCESS, tid), os.sched_getscheduler(tid)

            seen[spec.value] = [priority()]
            if spec.value == "slow":
                time.sleep(0.5)
            seen[spec.value].append(priority())
            return LLGuidanceBackend(info).compile(spec)

    compiler = GrammarCompiler(info, backend=Probe(), nice=5, demote_after_s=0.1)
    try:
        compiler.compile(ConstraintSpec("regex", "fast"))
        compiler.compile(ConstraintSpec("regex", "slow"))
    finally:
        compiler.close()
    demoted = (min(19, base + 5), os.SCHED_IDLE)
    assert seen == {"fast": [(base, normal), (base, normal)], "slow": [(base, normal), demoted]}
