"""Giving freed host memory back to the operating system while a model loads (glibc's malloc; a no-op elsewhere).

Loading reads each checkpoint tensor into a buffer of its own, then keeps it, copies it into a merged projection,
cuts a tensor-parallel shard out of it or packs it for oneDNN, and frees what is left. glibc serves allocations
below its mmap threshold from the heap, and it raises that threshold (up to 32 MiB) each time a mapped block is
freed: after the first large tensor, a 1B model's 2-32 MiB tensors all come from the heap, and the holes the
freed ones leave stay resident. Measured on a ~1B bf16 checkpoint under ``--tp 2``: a rank's peak was 1.28x its
share of the weights with the default, 1.17x with every allocation of 1 MiB or more mapped on its own (freed =
returned at once). After loading, the thresholds are set where glibc's dynamic ones end up (32 MiB to map, 64 MiB
to trim), so a step's activations keep reusing heap memory, and the heap is trimmed once.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
from collections.abc import Iterator

logger = logging.getLogger("radixserve.model")

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
LOADING_MMAP_THRESHOLD = 1 << 20
# After loading: where glibc's dynamic thresholds end up (mmap 32 MiB, trim twice that). Setting one of them
# turns the dynamic adjustment of both off, so both are set: a trim threshold left at its 128 KiB start would give
# the heap back and fault it in again at every step.
SERVING_MMAP_THRESHOLD = 32 << 20
SERVING_TRIM_THRESHOLD = 64 << 20


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    if libc is None or not hasattr(libc, "mallopt") or not hasattr(libc, "malloc_trim"):
        return None  # not glibc (musl has neither)
    return libc


@contextlib.contextmanager
def returning_freed_memory() -> Iterator[None]:
    """Within: allocations of 1 MiB or more are mapped on their own, so freeing one returns it. After: the
    serving threshold, and one ``malloc_trim``."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, LOADING_MMAP_THRESHOLD)
    try:
        yield
    finally:
        if libc is not None:
            libc.mallopt(_M_MMAP_THRESHOLD, SERVING_MMAP_THRESHOLD)
            libc.mallopt(_M_TRIM_THRESHOLD, SERVING_TRIM_THRESHOLD)
            libc.malloc_trim(0)
