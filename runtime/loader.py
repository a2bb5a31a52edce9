"""Turn an ``EngineConfig`` into a loaded model, its tokenizer and its stopping tokens."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runtime.config import EngineConfig
from runtime.model_source import resolve_model
from runtime.models.linear import prepack
from runtime.models.llama import LlamaForCausalLM, ModelArgs
from runtime.threads import one_intra_op_thread
from runtime.weights import iter_weights, load_hf_config, load_tokenizer

logger = logging.getLogger("radixserve.model")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    args: ModelArgs
    tokenizer: Any
    folder: Path
    dtype: torch.dtype
    device: torch.device
    eos_token_ids: set[int]
    name: str


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {spec} was asked for but CUDA is not available; use --device cpu")
    return device


def resolve_dtype(spec: str, device: torch.device, hf_config: Any) -> torch.dtype:
    if spec != "auto":
        return DTYPES[spec]
    if device.type == "cpu":
        # Exact on every CPU; bfloat16 is faster only where the CPU has native bf16 matmuls (opt in).
        return torch.float32
    declared = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
    if declared in (torch.float16, "float16"):
        return torch.float16
    return torch.bfloat16


def _eos_ids(folder: Path, hf_config: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(x) for x in source)
    gen_path = folder / "generation_config.json"
    if gen_path.exists():
        import json

        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(x) for x in eos)
    return ids


def build_model(args: ModelArgs, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """The model with uninitialized parameters of ``dtype`` on ``device``, ready for ``load_weights``.

    Built on the meta device and then given storage: no random initialization (seconds for a real model) and no
    float32 copy on the way to a bfloat16 model; the rotary tables, which no checkpoint holds, are computed."""
    with torch.device("meta"):
        model = LlamaForCausalLM(args, dtype=dtype)
    model = model.to(dtype).to_empty(device=device).eval()
    model.model.rope.reset_tables(dtype)
    model.tie_weights()
    return model


def load_model(config: EngineConfig) -> LoadedModel:
    start = time.perf_counter()
    folder = resolve_model(config.model)
    hf_config = load_hf_config(folder)
    args = ModelArgs.from_hf_config(hf_config)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device, hf_config)
    tokenizer = load_tokenizer(folder)
    with one_intra_op_thread():
        model = build_model(args, dtype, device)
        model.load_weights(iter_weights(folder))
        prepack(model)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "loaded %s (%s, %d layers) as %s on %s: %.1fM parameters in %.1fs",
        config.model,
        args.architecture,
        args.num_layers,
        str(dtype).removeprefix("torch."),
        device,
        n_params / 1e6,
        time.perf_counter() - start,
    )
    return LoadedModel(
        model=model,
        args=args,
        tokenizer=tokenizer,
        folder=folder,
        dtype=dtype,
        device=device,
        eos_token_ids=_eos_ids(folder, hf_config, tokenizer),
        name=config.model,
    )
