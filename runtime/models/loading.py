"""Putting checkpoint tensors into a model, one tensor at a time, straight into their final dtype and device.

The model may be built on the meta device (``runtime.loader.build_model``): then nothing is allocated before its
tensor arrives, and peak memory is the final weights plus the tensor in flight. Merged projections (q/k/v,
gate/up) collect their parts and are assembled when the last one arrives. A ``QuantTensor`` is kept in its
blocks (``Linear.set_quantized``): its float32 form is never materialized. Parts of one merged projection in
different block types (K-quant mixes do that) are unpacked and re-quantized together to Q8_0.
"""

from __future__ import annotations

import math
import mmap
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from radixserve.runtime.models.quant import QuantParts, QuantTensor, packed_ops, quantize_q8_0
from radixserve.runtime.safetensors_read import is_mapped

Loaded = torch.Tensor | QuantTensor | QuantParts


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, Loaded]],
    merged: dict[str, Any],
    merged_target: Any,
    *,
    device: torch.device | None = None,
    skip: set[str] | None = None,
    on_weight: Callable[[nn.Module], None] | None = None,
) -> set[str]:
    """Materialize every parameter of ``model`` from ``weights``; returns the names seen. ``merged`` maps module
    names to merged projections, ``merged_target(name, merged)`` gives a part's merged name. ``on_weight(module)``
    runs as soon as a module's (whole) weight is in: the loader packs it there, while the next tensor is read.
    ``ValueError`` names an unknown tensor or a wrong shape."""
    params = dict(model.named_parameters())
    pending: dict[str, dict[str, Loaded]] = {}
    seen: set[str] = set()
    for name, tensor in weights:
        if "rotary_emb" in name or name in (skip or ()):
            continue
        target, rows = merged_target(name, merged)
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} matches no parameter of the model")
        module_name, _, leaf = target.rpartition(".")
        module = model.get_submodule(module_name)
        seen.add(name)
        if rows is None:
            _put(module, leaf, tensor, params[target], name, device)
            if on_weight is not None and leaf == "weight":
                on_weight(module)
            continue
        expected = (rows.stop - rows.start, params[target].shape[1]) if params[target].dim() == 2 else (
            rows.stop - rows.start,
        )
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {expected}")
        parts = pending.setdefault(target, {})
        parts[name.rpartition(".")[0].rpartition(".")[2]] = tensor
        if len(parts) == len(module.parts):
            apart = leaf == "weight" and hasattr(module, "set_plain_parts")
            on_cpu = _target(params[target], device) in (None, torch.device("cpu"))
            whole = _assemble([parts[p] for p in module.parts], keep_apart=apart, pack=apart and on_cpu)
            _put(module, leaf, whole, params[target], target, device)
            del pending[target], parts
            if on_weight is not None and leaf == "weight":
                on_weight(module)
    return seen


