"""The AMX tile kernels' first run in a child process (runtime/amx_probe.py): how a child's end is read (a fault, a
status, a timeout, a report), that a fault turns the tiles off and is kept for later starts, and that the checks
the child runs pass over the tiles' emulation (a check that failed right kernels would keep AMX machines off them)."""

from __future__ import annotations

import functools
import json
import logging
import sys

import pytest
import torch

from radixserve.runtime import amx_probe
from radixserve.runtime.cpu_ext import build_dir, load_kernels
from radixserve.runtime.models import bf16_kernels


def _child(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_fault_a_status_a_timeout_and_a_report_are_told_apart() -> None:
    segv = amx_probe.run_child(_child("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"))
    assert segv == {"ok": False, "why": "the check was killed by SIGSEGV"}
    status = amx_probe.run_child(_child("import sys; print('{}'); sys.exit('boom')"))
    assert not status["ok"] and "status 1" in status["why"] and "boom" in status["why"]
    assert not amx_probe.run_child(_child("print('no json')"))["ok"]
    slow = amx_probe.run_child(_child("import time; time.sleep(30)"), timeout_s=1.0)
    assert slow == {"ok": False, "why": "the check did not finish in 1 s"}
    report = amx_probe.run_child(_child('print(\'log line\'); print(\'{"ok": true, "why": "fine"}\')'))
    assert report == {"ok": True, "why": "fine"}


def test_the_probe_module_reports_on_this_machine() -> None:
    """The child the engine runs: where the CPU has AMX, every tile kernel must run and agree; elsewhere it says so."""
    found = amx_probe.run_child([sys.executable, "-m", "radixserve.runtime.amx_probe"])
    if "amx_bf16" in amx_probe.cpu_flags():
        assert found == {"ok": True, "why": "every tile kernel ran and agrees with PyTorch"}
    else:
        assert found == {"ok": False, "why": "this CPU has no AMX"}


def test_a_child_that_faults_turns_the_tiles_off_and_later_starts_read_that(
    tmp_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(amx_probe, "cpu_flags", lambda: {"amx_bf16", "avx512_bf16"})
    monkeypatch.setattr(amx_probe, "PROBE_ARGV", _child("import os, signal; os.kill(os.getpid(), signal.SIGILL)"))
    amx_probe.tiles_survive.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="radixserve.kernels"):
            assert not amx_probe.tiles_survive()
        assert "AMX tile kernels are off on this machine: the check was killed by SIGILL" in caplog.text
        kept = json.loads((build_dir() / amx_probe.PROBE_FILE).read_text())
        assert kept == {"ok": False, "why": "the check was killed by SIGILL"}
        # A later start reads what was found: a child that would now succeed is not run.
        monkeypatch.setattr(amx_probe, "PROBE_ARGV", _child('print(\'{"ok": true, "why": ""}\')'))
        amx_probe.tiles_survive.cache_clear()
        assert not amx_probe.tiles_survive()
        (build_dir() / amx_probe.PROBE_FILE).unlink()  # deleting the file probes again
        amx_probe.tiles_survive.cache_clear()
        assert amx_probe.tiles_survive()
    finally:
        amx_probe.tiles_survive.cache_clear()


@pytest.mark.skipif(bf16_kernels.packed_ops() is None, reason="no AVX-512 BF16: nothing packs in pairs of K")
def test_the_childs_checks_pass_over_the_emulated_tiles_and_fail_a_wrong_product() -> None:
    kernels = load_kernels()
    ops = bf16_kernels.packed_ops()
    extend = functools.partial(kernels.extend_attention.extend_attention_tiles, emulated=True)
    assert amx_probe.at_model_shapes(ops, kernels.bf16_tiles.emulated, extend) is None

    def off_in_the_last_rows(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor, gated: bool) -> torch.Tensor:
        y = kernels.bf16_tiles.emulated(x, packed, bias, gated)
        y[-16:] *= 1.1
        return y

    assert "disagrees with F.linear" in amx_probe.at_model_shapes(ops, off_in_the_last_rows, extend)

    def off_in_one_head(*args) -> torch.Tensor:  # noqa: ANN002
        out = extend(*args)
        out[:, 5] *= 1.1
        return out

    why = amx_probe.at_model_shapes(ops, kernels.bf16_tiles.emulated, off_in_one_head)
    assert why is not None and "prefill-attention" in why
