"""LoRA adapters served beside the base model (``--lora-modules NAME=PATH ...``), in PEFT's format.

A request names an adapter (the OpenAI ``model`` field, SGLang's ``lora_path``); the rows of one step may use
different adapters, or none, and share the batch. An adapter adds to a projection's output ``y`` the low-rank
update ``s * (x A^T) B^T`` (PEFT's LoRA: ``s`` is ``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA). The base
model merges q/k/v and gate/up into one projection each (``llama.MergedLinear``); so does an adapter: its parts'
``A`` stacked (``[sum r, in]``) and their ``B`` block-diagonal with ``s`` folded in (``[out, sum r]``), so a merged
projection costs two small matmuls per adapter in the step.

Ownership: ``LoRAs`` (the adapters, read-only once loaded) belongs to the model runner, which builds one
``LoRABatch`` per step that has adapter rows and hands it to the model through ``ForwardContext.lora``. A step
with adapter rows runs the layers in Python (not the compiled decode stack or a CUDA graph); one without runs as
it would with no adapter loaded. The radix cache keys an adapter's KV apart from the base model's and other
adapters' (``Req.cache_namespace``).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from radixserve.runtime.cpu_ext import load_kernels
from radixserve.runtime.lora_spec import LoRASpec, parse_lora_modules

logger = logging.getLogger("radixserve.lora")

# Adapter module name (HF) -> (the model's projection, the part of a merged one or None for a whole projection).
TARGETS = {
    "q_proj": ("qkv_proj", "q_proj"),
    "k_proj": ("qkv_proj", "k_proj"),
    "v_proj": ("qkv_proj", "v_proj"),
    "qkv_proj": ("qkv_proj", None),
    "o_proj": ("o_proj", None),
    "gate_proj": ("gate_up_proj", "gate_proj"),
    "up_proj": ("gate_up_proj", "up_proj"),
    "gate_up_proj": ("gate_up_proj", None),
    "down_proj": ("down_proj", None),
}
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
_LAYER = re.compile(r"(?:^|\.)layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<proj>\w+)$")


class LoRAAdapter:
    """One loaded adapter: per (layer, projection) its ``A^T`` ``[in, sum r]`` and scaled ``B^T`` ``[sum r, out]``."""

    def __init__(self, name: str, path: str, rank: int, weights: dict[tuple[int, str], tuple[torch.Tensor, ...]]):
        self.name, self.path, self.rank, self.weights = name, path, rank, weights
        # What the radix cache keys this adapter's KV by (``Req.lora_key``): set once it is served, unique per
        # load, so that an adapter loaded again under a name never meets the KV of the one it replaced.
        self.key = name

    def describe(self) -> str:
        projections = sorted({proj for _, proj in self.weights})
        return f"{self.name} (rank {self.rank}, {', '.join(projections)})"


def load_adapter(spec: LoRASpec, model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> LoRAAdapter:
    """Read a PEFT LoRA folder (``adapter_config.json``, ``adapter_model.safetensors``) for ``model``;
    ``ValueError`` naming what does not fit (another method, a module the engine cannot adapt, wrong shapes)."""
    from safetensors.torch import load_file

    folder = Path(spec.path).expanduser()
    where = f"LoRA adapter {spec.name!r} ({folder})"
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_file.is_file():
        raise ValueError(f"{where}: no adapter_config.json; give the folder PEFT's save_pretrained wrote")
    if not weights_file.is_file():
        raise ValueError(f"{where}: no adapter_model.safetensors (save the adapter with safe_serialization)")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
        if not isinstance(config, dict):
            raise ValueError("adapter_config.json is not a JSON object")
        _check_config(config, where)
        for pattern in config.get("alpha_pattern") or {}:
            re.compile(pattern)
        tensors = load_file(str(weights_file))
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - a folder that cannot be read (or parsed) is the caller's mistake
        raise ValueError(f"{where}: cannot read the adapter: {type(exc).__name__}: {exc}") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise ValueError(f"{where}: {key!r} is not a LoRA A/B weight (embeddings and heads are not adapted)")
        pairs.setdefault(m["module"], {})[m["ab"]] = tensor
    modules = dict(model.named_modules())
    parts: dict[tuple[int, str], list[tuple[str | None, torch.Tensor, torch.Tensor]]] = {}
    rank = 0
    for module, ab in sorted(pairs.items()):
        found = _LAYER.search(module)
        if found is None or found["proj"] not in TARGETS:
            raise ValueError(f"{where}: LoRA on {module!r} is not served (only the attention and MLP projections)")
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: {module!r} lacks its lora_{'B' if 'A' in ab else 'A'} weight")
        layer = int(found["layer"])
        target, part = TARGETS[found["proj"]]
        if f"model.layers.{layer}.self_attn.{target}" not in modules and f"model.layers.{layer}.mlp.{target}" not in (
            modules
        ):
            raise ValueError(f"{where}: {module!r} is not a projection of this model (layer {layer}, {target})")
        a, b = ab["A"], ab["B"]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r:
            raise ValueError(f"{where}: {module!r} has A {tuple(a.shape)} and B {tuple(b.shape)}: not a rank-r pair")
        rank = max(rank, r)
        scale = _scale(config, module, r)
        group = parts.setdefault((layer, target), [])
        if any(p == part or p is None or part is None for p, _, _ in group):
            raise ValueError(f"{where}: layer {layer} {part or target} is adapted twice (by {module!r} and another)")
        group.append((part, a.float(), b.float() * scale))
    if not parts:
        raise ValueError(f"{where}: the adapter has no LoRA weights")
    weights = {key: _merge(modules, key, group, where, dtype, device) for key, group in sorted(parts.items())}
    return LoRAAdapter(spec.name, str(folder), rank, weights)


def _check_config(config: dict[str, Any], where: str) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {config.get('peft_type')!r} is not served; only LORA")
    if config.get("use_dora"):
        raise ValueError(f"{where}: DoRA adapters (use_dora) are not served; only plain LoRA")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{where}: adapters that train biases (bias {config['bias']!r}) are not served")
    if config.get("modules_to_save"):
        raise ValueError(f"{where}: modules_to_save ({config['modules_to_save']}) would replace base weights")
    if not isinstance(config.get("r"), int) or config["r"] < 1:
        raise ValueError(f"{where}: adapter_config.json needs its rank r")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(("pissa", "olora", "corda", "eva", "loftq")):
        # These initializations change the base weights too; PEFT's save_pretrained can convert them to plain LoRA.
        raise ValueError(
            f"{where}: init_lora_weights {init!r} adapts modified base weights; save it converted to plain LoRA "
            "(PEFT's path_initial_model_for_weight_conversion)"
        )


def _scale(config: dict[str, Any], module: str, r: int) -> float:
    """PEFT's scaling of ``module``: its ``alpha_pattern`` entry, else ``lora_alpha``, over r (or sqrt(r))."""
    alpha = config.get("lora_alpha", 8)  # (PEFT's default)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            alpha = value
            break
    return alpha / (math.sqrt(r) if config.get("use_rslora") else r)


