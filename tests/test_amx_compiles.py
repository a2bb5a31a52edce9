"""The kernels compile for a CPU with AMX, whatever CPU runs the tests.

The tile code (``amx_tiles.h``'s ``Amx``, the tile paths of ``bf16_tiles.cpp`` and ``extend_attention.cpp``) is
compiled only where ``-march=native`` has AMX. On any other machine a mistake in it goes unseen, and on an AMX
machine it would fail the one build every kernel shares: the engine would start without any of them. Here the
sources are checked as the kernels' build compiles them, for Sapphire Rapids."""

from __future__ import annotations

import platform
import shutil
import subprocess
import sysconfig

import pytest

from radixserve.runtime.cpu_ext import SOURCES

CXX = shutil.which("c++") or shutil.which("g++")
pytestmark = pytest.mark.skipif(
    CXX is None or platform.machine() not in ("x86_64", "AMD64"), reason="an x86-64 C++ compiler"
)
AMX = ["-march=sapphirerapids", "-std=c++20", "-fopenmp"]


def _supports_sapphire_rapids() -> bool:
    probe = subprocess.run([CXX, *AMX, "-x", "c++", "-E", "-"], input="", capture_output=True, text=True)
    return probe.returncode == 0


def _flags() -> list[str]:
    from torch.utils.cpp_extension import include_paths

    includes = [*include_paths(), sysconfig.get_paths()["include"]]
    return [*AMX, *(f"-isystem{p}" for p in includes), "-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=x"]


def test_the_kernels_compile_with_the_tile_code_for_an_amx_cpu() -> None:
    if not _supports_sapphire_rapids():
        pytest.skip("this compiler does not know -march=sapphirerapids")
    module = str(SOURCES[0])
    macros = subprocess.run([CXX, *_flags(), "-dM", "-E", module], capture_output=True, text=True, timeout=300)
    assert macros.returncode == 0, macros.stderr[-4000:]
    assert "#define RADIXSERVE_AMX 1" in macros.stdout  # the tile code is in this compile, not left out
    checked = subprocess.run([CXX, *_flags(), "-fsyntax-only", module], capture_output=True, text=True, timeout=600)
    errors = [line for line in checked.stderr.splitlines() if "error:" in line]
    assert checked.returncode == 0 and not errors, "\n".join(errors[:20]) or checked.stderr[-4000:]
