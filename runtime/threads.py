"""How many intra-op threads a small step runs with, chosen by timing the steps themselves.

A decode step of a small model is a chain of a few hundred short ops (0.05-0.5 ms each for SmolLM2-135M with 8
rows). Each op that runs on several OpenMP threads has to wake the other threads and wait for all of them. On a
quiet machine that pays (8 rows on 2 cores: 31 ms per step with 2 spinning threads, 49 ms on one). On a shared
machine it is a gamble: a worker thread that is not scheduled stalls every op, and with other jobs on the cores a
step took 130-350 ms on two threads against 129 ms on one (`OMP_WAIT_POLICY=PASSIVE`: 184-213 ms against 129 ms).
Neither setting wins everywhere, so ``StepThreads`` measures both.

Policy, per size class of step (tokens rounded up to a power of two, up to ``MAX_TUNED_TOKENS``; larger steps,
prefill chunks, always use every thread): try the configured thread count and one thread, then run the faster by
an exponential moving average of step time, and re-time the other one every ``PROBE_EVERY`` steps of that class
so that a change in the machine's load is noticed. A probe that loses by more than ``BACKOFF_RATIO`` backs off (the
next one comes twice as late, up to ``MAX_PROBE_EVERY``), so a setting that clearly loses is rarely retried: a
one-thread probe of a compute-bound step (a ~1B model's 16-row decode, ~1.9x slower on one of 2 cores) every 16
steps adds ~6% to decode time, which it did while only probes losing by more than 2x backed off.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import torch

T = TypeVar("T")

MAX_TUNED_TOKENS = 64
PROBE_EVERY = 16
MAX_PROBE_EVERY = 1024
EMA_WEIGHT = 0.25  # weight of the newest step time in the moving average
BACKOFF_RATIO = 1.25  # a probe this much slower than the best setting makes the next one come twice as late


@dataclass
class _Class:
    seconds: dict[int, float] = field(default_factory=dict)  # moving average of step time, per thread count
    steps: int = 0
    probe_every: int = PROBE_EVERY


class StepThreads:
    """Picks 1 or the configured number of intra-op threads (``torch.get_num_threads()`` outside steps) for each
    step; see the module docstring. Single-threaded: only the engine thread calls it."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._classes: dict[int, _Class] = {}

    @staticmethod
    def _class_of(num_tokens: int) -> int:
        return 1 << max(0, num_tokens - 1).bit_length()

    def choose(self, num_tokens: int, configured: int) -> tuple[int, bool]:
        """The thread count for the next step of ``num_tokens`` tokens, and whether it is a probe of the slower
        setting."""
        if not self.enabled or configured <= 1 or num_tokens > MAX_TUNED_TOKENS:
            return configured, False
        cls = self._classes.setdefault(self._class_of(num_tokens), _Class())
        for candidate in (configured, 1):
            if candidate not in cls.seconds:
                return candidate, False
        best, slower = sorted((configured, 1), key=lambda c: cls.seconds[c])
        cls.steps += 1
        return (slower, True) if cls.steps % cls.probe_every == 0 else (best, False)

    def record(self, num_tokens: int, threads: int, probe: bool, seconds: float) -> None:
        """Account a step chosen by ``choose`` that took ``seconds``."""
        cls = self._classes.get(self._class_of(num_tokens))
        if cls is None:
            return
        old = cls.seconds.get(threads)
        if probe:
            best = min(cls.seconds.values())
            # A setting that clearly loses is retried less and less often; a close or winning one often.
            lost = seconds > BACKOFF_RATIO * best
            cls.probe_every = min(MAX_PROBE_EVERY, cls.probe_every * 2) if lost else PROBE_EVERY
        # A probe counts double: its setting's average is stale, and it decides whether to switch back.
        weight = 2 * EMA_WEIGHT if probe else EMA_WEIGHT
        cls.seconds[threads] = seconds if old is None else old + weight * (seconds - old)

    @contextmanager
    def step(self, num_tokens: int) -> Iterator[int]:
        """Run the body with the chosen thread count, time it, and restore the configured count afterwards."""
        configured = torch.get_num_threads()
        threads, probe = self.choose(num_tokens, configured)
        if threads != configured:
            torch.set_num_threads(threads)
        start = time.perf_counter()
        try:
            yield threads
        finally:
            elapsed = time.perf_counter() - start
            if threads != configured:
                torch.set_num_threads(configured)
        self.record(num_tokens, threads, probe, elapsed)


@contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """Run the body on one intra-op thread (the loading costs a few tenths of a second more).

    Why: the engine runs the model on its own thread, and every thread that runs a multi-threaded op gets its own
    OpenMP team. Had loading done so on the caller's thread, the process would hold more OpenMP threads than cores,
    and then libgomp stops letting idle workers spin between ops: each op of a decode step pays for waking them
    (an 8-row SmolLM2-135M decode step on 2 cores: 33 ms with one team, 52 ms with two)."""
    threads = torch.get_num_threads()
    _outside.append(threads)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        _outside.pop()
        torch.set_num_threads(threads)


_outside: list[int] = []  # the thread counts that one_intra_op_thread bodies run inside of, outermost first


def serving_threads() -> int:
    """The intra-op thread count steps run with (outside ``one_intra_op_thread``, which loading runs inside)."""
    return _outside[0] if _outside else torch.get_num_threads()


def on_a_thread_of_its_own(fn: Callable[[], T], threads: int) -> T:
    """``fn()`` on a new thread running ops on ``threads`` intra-op threads, e.g. timing kernels as steps will run
    them while loading runs on one (``one_intra_op_thread``). Its OpenMP team ends with it (libgomp frees a thread's
    team when the thread exits), so the process keeps one team beside the engine's, as before."""
    done: list[T] = []
    failed: list[BaseException] = []
    before = torch.get_num_threads()

    def body() -> None:
        torch.set_num_threads(threads)
        try:
            done.append(fn())
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=body, name="radixserve-timing")
    thread.start()
    thread.join()
    torch.set_num_threads(before)  # (the count is process-wide in PyTorch; the caller's is back)
    if failed:
        raise failed[0]
    return done[0]
