"""The AMX tile kernels run first in a child process, once per machine, so that a fault cannot take the engine down.

The tile kernels (``models/csrc/bf16_tiles.cpp``, ``attention/csrc/extend_attention.cpp``) are checked against
PyTorch at start before they serve (``bf16_kernels.tiles_ops``, ``cpu_kernels.prefill_ops``). A wrong answer there
only turns them off; a fault would not: a tile configuration the CPU refuses, or a load past a buffer, kills the
process with SIGSEGV or SIGILL, at every start. So before the engine's own process touches the tiles, a child
process (``python -m radixserve.runtime.amx_probe``) runs the same checks and one product and one prefill chunk of a
real model's shapes on every intra-op thread, and prints what it found. Where it died, timed out or found a
disagreement, the tiles stay off and the log says why; the other kernels serve. What it found is kept beside the
compiled kernels (``measured.once``), so later starts read it and new kernels or a new CPU probe again.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from radixserve.runtime.cpu_features import cpu_flags

logger = logging.getLogger("radixserve.kernels")

PROBE_FILE = "amx_probe.json"
# The child builds nothing (the parent loaded the kernels first) and runs small checks: a minute is ample, and one
# that hangs there would hang in the engine too.
PROBE_TIMEOUT_S = 120.0
PROBE_ARGV = (sys.executable, "-m", "radixserve.runtime.amx_probe")


def run_child(argv: Sequence[str], timeout_s: float = PROBE_TIMEOUT_S) -> dict:
    """What the child ``argv`` reported as its last line of output, a JSON object with ``ok`` (bool) and ``why``
    (str), or ``ok`` false with how it ended: killed by a signal, an exit status, a timeout, no report."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"ok": False, "why": f"the check did not finish in {timeout_s:.0f} s"}
    except OSError as exc:
        return {"ok": False, "why": f"the check could not start ({exc})"}
    if done.returncode < 0:
        return {"ok": False, "why": f"the check was killed by {signal.Signals(-done.returncode).name}"}
    lines = done.stdout.strip().splitlines()
    try:
        found = json.loads(lines[-1]) if lines else None
    except ValueError:
        found = None
    if done.returncode != 0 or not isinstance(found, dict) or not isinstance(found.get("ok"), bool):
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"ok": False, "why": f"the check exited with status {done.returncode} ({tail})"}
    return {"ok": found["ok"], "why": str(found.get("why", ""))}


@functools.cache
def tiles_survive() -> bool:
    """Whether the AMX tile kernels ran their checks in a child process without a fault or a disagreement on this
    machine (probed once per machine and kernel sources; always false without AMX). Callers that would use the
    tiles ask this first; the kernels must be loaded (``load_kernels``) before, so the child does not build them."""
    if "amx_bf16" not in cpu_flags():
        return False
    from radixserve.runtime.measured import once

    found = once(PROBE_FILE, {"ok", "why"}, lambda: run_child(PROBE_ARGV), "the AMX tile kernels in a child process")
    if not found["ok"]:
        logger.warning("AMX tile kernels are off on this machine: %s", found["why"])
    return bool(found["ok"])


def check_tiles() -> dict:
    """Run every tile kernel here, in this process: their start-up checks, then ``at_model_shapes``.
    ``{"ok": ..., "why": ...}``."""
    from radixserve.runtime.attention import cpu_kernels
    from radixserve.runtime.cpu_ext import load_kernels
    from radixserve.runtime.models import bf16_kernels

    if "amx_bf16" not in cpu_flags():
        return {"ok": False, "why": "this CPU has no AMX"}
    module = load_kernels()
    ops = bf16_kernels.packed_ops()
    if module is None or ops is None:
        return {"ok": False, "why": "the compiled bfloat16 kernels are off or failed their checks"}
    tiles = bf16_kernels.checked_tiles()
    if tiles is None:
        return {"ok": False, "why": "the linear tile kernel is unavailable or disagrees with F.linear"}
    extend = cpu_kernels.checked_extend_tiles(module)
    if extend is None:
        return {"ok": False, "why": "the prefill-attention tile kernel is unavailable or disagrees with PyTorch"}
    why = at_model_shapes(ops, bf16_kernels.product_of(tiles), extend)
    return {"ok": why is None, "why": why or "every tile kernel ran and agrees with PyTorch"}


def at_model_shapes(ops, product, extend) -> str | None:  # noqa: ANN001 - bf16_packed's module, two kernels
    """Where ``product`` (over weights packed by ``ops.pack``: ``product(x, packed, bias, gated)``) or ``extend``
    (prefill attention) disagrees with PyTorch at a real model's shapes, on every intra-op thread: 512 rows of
    SmolLM2's gate/up projection (576 -> 2 x 1,536), gated and not, and a 256-token chunk of 16 query and 4 KV heads
    after a 1,024-token prefix; ``None`` where both agree."""
    from radixserve.runtime.attention.cpu_kernels import reference_extend_attention

    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        x = torch.randn(512, 576, generator=gen).bfloat16()
        w = (torch.randn(2 * 1536, 576, generator=gen) / 24).bfloat16()
        packed, none = ops.pack([w]), torch.empty(0, dtype=torch.bfloat16)
        want = F.linear(x.float(), w.float())
        tol = 2e-2 * float(want.abs().max())
        if not torch.allclose(product(x, packed, none, False).float(), want, rtol=2e-2, atol=tol):
            return "the linear tile kernel disagrees with F.linear at 512 x 576 x 3,072"
        gated = F.silu(want[:, :1536]) * want[:, 1536:]
        tol = 2e-2 * float(gated.abs().max())
        if not torch.allclose(product(x, packed, none, True).float(), gated, rtol=2e-2, atol=tol):
            return "the gated linear tile kernel disagrees with PyTorch at 512 x 576 x 3,072"
        kv = torch.randn(2, 4, 1280, 64, generator=gen).bfloat16()
        q = torch.randn(256, 16, 64, generator=gen).bfloat16()
        slots, seqs = torch.randperm(1280, generator=gen), torch.tensor([[0, 256, 1280, 0]])
        got, want = (
            extend(q, kv, slots, seqs, 0.125, 0).float(),
            reference_extend_attention(q, kv, slots, seqs, 0.125, 0),
        )
        if not torch.allclose(got, want, rtol=2e-2, atol=1e-2 * float(want.abs().max())):
            return "the prefill-attention tile kernel disagrees with PyTorch at a 256-token chunk over 1,280 keys"
    return None


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    try:
        found = check_tiles()
    except RuntimeError as exc:
        found = {"ok": False, "why": f"a tile kernel raised {exc}"}
    sys.stdout.write(json.dumps(found) + "\n")
    sys.stdout.flush()
    os._exit(0)  # (no teardown of OpenMP's threads or torch's state: only what was printed matters)


if __name__ == "__main__":
    main()