class StagingPool:
    """Buffers the reader fills with weights that are packed and dropped right after (``linear.LoadPacker``), given
    back once packed and reused for the next weight of the same size: each fresh buffer costs page faults (and a
    large one a mapping and an unmapping, which stall the other threads' faults). A size whose weights are all
    taken (``expect`` says how many there are) is not pooled any more: the buffers go back to the system as the
    last layer is packed, instead of at the end, at the top of the load's memory. Thread-safe: the reader takes,
    the packers give back."""

    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lent: set[int] = set()
        self._left: dict[int, int] = {}  # bytes -> takes still expected
        self._lock = threading.Lock()

    def expect(self, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        """One more weight of this size will be taken."""
        nbytes = math.prod(shape) * dtype.itemsize
        self._left[nbytes] = self._left.get(nbytes, 0) + 1

    def take(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        with self._lock:
            free = self._free.get(nbytes)
            raw = free.pop() if free else _mapped(nbytes)
            self._lent.add(raw.data_ptr())
            if self._left.get(nbytes, 0) > 0:
                self._left[nbytes] -= 1
        return raw.view(dtype).view(shape)

    def give(self, tensor: torch.Tensor) -> None:
        """Take back a buffer ``take`` lent (anything else is left alone)."""
        with self._lock:
            if tensor.data_ptr() not in self._lent or not tensor.is_contiguous():
                return
            self._lent.discard(tensor.data_ptr())
            raw = tensor.reshape(-1).view(torch.uint8)
            if self._left.get(raw.numel(), 0) > 0:  # (else dropped: unmapped once the caller lets go)
                self._free.setdefault(raw.numel(), []).append(raw)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._lent.clear()
            self._left.clear()


def _mapped(nbytes: int) -> torch.Tensor:
    """A buffer of its own mapping (unmapped when the last tensor on it goes), not from the heap: glibc puts
    allocations of a few MiB on its heap once its mmap threshold has risen, and freeing them there (the pool is
    dropped after loading) leaves holes that stay resident."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


class MergedRows:
    """A reader's destinations (``safetensors_read.Destination``): each part of a merged projection (q/k/v,
    gate/up) is read straight into its rows of one buffer for the whole projection, which ``_assemble`` then
    takes as it is: no concatenation, no second copy (a quarter of a 3B model's load time went to it). With a
    ``staging`` pool (the weights are packed as they arrive), every linear weight is read into a pooled buffer.
    Parts in another dtype than the model's, or of a shape the model does not expect, get buffers of their own
    (and the usual conversion or error). ``rename`` maps checkpoint names to the decoder's (a family's).

    With ``map_weights`` the linear and embedding weights stored in the model's dtype are not read at all but
    mapped (``maps`` is the reader's ``mapped``): a merged projection's parts then stay apart, unless they lie
    side by side in the file (``_assemble``)."""

    def __init__(
        self,
        model: nn.Module,
        dtype: torch.dtype,
        rename: Callable[[str], str],
        staging: StagingPool | None = None,
        map_weights: bool = False,
    ) -> None:
        self.dtype, self.rename, self.staging = dtype, rename, staging
        self.map_weights = map_weights
        self.matrices: dict[str, tuple[int, ...]] = {}  # linear and embedding weights (whole) -> shape
        self.parts: dict[str, tuple[str, slice, tuple[int, ...]]] = {}  # part name -> (merged name, rows, shape)
        self.whole: dict[str, tuple[int, ...]] = {}  # a linear weight read whole into a staging buffer -> shape
        self.buffers: dict[str, tuple[torch.Tensor, int]] = {}  # merged name -> (buffer, parts not yet given)
        self.counts: dict[str, int] = {}  # merged name -> how many checkpoint tensors fill it
        for name, module in model.named_modules():
            parts = getattr(module, "parts", None)
            if isinstance(module, nn.Linear | nn.Embedding) and not isinstance(parts, dict):
                self.matrices[f"{name}.weight"] = tuple(module.weight.shape)
            if not isinstance(parts, dict):
                if staging is not None and isinstance(module, nn.Linear) and module.weight is not None:
                    self.whole[f"{name}.weight"] = tuple(module.weight.shape)
                    staging.expect(dtype, tuple(module.weight.shape))
                continue
            owner = name.rpartition(".")[0]
            for leaf in ("weight", "bias"):
                param = getattr(module, leaf, None)
                if param is None:
                    continue
                for part in parts:
                    self.parts[f"{owner}.{part}.{leaf}"] = (f"{name}.{leaf}", module.part_rows(part), param.shape)
                self.counts[f"{name}.{leaf}"] = len(parts)
                if staging is not None and leaf == "weight":
                    staging.expect(dtype, tuple(param.shape))

    def maps(self, name: str, dtype: torch.dtype, shape: list[int]) -> bool:
        """Whether the reader should map this tensor rather than read it (see the class doc)."""
        if not self.map_weights or dtype != self.dtype:
            return False
        name = self.rename(name)
        if name in self.matrices:
            return list(self.matrices[name]) == shape
        found = self.parts.get(name)
        return found is not None and found[0].endswith(".weight") and shape == [found[1].stop - found[1].start,
                                                                                 *found[2][1:]]  # fmt: skip

    def __call__(self, name: str, dtype: torch.dtype, shape: list[int]) -> torch.Tensor | None:
        name = self.rename(name)
        if dtype != self.dtype:
            return None
        if name in self.whole and self.staging is not None:
            return self.staging.take(dtype, self.whole[name]) if list(self.whole[name]) == shape else None
        found = self.parts.get(name)
        if found is None:
            return None
        merged, rows, full = found
        if shape != [rows.stop - rows.start, *full[1:]]:
            return None
        if merged not in self.buffers:
            pooled = self.staging is not None and merged.endswith(".weight")
            buffer = self.staging.take(dtype, tuple(full)) if pooled else torch.empty(full, dtype=dtype)  # type: ignore[union-attr]
            self.buffers[merged] = (buffer, self.counts[merged])
        buffer, left = self.buffers[merged]
        if left > 1:
            self.buffers[merged] = (buffer, left - 1)
        else:
            del self.buffers[merged]  # the parts' views keep it alive from here
        return buffer[rows]


def _adjacent(parts: list[Loaded]) -> torch.Tensor | None:
    """The whole buffer when the parts are consecutive rows of one (``MergedRows``), else None."""
    if not all(isinstance(p, torch.Tensor) and p.is_contiguous() for p in parts):
        return None
    first = parts[0]
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for p in parts:
        if p.untyped_storage().data_ptr() != storage or p.storage_offset() != offset:  # type: ignore[union-attr]
            return None
        offset += p.numel()
    rows = sum(p.shape[0] for p in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())  # type: ignore[union-attr]


def _runs_of_one_type(parts: list[QuantTensor], *, pack: bool = False) -> list[QuantTensor]:
    """Consecutive parts of one block type joined (their rows concatenated). With ``pack`` (a linear weight that
    stays on the CPU) a run of several parts is packed for the kernel right away, each part into its own groups
    (``QuantTensor.pack_rows``): the parts, views of the file's map, are then read once, not concatenated first."""
    runs: list[list[QuantTensor]] = []
    for p in parts:
        if runs and runs[-1][0].qtype == p.qtype:
            runs[-1].append(p)
        else:
            runs.append([p])
    out = []
    for run in runs:
        if len(run) == 1:
            out.append(run[0])
            continue
        packed = QuantTensor.pack_rows(run) if pack else None
        if packed is not None:
            out.append(packed)
            continue
        data = torch.cat([p.data for p in run], dim=0)
        out.append(QuantTensor(run[0].qtype, data, (data.shape[0], run[0].shape[1])))
    return out


class PlainParts(tuple):
    """The parts of a merged weight, views of checkpoint maps that do not lie side by side: served apart
    (``Linear.set_plain_parts``) rather than copied together."""

    @property
    def shape(self) -> tuple[int, ...]:
        return (sum(p.shape[0] for p in self), *self[0].shape[1:])


def _all_mapped(parts: list[Loaded]) -> bool:
    """Whether the parts are views of checkpoint maps (``safetensors_read``: of one file or, where a layer's
    tensors straddle two shards, of two), of one dtype."""
    if not all(isinstance(p, torch.Tensor) and p.is_contiguous() and p.dim() == 2 for p in parts):
        return False
    return all(is_mapped(p) and p.dtype == parts[0].dtype for p in parts)  # type: ignore[union-attr]


def _assemble(parts: list[Loaded], *, keep_apart: bool = False, pack: bool = False) -> Loaded:
    """The merged weight from its parts, in output order; ``PlainParts`` where ``keep_apart`` and they are
    mapped views apart from one another; block-quantized parts packed for the CPU kernel where ``pack``."""
    whole = _adjacent(parts)
    if whole is not None:
        return whole
    if keep_apart and len(parts) > 1 and _all_mapped(parts):
        return PlainParts(parts)
    if all(isinstance(p, QuantTensor) for p in parts):
        runs = _runs_of_one_type(parts, pack=pack)  # type: ignore[arg-type]
        if len(runs) == 1:
            return runs[0]
        if packed_ops() is not None:  # each run keeps its type and kernel (QuantParts)
            return QuantParts(tuple(runs))
        return quantize_q8_0(torch.cat([p.dequantize() for p in parts], dim=0))  # type: ignore[union-attr]
    return torch.cat([p.dequantize() if isinstance(p, QuantTensor) else p for p in parts], dim=0)


def _target(param: torch.Tensor, device: Any) -> torch.device | None:
    """Where a parameter's weight goes: ``device``, else where the parameter is (``None``: built on the meta
    device, the weight stays where it was read, on the CPU)."""
    return torch.device(device) if device is not None else (param.device if param.device.type != "meta" else None)


def _put(module: nn.Module, leaf: str, tensor: Loaded, param: torch.Tensor, name: str, device: Any) -> None:
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}")
    target = _target(param, device)
    if isinstance(tensor, PlainParts):
        if tensor[0].dtype == param.dtype and (target is None or target.type == "cpu"):
            module.set_plain_parts(list(tensor))  # type: ignore[operator]
            return
        tensor = torch.cat(list(tensor), dim=0)
    if isinstance(tensor, QuantTensor | QuantParts):
        if leaf != "weight" or not hasattr(module, "set_quantized"):
            raise ValueError(f"{name}: a block-quantized tensor can only be a linear or embedding weight")
        if isinstance(tensor, QuantParts):  # packed CPU kernels only: the parts stay where they are
            module.set_quantized(tensor)
            return
        data = tensor.data.to(target) if target is not None else tensor.data
        mapped = tensor.mapped and data is tensor.data  # a copy to another device no longer holds the map
        module.set_quantized(QuantTensor(tensor.qtype, data, tensor.shape, tensor.packed, mapped))
        return
    value = tensor.to(dtype=param.dtype, device=target or "cpu")
    setattr(module, leaf, nn.Parameter(value, requires_grad=False))


def check_complete(model: nn.Module) -> None:
    """Raise ``ValueError`` naming the parameters no checkpoint tensor filled."""
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
