"""Putting checkpoint tensors into a model, one tensor at a time, straight into their final dtype and device.

The model may be built on the meta device (``runtime.loader.build_model``): then nothing is allocated before its
tensor arrives, and peak memory is the final weights plus the tensor in flight. Merged projections (q/k/v,
gate/up) collect their parts and are assembled when the last one arrives. A ``QuantTensor`` is kept in its
blocks (``Linear.set_quantized``): its float32 form is never materialized. Parts of one merged projection in
different block types (K-quant mixes do that) are unpacked and re-quantized together to Q8_0.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from radixserve.runtime.models.quant import QuantTensor, quantize_q8_0

Loaded = torch.Tensor | QuantTensor


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, Loaded]],
    merged: dict[str, Any],
    merged_target: Any,
    *,
    device: torch.device | None = None,
    skip: set[str] | None = None,
) -> set[str]:
    """Materialize every parameter of ``model`` from ``weights``; returns the names seen. ``merged`` maps module
    names to merged projections, ``merged_target(name, merged)`` gives a part's merged name. ``ValueError`` names
    an unknown tensor or a wrong shape."""
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
            continue
        expected = (rows.stop - rows.start, params[target].shape[1]) if params[target].dim() == 2 else (
            rows.stop - rows.start,
        )
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {expected}")
        parts = pending.setdefault(target, {})
        parts[name.rpartition(".")[0].rpartition(".")[2]] = tensor
        if len(parts) == len(module.parts):
            _put(module, leaf, _assemble([parts[p] for p in module.parts]), params[target], target, device)
            del pending[target]
    return seen


def _assemble(parts: list[Loaded]) -> Loaded:
    """The merged weight from its parts, in output order."""
    if all(isinstance(p, QuantTensor) for p in parts):
        if len({p.qtype for p in parts}) == 1:  # type: ignore[union-attr]
            data = torch.cat([p.data for p in parts], dim=0)  # type: ignore[union-attr]
            return QuantTensor(parts[0].qtype, data, (data.shape[0], parts[0].shape[1]))  # type: ignore[union-attr]
        return quantize_q8_0(torch.cat([p.dequantize() for p in parts], dim=0))  # type: ignore[union-attr]
    return torch.cat([p.dequantize() if isinstance(p, QuantTensor) else p for p in parts], dim=0)


def _put(module: nn.Module, leaf: str, tensor: Loaded, param: torch.Tensor, name: str, device: Any) -> None:
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}")
    target = torch.device(device) if device is not None else (param.device if param.device.type != "meta" else None)
    if isinstance(tensor, QuantTensor):
        if leaf != "weight" or not hasattr(module, "set_quantized"):
            raise ValueError(f"{name}: a block-quantized tensor can only be a linear or embedding weight")
        data = tensor.data.to(target) if target is not None else tensor.data
        module.set_quantized(QuantTensor(tensor.qtype, data, tensor.shape))
        return
    value = tensor.to(dtype=param.dtype, device=target or "cpu")
    setattr(module, leaf, nn.Parameter(value, requires_grad=False))


def check_complete(model: nn.Module) -> None:
    """Raise ``ValueError`` naming the parameters no checkpoint tensor filled."""
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
