"""Choices between two ways of computing the same thing that this machine decides by timing them, once.

Which of two kernels is faster can depend on the CPU more than on anything the code can read from it (with AMX:
oneDNN's tile kernels or radixserve's own, ``runtime.models.bf16_layout``, ``runtime.attention.cpu_kernels``). Such
a choice is timed on the first start (``race``) and what was found is kept as a small JSON file beside the compiled
kernels (``once``), whose folder is per machine and kernel sources (``runtime.cpu_ext.build_dir``): later starts read
it, and a new CPU or new kernels measure again. Deleting the file measures again.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path

logger = logging.getLogger("radixserve.kernels")


def race(fns: Sequence[Callable[[], object]], rounds: int) -> list[float]:
    """Median milliseconds of each of ``fns`` over ``rounds`` runs, taken in turn (so that a slow moment of the
    machine falls on all of them), each run once before timing."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, out in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            out.append((time.perf_counter() - start) * 1e3)
    return [statistics.median(t) for t in times]


def _read(path: Path, keys: set[str]) -> dict | None:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) and keys <= found.keys() else None


def once(name: str, keys: set[str], measure: Callable[[], dict], what: str) -> dict:
    """What ``measure`` finds on this machine: the JSON file ``name`` beside the compiled kernels when it is there
    and has ``keys``, else measured now (logged as timing ``what``), on a thread of its own with the intra-op
    threads steps run with (``runtime.threads.on_a_thread_of_its_own``: the loader itself runs on one), and written
    there. Under a lock: processes starting together (tensor-parallel ranks) time one after another's result, not
    all at once on the same cores."""
    from radixserve.runtime.cpu_ext import build_dir
    from radixserve.runtime.model_source import file_lock
    from radixserve.runtime.threads import on_a_thread_of_its_own, serving_threads

    path = build_dir() / name
    found = _read(path, keys)
    if found is not None:
        return found
    with ExitStack() as held:
        try:
            held.enter_context(file_lock(path.with_name(f"{name}.lock"), what))
        except OSError as exc:  # a cache that cannot hold a lock file (read-only): time without it
            logger.warning("cannot lock %s (%s); timing without the lock", path.parent, exc)
        found = _read(path, keys)  # (timed by the process that held the lock)
        if found is not None:
            return found
        logger.info("timing %s on this CPU (once per machine)", what)
        found = on_a_thread_of_its_own(measure, serving_threads())  # as steps will run: on every intra-op thread
        try:
            tmp = path.with_name(f"{name}.{os.getpid()}")
            tmp.write_text(json.dumps(found, indent=1))
            tmp.replace(path)
        except OSError as exc:
            logger.warning("could not keep what was timed in %s (%s)", path, exc)
    return found