def _merge(
    modules: dict[str, torch.nn.Module],
    key: tuple[int, str],
    group: list[tuple[str | None, torch.Tensor, torch.Tensor]],
    where: str,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One projection's parts as one pair: ``A`` stacked, ``B`` block-diagonal over the projection's rows."""
    layer, target = key
    owner = "self_attn" if target in ("qkv_proj", "o_proj") else "mlp"
    linear = modules[f"model.layers.{layer}.{owner}.{target}"]
    out, inn = linear.out_features, linear.in_features
    total = sum(a.shape[0] for _, a, _ in group)
    a_all = torch.zeros(total, inn)
    b_all = torch.zeros(out, total)
    col = 0
    for part, a, b in group:
        rows = slice(0, out) if part is None else linear.part_rows(part)
        if a.shape[1] != inn or b.shape[0] != rows.stop - rows.start:
            raise ValueError(
                f"{where}: layer {layer} {part or target} has A {tuple(a.shape)} and B {tuple(b.shape)}, but the "
                f"model's projection maps {inn} to {rows.stop - rows.start}: an adapter of another model?"
            )
        r = a.shape[0]
        a_all[col : col + r] = a
        b_all[rows, col : col + r] = b
        col += r
    # Kept transposed (``A^T`` ``[in, sum r]``, ``B^T`` ``[sum r, out]``): the products then read them row-major.
    # Half precision is for the weights that bound a step's time; these are small (see ``LoRABatch.apply``).
    weight_dtype = torch.float32 if device.type == "cpu" else dtype
    return a_all.T.to(device, weight_dtype).contiguous(), b_all.T.to(device, weight_dtype).contiguous()


_NO_ROWS = torch.empty(0, dtype=torch.long)


def _kernel(x: torch.Tensor, y: torch.Tensor) -> Any:
    """The compiled row kernel (``csrc/lora_ops.cpp``) where it takes these tensors, else None."""
    if x.device.type != "cpu" or x.dtype != y.dtype or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    if x.stride(-1) != 1 or y.stride(-1) != 1:
        return None
    kernels = load_kernels()
    return getattr(kernels, "lora", None) if kernels is not None else None


class LoRABatch:
    """The adapters of one step's rows: per adapter its rows (None: every row; a slice when contiguous; else an
    index tensor)."""

    def __init__(self, groups: list[tuple[LoRAAdapter, slice | torch.Tensor | None]]) -> None:
        self.groups = groups

    def apply(self, layer: int, target: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the projection ``target`` of layer ``layer`` applied to ``x``) plus each row's adapter update;
        in place. The update is computed in the adapter's float32 (a decode step is hundreds of these products,
        and on the CPU a small bfloat16 matmul costs ~10x a float32 one). On the CPU a group of up to
        ``MAX_ROWS`` rows goes to the compiled kernel (``csrc/lora_ops.cpp``: each row summed on its own, so its bits
        do not depend on the batch or the run); larger ones, and other devices, to matmuls."""
        kernel = _kernel(x, y)
        for adapter, rows in self.groups:
            pair = adapter.weights.get((layer, target))
            if pair is None:
                continue
            at, bt = pair
            n = x.shape[0] if rows is None else rows.stop - rows.start if isinstance(rows, slice) else rows.numel()
            if kernel is not None and n <= kernel.MAX_ROWS:
                span = rows if isinstance(rows, slice) else slice(0, x.shape[0])
                index = rows if isinstance(rows, torch.Tensor) else _NO_ROWS
                kernel.add_update(y, x, at, bt, span.start, span.stop, index)
                continue
            xs = x if rows is None else x[rows]
            if xs.dtype != at.dtype:
                xs = xs.to(at.dtype)
            if rows is None:
                y.add_(xs.mm(at).mm(bt))
            elif isinstance(rows, slice):
                y[rows].add_(xs.mm(at).mm(bt))
            else:  # (one rounding into y's dtype, as the in-place adds: rows give the same bits either way)
                y[rows] = (y[rows] + xs.mm(at).mm(bt)).to(y.dtype)
        return y


