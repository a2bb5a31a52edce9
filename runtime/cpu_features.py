"""What this CPU can do, read at run time (the machine an install runs on is not the one it was built on)."""

from __future__ import annotations

import functools
from pathlib import Path

# CPU features (Linux /proc/cpuinfo flag names) that give bfloat16 matrix products their own instructions.
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (empty where it does not)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def native_bf16() -> tuple[str, ...]:
    """The bfloat16 matrix features this CPU has (empty: bfloat16 products would be emulated in float32)."""
    flags = cpu_flags()
    return tuple(f for f in NATIVE_BF16_FLAGS if f in flags)
