"""Building the small C++ CPU kernels (``csrc/*.cpp`` next to their Python wrappers) once per machine.

The sources are compiled together, with the C++ compiler that torch's extension builder finds, for this CPU
(``-march=native``), into ``<cache dir>/kernels/<key>``, where the key hashes the sources, the flags, torch, Python
and the CPU; the first start on a machine pays the build (about a minute), later ones load it. A machine without a
compiler or a failed build gives ``None`` (every caller keeps its PyTorch path, logged once), and
``RADIXSERVE_CPU_KERNELS=0`` turns the kernels off. Callers self-check what they use against their PyTorch
reference before using it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import platform
import sys
from pathlib import Path
from types import ModuleType

import torch

from radixserve.runtime import envs
from radixserve.runtime.model_source import file_lock

logger = logging.getLogger("radixserve.kernels")

# -fopenmp: at::parallel_for is inline OpenMP in torch's headers; without it the kernel runs on one thread.
CFLAGS = ["-O3", "-march=native", "-fopenmp"]


def cpu_signature() -> str:
    """What ``-march=native`` compiles for: the CPU model and its feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    # x86 names its features in "flags"; aarch64 in "Features", with the core in "CPU implementer" / "CPU part".
    keys = ("model name", "flags", "Features", "CPU implementer", "CPU part", "CPU architecture")
    lines = [ln for ln in text.splitlines() if ln.startswith(keys)]
    return "\n".join(sorted(set(lines)))


RUNTIME = Path(__file__).resolve().parent
# Every kernel source; ``csrc/module.cpp`` includes the others and registers each file's functions as a submodule,
# so they compile as one translation unit (torch's headers, most of the build time, parsed once).
SOURCES = (
    RUNTIME / "csrc" / "module.cpp",
    RUNTIME / "csrc" / "simd.h",
    RUNTIME / "csrc" / "balanced.h",
    RUNTIME / "csrc" / "amx_tiles.h",
    RUNTIME / "csrc" / "greedy.cpp",
    RUNTIME / "attention" / "csrc" / "flash_blocks.h",
    RUNTIME / "attention" / "csrc" / "prefix_attention.h",
    RUNTIME / "attention" / "csrc" / "decode_attention.cpp",
    RUNTIME / "attention" / "csrc" / "extend_attention.cpp",
    RUNTIME / "models" / "csrc" / "quant_linear.cpp",
    RUNTIME / "models" / "csrc" / "quant_packed.cpp",
    RUNTIME / "models" / "csrc" / "quant_packed_kquants.h",
    RUNTIME / "models" / "csrc" / "quant_packed_512.h",
    RUNTIME / "models" / "csrc" / "quant_packed_pack.h",
    RUNTIME / "models" / "csrc" / "huge_slabs.h",
    RUNTIME / "models" / "csrc" / "quant_packed_avx2.h",
    RUNTIME / "models" / "csrc" / "quant_packed_avx2_q8k.h",
    RUNTIME / "models" / "csrc" / "fused_ops.cpp",
    RUNTIME / "models" / "csrc" / "lora_ops.cpp",
    RUNTIME / "models" / "csrc" / "bf16_linear.cpp",
    RUNTIME / "models" / "csrc" / "bf16_tiles.cpp",
    RUNTIME / "models" / "csrc" / "bf16_packed.cpp",
    RUNTIME / "models" / "csrc" / "decode_stack.cpp",
)


# In a build folder once its module has been built and imported: later starts import the module directly.
BUILT_MARKER = "built"


def build_key(source: str) -> str:
    parts = (source, " ".join(CFLAGS), torch.__version__, sys.version, platform.machine(), cpu_signature())
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def sources_key() -> str:
    """The build folder's name for the current sources on this machine."""
    return build_key("\0".join(f"{p.name}\0{p.read_text()}" for p in SOURCES))


def build_dir() -> Path:
    """The build folder of the current sources on this machine (what is measured of its kernels is kept there too)."""
    return envs.cache_dir() / "kernels" / sources_key()


@functools.cache
def load_kernels() -> ModuleType | None:
    """The compiled kernels (built now if this machine has none yet), or ``None`` where they are off or cannot
    be built. Callers check what they use against their PyTorch definitions before using it."""
    if not envs.cpu_kernels():
        return None
    try:
        folder = build_dir()
        key = folder.name
        name = f"radixserve_kernels_{key}"
        built = folder / f"{name}.so"
        if (folder / BUILT_MARKER).is_file() and built.is_file():
            # A finished build of these very sources: import it as torch's loader would, without importing the
            # builder (torch.utils.cpp_extension pulls in setuptools: ~0.2 s of every start).
            spec = importlib.util.spec_from_file_location(name, built)
            if spec is not None and spec.loader is not None:
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                return module
        from torch.utils import cpp_extension

        folder.mkdir(parents=True, exist_ok=True)
        if not any(folder.glob("*.so")):
            logger.info("compiling the CPU kernels (once per machine, about a minute) into %s", folder)
        # torch's builder guards the folder with a ``lock`` file that a process killed mid-build leaves behind, and
        # every later build would wait for it forever. Under our own lock (released by the kernel if its holder
        # dies) no one else is building, so such a file is stale.
        with file_lock(folder.parent / f"{key}.lock", "the CPU kernels"):
            (folder / "lock").unlink(missing_ok=True)
            module = cpp_extension.load(
                name=name,
                sources=[str(SOURCES[0])],  # it includes the others (the headers only for the key)
                extra_cflags=CFLAGS,
                extra_ldflags=["-fopenmp"],
                build_directory=str(folder),
                verbose=False,
            )
            (folder / BUILT_MARKER).write_text(key)  # written only after a build that loaded
            return module
    except Exception as exc:  # noqa: BLE001 - no compiler, no headers, a failed build: PyTorch path
        logger.warning("CPU kernels unavailable (%s: %s); using PyTorch ops", type(exc).__name__, exc)
        return None
