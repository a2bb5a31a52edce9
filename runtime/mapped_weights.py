"""Weights mapped from the checkpoint at load move into the process's own memory once the engine serves.

Mapping the bfloat16 weights (``safetensors_read``) makes the load as fast as reading the files: no copy, no fresh
memory to fault in. Served from the page cache's pages, though, a decode step streams them slower than from memory
the process allocated itself: the linear layers of the 1B Llama shape at one row took 101-107 ms mapped against
85-92 ms in fresh memory (same kernels, same process, alternating; 2-core AMD EPYC). So after start-up a thread of
its own (``WeightMover``, at a lower priority) copies each mapped tensor into new memory, one at a time, and hands
the copy to the engine thread, which swaps it in between two steps (``post``); the mapped pages are then given
back (``unmap_pages``), so resident memory stays at the weights plus the one tensor in flight. The copies are
bit for bit the mapped bytes: outputs never change, only the speed (and until the move ends, a few seconds for
a 3B model, requests run at the mapped speed beside the copying).

Invariant: every tensor is swapped in its owners all at once (a tied head and its embedding stay one tensor), on
the engine thread, so the model a step runs is always whole.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from torch import nn

from radixserve.runtime.models import decode_stack
from radixserve.runtime.safetensors_read import is_mapped, unmap_pages

logger = logging.getLogger("radixserve.model")

# The mover's niceness: the copies yield to the engine's steps.
MOVER_NICE = 10


@dataclass
class _Mapped:
    """One mapped tensor and where the model holds it: (module, parameter name) owners, or the module it is a
    part of (``Linear.set_plain_parts``)."""

    tensor: torch.Tensor
    params: list[tuple[nn.Module, str]] = field(default_factory=list)
    part_of: nn.Module | None = None


def mapped_tensors(models: list[nn.Module]) -> list[_Mapped]:
    """Every tensor of ``models`` that is a view of a checkpoint map, each once, with its owners."""
    found: dict[int, _Mapped] = {}
    for module in (m for model in models for m in model.modules()):
        for name, p in module.named_parameters(recurse=False):
            if is_mapped(p):
                found.setdefault(id(p), _Mapped(p)).params.append((module, name))
        for part in getattr(module, "_plain_parts", ()):
            if is_mapped(part):
                found.setdefault(id(part), _Mapped(part)).part_of = module
    return list(found.values())


def _copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fresh memory, copied by numpy on this thread alone (a torch copy would start an OpenMP team
    beside the engine's)."""
    out = torch.empty_like(t)
    src, dst = t.detach().view(torch.uint8).reshape(-1).numpy(), out.view(torch.uint8).reshape(-1).numpy()
    dst[:] = src
    return out


def _swap(item: _Mapped, copy: torch.Tensor) -> None:
    """Put ``copy`` where ``item.tensor`` was (run on the engine thread), then give the mapped pages back."""
    param = nn.Parameter(copy, requires_grad=False)  # one object for every owner, as tied weights are
    for module, name in item.params:
        setattr(module, name, param)
    if item.part_of is not None:
        module = item.part_of
        module.set_plain_parts([copy if p is item.tensor else p for p in module._plain_parts])  # type: ignore[operator,union-attr]
    unmap_pages(item.tensor)


class WeightMover:
    """Moves the mapped tensors of ``models`` (the served model, a draft model) into fresh memory on a daemon
    thread; ``post(fn)`` runs ``fn`` on the engine thread between steps and returns its future (or raises once the
    engine is gone: the move stops). ``done`` is set when every tensor has moved (or the move stopped)."""

    def __init__(self, models: list[nn.Module], post: Callable[[Callable[[], None]], Future[None]]) -> None:
        self.items = mapped_tensors(models)
        self.post = post
        self.done = threading.Event()
        self.moved_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weights-move", daemon=True)
        self.models = models
        if self.items:
            for model in models:  # the decode stack holds weight tensors: none while they move
                decode_stack.suspend(model)
            self._thread.start()
            atexit.register(self.close)
        else:
            self.done.set()

    def stop(self) -> None:
        """Stop after the tensor in flight (the rest stay mapped)."""
        self._stop.set()

    def close(self, timeout: float = 10.0) -> None:
        """Stop and wait for the thread (the engine's shutdown, after its loop has ended; or the interpreter's
        exit): a process must not exit while the thread copies, or the C++ runtime aborts it ("terminate called
        without an active exception")."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        atexit.unregister(self.close)

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            if hasattr(os, "setpriority"):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), MOVER_NICE)
            for item in self.items:
                if self._stop.is_set():
                    return
                copy = _copy(item.tensor)
                # One tensor in flight: wait for the swap (and the pages' release) before the next copy.
                self.post(lambda item=item, copy=copy: _swap(item, copy)).result()
                self.moved_bytes += item.tensor.nbytes
            logger.info(
                "weights moved from the checkpoint's map into memory: %.1f MiB in %.1fs",
                self.moved_bytes / 2**20, time.perf_counter() - start,
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - the engine is gone, or a copy failed: the weights stay mapped
            logger.info("weights stay mapped from the checkpoint (%s: %s)", type(exc).__name__, exc)
        finally:
            self.items = []
            for model in self.models:
                decode_stack.invalidate(model)  # built again, over the moved weights, at the next decode step
            self.done.set()
