"""Every environment variable radixserve reads, in one place, all with the ``RADIXSERVE_`` prefix.

Command-line flags take precedence; an environment variable only changes a default. Each flag ``--foo-bar``
of ``radixserve serve`` can also be set with ``RADIXSERVE_FOO_BAR``.
"""

from __future__ import annotations

import os
from pathlib import Path

PREFIX = "RADIXSERVE_"


def get(name: str, default: str | None = None) -> str | None:
    """The value of ``RADIXSERVE_<name>``, or ``default`` when unset or empty."""
    value = os.environ.get(PREFIX + name)
    return value if value else default


def get_bool(name: str, default: bool = False) -> bool:
    """``RADIXSERVE_<name>`` as a switch; a value that is not one is a ``ValueError`` naming the variable (a typo
    such as "flase" must not silently turn a default-on switch off)."""
    value = get(name)
    if value is None:
        return default
    word = value.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{PREFIX}{name}={value!r}: expected 1/0, true/false, yes/no or on/off")


def cache_dir() -> Path:
    """Where converted models and downloads are cached (``RADIXSERVE_CACHE_DIR``).

    Defaults to ``$XDG_CACHE_HOME/radixserve`` or ``~/.cache/radixserve``.
    """
    explicit = get("CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "radixserve"


def check_integrity() -> bool:
    """``RADIXSERVE_CHECK_INTEGRITY=1`` runs the KV accounting and radix-tree checks after every step.

    Slow; meant for tests and for debugging a suspected leak in production.
    """
    return get_bool("CHECK_INTEGRITY")


def onednn_linear() -> bool:
    """``RADIXSERVE_ONEDNN_LINEAR=0`` runs float32 CPU linear layers through ``F.linear`` (MKL) instead of oneDNN
    with prepacked weights (see ``runtime.models.linear``); the packed copies double the linear weights' memory."""
    return get_bool("ONEDNN_LINEAR", True)


def tune_threads() -> bool:
    """``RADIXSERVE_TUNE_THREADS=0`` runs every step on ``torch.get_num_threads()`` threads, instead of timing one
    thread against them for small (decode) steps (see ``runtime.threads``)."""
    return get_bool("TUNE_THREADS", True)


def decode_stack() -> bool:
    """``RADIXSERVE_DECODE_STACK=0`` runs decode steps layer by layer in Python instead of in one compiled call
    (``runtime.models.decode_stack``; the results are the same)."""
    return get_bool("DECODE_STACK", True)


def prefix_groups() -> bool:
    """``RADIXSERVE_PREFIX_GROUPS=0``: decode rows that share a cached prompt are attended row by row over their
    whole keys instead of together over the shared prefix (``runtime.attention.cpu_kernels.prefix_groups_op``)."""
    return get_bool("PREFIX_GROUPS", True)


def kv_huge_pages() -> bool:
    """``RADIXSERVE_KV_HUGE_PAGES=0`` allocates a CPU KV pool with ``torch.empty`` instead of on memory advised for
    transparent huge pages (``runtime.huge_pages``)."""
    return get_bool("KV_HUGE_PAGES", True)


def cpu_kernels() -> bool:
    """``RADIXSERVE_CPU_KERNELS=0`` keeps CPU attention on PyTorch ops instead of the compiled kernels of
    ``runtime.attention.cpu_kernels`` (built once per machine)."""
    return get_bool("CPU_KERNELS", True)


BF16_LAYOUTS = ("auto", "pairs", "onednn")


def bf16_layout() -> str:
    """``RADIXSERVE_BF16_LAYOUT=pairs|onednn`` serves bfloat16 linear weights packed in pairs of K for the AVX-512
    BF16 kernel, or packed for oneDNN, instead of the layout chosen for this CPU (``auto``; see
    ``runtime.models.bf16_layout``)."""
    value = (get("BF16_LAYOUT") or "auto").strip().lower()
    if value not in BF16_LAYOUTS:
        raise ValueError(f"RADIXSERVE_BF16_LAYOUT={value!r}: expected one of {', '.join(BF16_LAYOUTS)}")
    return value


def bf16_tiles_from_rows() -> int | None:
    """``RADIXSERVE_BF16_TILES_FROM_ROWS=N``: on a CPU with AMX, products of ``N`` rows or more over bfloat16 weights
    packed in pairs run on the tiles (below the unpacking row count), instead of from the row count measured on this
    CPU (``None``: unset; see ``runtime.models.bf16_layout``)."""
    return _rows("BF16_TILES_FROM_ROWS")


def bf16_unpack_from_rows() -> int | None:
    """``RADIXSERVE_BF16_UNPACK_FROM_ROWS=N``: products of ``N`` rows or more over bfloat16 weights packed in pairs
    unpack them for oneDNN's GEMM, instead of from the row count measured on this CPU (``None``: unset; see
    ``runtime.models.bf16_layout``)."""
    return _rows("BF16_UNPACK_FROM_ROWS")


def _rows(name: str) -> int | None:
    """``RADIXSERVE_<name>`` as a row count of at least 1 (``None``: unset)."""
    value = get(name)
    if value is None:
        return None
    try:
        rows = int(value)
    except ValueError:
        rows = 0
    if rows < 1:
        raise ValueError(f"RADIXSERVE_{name}={value!r}: expected a row count of at least 1")
    return rows
