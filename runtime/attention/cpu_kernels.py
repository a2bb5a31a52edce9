"""Compiled CPU kernels of the reference attention backend, built once per machine and cached.

Decode attention over the KV pool is memory-bound: each step reads every decoding row's keys and values once.
The PyTorch formulation (``torch_ref``) has to gather the keys into a padded copy before one ``bmm`` can read them,
so it writes and re-reads them; ``csrc/decode_attention.cpp`` reads each key and value row in place, with AVX-512
where the CPU has it (SmolLM2-135M, 8 rows of ~500 tokens on the 2-core reference machine: ~270 -> ~150 us per
layer, about 10% of a decode step).

The extension is compiled with the C++ compiler that torch's extension builder finds, for this CPU
(``-march=native``), into ``<cache dir>/kernels/<key>``, where the key hashes the source, torch, Python and the CPU;
the first engine start on a machine pays the ~20 s build, later ones load it. A machine without a compiler, a failed
build, or a kernel that disagrees with PyTorch on a self-check keeps the PyTorch path (logged once), and
``RADIXSERVE_CPU_KERNELS=0`` turns the kernels off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from runtime import envs
from runtime.model_source import file_lock
from runtime.threads import one_intra_op_thread

logger = logging.getLogger("radixserve.kernels")

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.cpp"
# -fopenmp: at::parallel_for is inline OpenMP in torch's headers; without it the kernel runs on one thread.
CFLAGS = ["-O3", "-march=native", "-fopenmp"]

# (q [B, H, D], kv [2, Hkv, N, D], slots [B, W], lens [B], scale) -> (out [B, H, D], lse [B, H])
DecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], list[torch.Tensor]]


def applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model on ``device`` in ``dtype`` can use these kernels (float32 on CPU)."""
    return torch.device(device).type == "cpu" and dtype == torch.float32


def _cpu_signature() -> str:
    """What ``-march=native`` compiles for: the CPU model and its feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    # x86 names its features in "flags"; aarch64 in "Features", with the core in "CPU implementer" / "CPU part".
    keys = ("model name", "flags", "Features", "CPU implementer", "CPU part", "CPU architecture")
    lines = [ln for ln in text.splitlines() if ln.startswith(keys)]
    return "\n".join(sorted(set(lines)))


def _build_key(source: str) -> str:
    parts = (source, " ".join(CFLAGS), torch.__version__, sys.version, platform.machine(), _cpu_signature())
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def reference_decode_attention(
    q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel computes, in plain PyTorch, one row at a time (for the self-check and tests)."""
    b, h, d = q.shape
    n_kv = kv.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty(b, h, dtype=q.dtype)
    for i in range(b):
        idx = slots[i, : int(lens[i])]
        keys = kv[0][:, idx].repeat_interleave(h // n_kv, dim=0)  # [H, L, D]
        values = kv[1][:, idx].repeat_interleave(h // n_kv, dim=0)
        scores = torch.einsum("hd,hld->hl", q[i], keys) * scale
        lse[i] = torch.logsumexp(scores, dim=-1)
        out[i] = torch.einsum("hl,hld->hd", torch.softmax(scores, dim=-1), values)
    return out, lse


def _self_check(op: DecodeAttention) -> bool:
    """Run the kernel on random rows of several shapes against ``reference_decode_attention``."""
    gen = torch.Generator().manual_seed(0)
    for heads, kv_heads, dim in ((9, 3, 64), (8, 8, 128), (6, 2, 48)):
        kv = torch.randn(2, kv_heads, 97, dim, generator=gen)
        lens = torch.tensor([1, 17, 40, 33])
        slots = torch.stack([torch.randperm(97, generator=gen)[:40] for _ in range(4)])
        q = torch.randn(4, heads, dim, generator=gen)
        out, lse = op(q, kv, slots, lens, dim**-0.5)
        ref_out, ref_lse = reference_decode_attention(q, kv, slots, lens, dim**-0.5)
        if not (torch.allclose(out, ref_out, rtol=1e-4, atol=1e-5) and torch.allclose(lse, ref_lse, atol=1e-4)):
            return False
    return True


@functools.cache
def decode_attention_op() -> DecodeAttention | None:
    """The compiled decode-attention kernel, or ``None`` where it is off, cannot be built, or fails its check."""
    if not envs.cpu_kernels():
        return None
    try:
        from torch.utils import cpp_extension

        source = SOURCE.read_text()
        key = _build_key(source)
        build_dir = envs.cache_dir() / "kernels" / key
        build_dir.mkdir(parents=True, exist_ok=True)
        cached = any(build_dir.glob("*.so"))
        if not cached:
            logger.info("compiling the CPU decode-attention kernel (once per machine, ~20 s) into %s", build_dir)
        # torch's builder guards the folder with a ``lock`` file that a process killed mid-build leaves behind, and
        # every later build would wait for it forever. Under our own lock (released by the kernel if its holder
        # dies) no one else is building, so such a file is stale.
        with file_lock(build_dir.parent / f"{key}.lock", "the CPU attention kernel"):
            (build_dir / "lock").unlink(missing_ok=True)
            module = cpp_extension.load(
                name=f"radixserve_decode_attention_{key}",
                sources=[str(SOURCE)],
                extra_cflags=CFLAGS,
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                verbose=False,
            )
        op = module.decode_attention
        # On one thread: a multi-threaded op here would give the caller's thread an OpenMP team of its own, and
        # with more OpenMP threads than cores libgomp stops letting the engine thread's workers spin between ops
        # (see ``runtime.threads.one_intra_op_thread``).
        with one_intra_op_thread(), torch.inference_mode():
            ok = _self_check(op)
    except Exception as exc:  # noqa: BLE001 - no compiler, no headers, a failed build: PyTorch path
        logger.warning("CPU decode-attention kernel unavailable (%s: %s); using PyTorch ops", type(exc).__name__, exc)
        return None
    if not ok:
        logger.warning("CPU decode-attention kernel disagrees with PyTorch on this machine; using PyTorch ops")
        return None
    return op
