"""Grammar compilation off the hot path: an LRU cache in front of a bounded worker pool with a per-compile timeout.

Why threads and how a stuck compile is contained: llguidance compiles in Rust with the GIL released, and it cannot
be interrupted. Its own limits (``LLParserLimits``: lexer fuel, grammar size, lexer states, Earley items) bound
the work of any one compilation, so no compile runs forever. On top of that, the timeout is enforced here without
waiting for the compile: at the deadline the caller's future fails with ``GrammarError(kind="timeout")`` and the
worker slot is handed to the next job at once; the abandoned compile finishes in the background and its result is
dropped. Running plus abandoned compiles never exceed ``max_workers + slow_workers + max_abandoned`` threads;
past that new jobs wait, so a flood of pathological schemas cannot spawn unbounded threads. A process pool would
make compiles killable, but a compiled llguidance grammar cannot cross a process boundary, so the work would be
done twice.
Each compile runs on a thread of its own; one still running ``demote_after_s`` (10 ms) after it started is demoted
(Linux): ``nice`` is added to its niceness and it moves to ``SCHED_IDLE``, so pathological and abandoned compiles
use only the CPU that decoding leaves; it keeps its worker slot (handing it on let more compiles start, each at
normal priority for its first 10 ms: a burst then slowed decoding by 18% instead of 3%). Ordinary compiles (a few
ms) stay at normal priority and fast under load.

Two lanes, so that a new ordinary grammar does not wait behind a queue of expensive ones: every job first runs in
the fast lane (``max_workers`` slots). When others queue behind it (``screen=None``, the default; True / False:
always / never), the backend's ``screen`` first tries it on a tenth of the lexer budget: ordinary grammars pass and
are compiled there and then (the screening doubles their compile time, which is why it waits for a queue), and one
that runs out of that budget (~15 ms for a pathological regex that takes ~120 ms in full) moves to the slow lane
(``slow_workers`` slots, its own queue) for a compile on the full budget. Before, 24 such regexes queued ahead of
an ordinary schema held it back until all of them were compiled.

Invariants:
  * one compile per key at a time: concurrent submits of the same spec share it (each gets its own future);
  * the cache holds compiled grammars and deterministic errors (invalid / unsupported: resubmitting fails fast);
    timeouts are remembered for ``error_ttl_s`` only, since a busy machine may be the cause;
  * at most ``max_workers`` fast-lane and ``slow_workers`` slow-lane compiles run; the timeout clock starts when a
    compile starts in a lane, not while it waits in a queue (the engine bounds queueing through its own request
    limits);
  * futures are completed outside the lock, so callbacks may call ``submit`` again.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import threading
import time
import weakref
from collections import OrderedDict, deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from radixserve.constrained.backend import CompiledGrammar, GrammarBackend, LLGuidanceBackend
from radixserve.constrained.spec import ConstraintSpec, GrammarError
from radixserve.constrained.tokenizer import TokenizerInfo

Delivery = tuple[list["Future[CompiledGrammar]"], CompiledGrammar | None, GrammarError | None]


@dataclass(eq=False)
class _Job:
    key: str
    spec: ConstraintSpec
    waiters: list[Future[CompiledGrammar]] = field(default_factory=list)
    deadline: float = 0.0
    timed_out: bool = False
    demote_at: float = 0.0
    tid: int | None = None  # the native id of the thread compiling it, once it runs
    demoted: bool = False
    slow: bool = False  # failed the backend's screening: compiled in the slow lane
    screen: bool = False  # screen it before compiling (decided when it starts in the fast lane)
    grammar: str = ""  # the backend's grammar text, once the screening built it


@dataclass
class CompilerStats:
    hits: int = 0
    misses: int = 0
    compiled: int = 0
    errors: int = 0
    timeouts: int = 0
    slow_lane: int = 0  # jobs the screening sent to the slow lane
    compile_seconds: float = 0.0


class GrammarCompiler:
    """Compiles ``ConstraintSpec``s for one tokenizer; ``submit`` never blocks on a compilation."""

    def __init__(
        self,
        tokenizer_info: TokenizerInfo,
        max_workers: int = 2,
        cache_size: int = 256,
        timeout_s: float = 10.0,
        *,
        backend: GrammarBackend | None = None,
        max_abandoned: int | None = None,
        error_ttl_s: float = 60.0,
        nice: int = 0,
        demote_after_s: float = 0.01,
        slow_workers: int = 1,
        screen: bool | None = None,
    ) -> None:
        if max_workers < 1 or slow_workers < 1 or cache_size < 1 or timeout_s <= 0:
            raise ValueError("max_workers, slow_workers and cache_size must be >= 1 and timeout_s > 0")
        self.backend: GrammarBackend = backend or LLGuidanceBackend(tokenizer_info)
        self.max_workers = max_workers
        self.slow_workers = slow_workers
        self.screen = screen
        self.cache_size = cache_size
        self.timeout_s = timeout_s
        self.max_abandoned = max_workers if max_abandoned is None else max_abandoned
        self.error_ttl_s = error_ttl_s
        self.stats = CompilerStats()
        self._cache: OrderedDict[str, tuple[CompiledGrammar | GrammarError, float]] = OrderedDict()
        self._inflight: dict[str, _Job] = {}
        self._queue: deque[_Job] = deque()
        self._slow_queue: deque[_Job] = deque()
        self._running: set[_Job] = set()
        self._abandoned = 0
        self._closed = False
        self._cond = threading.Condition()
        self.nice = nice
        self.demote_after_s = demote_after_s
        self._scheduler = threading.Thread(target=self._schedule, name="grammar-scheduler", daemon=True)
        self._scheduler.start()
        # Interpreter exit joins the (non-daemon) compile threads; stop starting queued jobs first, so that exit
        # waits only for the running and abandoned compiles, not for the whole queue. (The stdlib's hook that runs
        # before that join; concurrent.futures uses it too.)
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            ref = weakref.ref(self)
            with contextlib.suppress(RuntimeError):  # registering while the interpreter is already exiting
                register(lambda: (compiler := ref()) is not None and compiler.close())

    # ------------------------------------------------------------------ public
    def submit(self, spec: ConstraintSpec) -> Future[CompiledGrammar]:
        """A future for the compiled grammar: already done on a cache hit, else completed by a worker.

        The future fails with ``GrammarError`` for an invalid or unsupported spec, or a compile timeout.
        """
        fut: Future[CompiledGrammar] = Future()
        try:
            spec.validate()
        except GrammarError as exc:
            fut.set_exception(exc)
            return fut
        key = hashlib.sha256(spec.key.encode("utf-8")).hexdigest()
        with self._cond:
            if self._closed:
                raise RuntimeError("GrammarCompiler is closed")
            hit = self._lookup(key)
            if hit is not None:
                self.stats.hits += 1
            else:
                self.stats.misses += 1
                job = self._inflight.get(key)
                if job is None:
                    job = self._inflight[key] = _Job(key, spec)
                    self._queue.append(job)
                    self._cond.notify_all()
                job.waiters.append(fut)
                return fut
        if isinstance(hit, GrammarError):
            fut.set_exception(hit)
        else:
            fut.set_result(hit)
        return fut

    def compile(self, spec: ConstraintSpec) -> CompiledGrammar:
        """Blocking convenience: ``submit(spec).result()`` (raises ``GrammarError``)."""
        return self.submit(spec).result()

    def info(self) -> dict[str, Any]:
        """Counters and queue depths, for metrics and /server_info."""
        with self._cond:
            return {
                **vars(self.stats),
                "cached": len(self._cache),
                "queued": len(self._queue) + len(self._slow_queue),
                "running": len(self._running),
                "abandoned": self._abandoned,
            }

    def close(self) -> None:
        """Stop the scheduler; queued jobs fail, running ones are left to finish."""
        with self._cond:
            self._closed = True
            queued = [w for job in (*self._queue, *self._slow_queue) for w in job.waiters]
            self._queue.clear()
            self._slow_queue.clear()
            self._cond.notify_all()
        _deliver([(queued, None, GrammarError("the grammar compiler was shut down", kind="internal"))])

    # ---------------------------------------------------------------- internal
    def _lookup(self, key: str) -> CompiledGrammar | GrammarError | None:
        entry = self._cache.get(key)
        if entry is None:
            return None
        value, expires = entry
        if expires and time.monotonic() >= expires:
            del self._cache[key]
            return None
        self._cache.move_to_end(key)
        return value

    def _store(self, key: str, value: CompiledGrammar | GrammarError, ttl: float = 0.0) -> None:
        self._cache[key] = (value, time.monotonic() + ttl if ttl else 0.0)
        self._cache.move_to_end(key)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    def _schedule(self) -> None:
        while True:
            deliveries: list[Delivery] = []
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                for job in [j for j in self._running if j.deadline <= now]:
                    deliveries.append(self._expire(job))
                # Running + abandoned never exceed the pool.
                threads = self.max_workers + self.slow_workers + self.max_abandoned
                for queue, slow, limit in ((self._queue, False, self.max_workers),
                                           (self._slow_queue, True, self.slow_workers)):
                    running = sum(1 for j in self._running if j.slow == slow)
                    while queue and running < limit and self._busy_threads() < threads:
                        job = queue.popleft()
                        job.screen = not slow and (self.screen if self.screen is not None else bool(queue))
                        running += self._start(job, now)
                for job in self._running:
                    if not job.demoted and job.tid is not None and job.demote_at <= now:
                        job.demoted = True
                        _lower_priority(job.tid, self.nice)
                if not deliveries:
                    pending = [j.demote_at for j in self._running if not j.demoted]
                    nearest = min([j.deadline for j in self._running] + pending, default=None)
                    self._cond.wait(None if nearest is None else max(0.0, nearest - now))
            _deliver(deliveries)

    def _start(self, job: _Job, now: float) -> bool:
        if all(w.cancelled() for w in job.waiters):
            del self._inflight[job.key]
            return False
        job.deadline = now + self.timeout_s
        job.demote_at = now + self.demote_after_s
        job.tid, job.demoted = None, False
        self._running.add(job)
        # A thread per compile: once reniced, a thread cannot get its priority back (unprivileged). Not a daemon (a
        # thread inherits its creator's flag, and this scheduler is one), so that interpreter exit waits for it
        # (llguidance's limits bound every compile) instead of tearing Python down under native code that still
        # runs, which crashed the process at exit.
        threading.Thread(target=self._run, args=(job,), name="grammar-compile", daemon=False).start()
        return True

    def _busy_threads(self) -> int:
        return len(self._running) + self._abandoned

    def _expire(self, job: _Job) -> Delivery:
        job.timed_out = True
        self._running.discard(job)
        self._inflight.pop(job.key, None)
        self._abandoned += 1
        self.stats.timeouts += 1
        error = GrammarError(f"compile timeout after {self.timeout_s:g} s", kind="timeout")
        self._store(job.key, error, ttl=self.error_ttl_s)
        return job.waiters, None, error

    def _run(self, job: _Job) -> None:
        job.tid = threading.get_native_id()
        start = time.monotonic()
        result: CompiledGrammar | None = None
        error: GrammarError | None = None
        screen = getattr(self.backend, "screen", None) if job.screen else None
        to_slow_lane = False
        try:
            passed = True
            if screen is not None:
                passed, job.grammar = screen(job.spec)
            if not passed:
                to_slow_lane = True
            elif job.grammar:  # built by the screening (here or in the fast lane): a backend that screens takes it
                result = self.backend.compile(job.spec, grammar=job.grammar)  # type: ignore[call-arg]
            else:
                result = self.backend.compile(job.spec)
        except GrammarError as exc:
            error = exc
        except Exception as exc:  # a backend bug must fail the request, not the scheduler
            error = GrammarError(f"internal error while compiling: {type(exc).__name__}: {exc}", kind="internal")
        with self._cond:
            self.stats.compile_seconds += time.monotonic() - start
            if job.timed_out:
                self._abandoned -= 1
                self._cond.notify_all()
                return
            self._running.discard(job)
            if to_slow_lane and self._closed:  # ``close`` already failed the queues: fail it the same way
                error, to_slow_lane = GrammarError("the grammar compiler was shut down", kind="internal"), False
            if to_slow_lane:  # waiters stay attached; its timeout restarts when the slow lane starts it
                job.slow = True
                self.stats.slow_lane += 1
                self._slow_queue.append(job)
                self._cond.notify_all()
                return
            self._inflight.pop(job.key, None)
            if error is None:
                self.stats.compiled += 1
                self._store(job.key, result)
            else:
                self.stats.errors += 1
                if error.kind in ("invalid", "unsupported", "too_complex"):
                    self._store(job.key, error)
            self._cond.notify_all()
        _deliver([(job.waiters, result, error)])


def _lower_priority(tid: int, nice: int) -> None:
    """Raise thread ``tid``'s niceness by ``nice`` and move it to ``SCHED_IDLE`` (Linux, where a thread id is a
    valid target).

    A compile that has run ``demote_after_s`` is likely pathological: from then on it runs on the CPU time that
    decoding leaves, so a burst of expensive (or abandoned) compiles cannot slow the requests being served, while
    ordinary compiles (a few ms) keep the normal priority and stay fast under load. Niceness alone is not enough:
    a decode step wakes its OpenMP worker for every op, and a woken normal thread may wait out the running niced
    thread's time slice (a burst of 33 ~120 ms compiles slowed 16 decoding requests by 30%); a ``SCHED_IDLE``
    thread is preempted at once by any normal thread that wakes.
    """
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    # The caller holds the compiler's lock and the job is still running, so ``tid`` is alive and still that thread.
    with contextlib.suppress(OSError):  # a sandbox that forbids it: compiles keep the normal priority
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    with contextlib.suppress(OSError, AttributeError):  # no SCHED_IDLE here: the niceness stays
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))


def _deliver(deliveries: list[Delivery]) -> None:
    for waiters, result, error in deliveries:
        for fut in waiters:
            try:
                if error is not None:
                    fut.set_exception(error)
                else:
                    fut.set_result(result)
            except InvalidStateError:  # the caller cancelled it
                pass