class LoRAs:
    """The served adapters, by name (the model runner's; changed only on the engine thread, between steps)."""

    def __init__(self, adapters: Sequence[LoRAAdapter], device: torch.device) -> None:
        self.adapters: dict[str, LoRAAdapter] = {}
        self.device = device
        self._loads = itertools.count()
        for adapter in adapters:
            self.add(adapter)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.adapters)

    def add(self, adapter: LoRAAdapter) -> None:
        if adapter.name in self.adapters:
            raise ValueError(f"a LoRA adapter named {adapter.name!r} is already loaded; unload it first")
        adapter.key = f"{adapter.name}#{next(self._loads)}"
        self.adapters[adapter.name] = adapter

    def remove(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise LookupError(f"no LoRA adapter is named {name!r} on this server")

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for a in self.adapters.values() for pair in a.weights.values() for t in pair)

    def batch(self, names: Sequence[str | None], counts: Sequence[int]) -> LoRABatch | None:
        """The step's ``LoRABatch``: row group ``i`` has ``counts[i]`` rows and uses adapter ``names[i]`` (None: the
        base model). None when no row uses one."""
        if all(name is None for name in names):
            return None
        rows: dict[str, list[tuple[int, int]]] = {}
        start = 0
        for name, n in zip(names, counts, strict=True):
            if name is not None and n > 0:  # (no group is empty: an empty index would mean no rows, not all)
                rows.setdefault(name, []).append((start, start + n))
            start += n
        if not rows:
            return None
        groups: list[tuple[LoRAAdapter, slice | torch.Tensor | None]] = []
        for name, spans in rows.items():
            if spans == [(0, start)]:
                groups.append((self.adapters[name], None))
            elif all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1)):
                groups.append((self.adapters[name], slice(spans[0][0], spans[-1][1])))
            else:
                index = [r for s, e in spans for r in range(s, e)]
                groups.append((self.adapters[name], torch.tensor(index, dtype=torch.long, device=self.device)))
        return LoRABatch(groups)


def load_adapters(values: Sequence[str], model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> LoRAs:
    """The adapters of ``--lora-modules`` (none is an empty registry: adapters may be loaded later), logged."""
    adapters = [load_adapter(spec, model, dtype, device) for spec in parse_lora_modules(values)]
    if adapters:
        logger.info("LoRA adapters: %s", "; ".join(a.describe() for a in adapters))
    return LoRAs(adapters, device)
