"""The code base stays ruff-clean: part of the test command, so CI enforces it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_clean() -> None:
    ruff = shutil.which("ruff")
    cmd = [ruff] if ruff else [sys.executable, "-m", "ruff"]
    proc = subprocess.run([*cmd, "check", "."], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0 and "No module named ruff" in proc.stderr:
        pytest.fail("ruff is not installed; it is part of the [dev] extra")
    assert proc.returncode == 0, proc.stdout + proc.stderr
