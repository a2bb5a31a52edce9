"""Turn an ``EngineConfig`` into a loaded model, its tokenizer and its stopping tokens."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from radixserve.runtime.classifier_head import HeadCapture
from radixserve.runtime.config import EngineConfig
from radixserve.runtime.cpu_features import NATIVE_BF16_FLAGS, cpu_flags
from radixserve.runtime.gguf_convert import WEIGHTS_FILE
from radixserve.runtime.gguf_weights import iter_gguf_weights
from radixserve.runtime.json_file import read_json_object
from radixserve.runtime.model_source import model_folder, tokenizer_folder
from radixserve.runtime.models.families import renamer
from radixserve.runtime.models.linear import LoadPacker, onednn_usable, plain_bf16_weights, prepack
from radixserve.runtime.models.llama import LlamaForCausalLM, ModelArgs, RMSNorm
from radixserve.runtime.models.loading import MergedRows, StagingPool
from radixserve.runtime.models.quant import QUANTIZERS, QuantParts
from radixserve.runtime.pooling import PoolingModel, is_classifier, read_pooling, serves_embeddings
from radixserve.runtime.quantized_checkpoint import QuantSpec, iter_quantized_weights
from radixserve.runtime.safetensors_read import READ_AHEAD_BYTES, Destination, Select
from radixserve.runtime.threads import one_intra_op_thread
from radixserve.runtime.weights import iter_weights, load_hf_config, load_tokenizer

if TYPE_CHECKING:
    from radixserve.runtime.distributed.shard import ShardCuts

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
    load_seconds: float = 0.0  # building the model, reading and packing its weights (not the tokenizer)
    pooling: PoolingModel | None = None  # --runner pooling: the embeddings it serves (None: it generates)
    classifier: torch.Tensor | None = None  # a classifier's head, [outputs, hidden] float32 (runtime.classifier_head)


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
        # bfloat16 halves the bytes a decode step reads, but without bf16 matrix instructions every product
        # converts to float32 first and is slower than float32 itself: bfloat16 only where the CPU has them.
        native = [f for f in NATIVE_BF16_FLAGS if f in cpu_flags()]
        dtype = torch.bfloat16 if native else torch.float32
        logger.info(
            "--dtype auto: %s (%s)",
            str(dtype).removeprefix("torch."),
            f"the CPU has {', '.join(native)}" if native else "the CPU has no bfloat16 matrix instructions",
        )
        return dtype
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
        eos = read_json_object(gen_path).get("eos_token_id")  # (a ValueError naming the file if it is broken)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(x) for x in eos)
    return ids


def model_config(config: EngineConfig, folder: Path) -> Any:
    """The model's config.json (``load_hf_config``) with ``--hf-overrides`` merged in."""
    hf_config = load_hf_config(folder)
    for key, value in config.overrides().items():
        setattr(hf_config, key, value)
    return hf_config


def build_model(args: ModelArgs, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """The model on the meta device, its parameters typed ``dtype``, for ``load_weights(..., device)``, which
    creates each one from its checkpoint tensor: no random initialization (seconds for a real model), no float32
    copy on the way to a bfloat16 model, nothing allocated twice. The rotary tables, which no checkpoint holds, are
    computed on ``device`` now."""
    with torch.device("meta"):
        model = LlamaForCausalLM(args, dtype=dtype)
    model = model.to(dtype).eval()
    for rope in model.model.rotaries():
        rope.reset_tables(dtype, device)
    return model


def dummy_weights(model: LlamaForCausalLM, device: torch.device, seed: int, std: float = 0.02) -> None:
    """``--load-format dummy``: every parameter of the meta-device model created on ``device`` in its dtype, as
    at initialization (normal with ``std``; norm weights 1, biases 0), with no checkpoint read. Speed depends on
    the shapes, not the values."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            t = torch.empty(param.shape, dtype=param.dtype, device=device)
            if isinstance(module, RMSNorm):
                t.fill_(1.0)
            elif name == "bias":
                t.zero_()
            else:
                t.normal_(0.0, std, generator=gen)
            setattr(module, name, torch.nn.Parameter(t, requires_grad=False))
    model.tie_weights()


def model_weights(
    folder: Path,
    hf_config: Any,
    config: EngineConfig,
    device: torch.device,
    into: Destination | None = None,
    select: Select | None = None,
    capture: HeadCapture | None = None,
) -> Iterator[Any]:
    """The checkpoint's tensors, in the weight format ``--quantization`` asks for (see ``EngineConfig``); a
    safetensors checkpoint served dense is read where ``into`` says (``MergedRows``), and only the part of each
    tensor ``select`` names (a tensor-parallel rank's shard). ``capture`` takes a classifier's head from the
    stream, before any ``--quantization`` rounds it.

    Blocks are served by the CPU kernels of a single-process model only: on a GPU or under tensor parallelism the
    weights are dense (dequantized exactly)."""
    blocks_ok = device.type == "cpu" and config.tp == 1
    gguf = folder / WEIGHTS_FILE
    if gguf.is_file():
        keep = blocks_ok and config.quantization != "none"
        if config.quantization != "none" and not keep:
            logger.info("GGUF blocks are served on one CPU process only: dequantizing %s", gguf.name)
        weights = iter_gguf_weights(gguf, hf_config, keep_quantized=keep)
    elif (prequantized := QuantSpec.from_hf_config(hf_config)) is not None:
        # Read whole (the parts of a layer are not the model's tensors): a rank's cut, if any, follows the load.
        raw = iter_weights(folder, ahead=READ_AHEAD_BYTES // config.tp)
        weights = iter_quantized_weights(raw, prequantized, blocks=blocks_ok and config.quantization == "auto")
    else:
        dense = config.quantization in ("auto", "none")
        # The ranks of one machine read at once: each keeps its share of the read-ahead.
        ahead = READ_AHEAD_BYTES // config.tp
        mapped = into.maps if dense and isinstance(into, MergedRows) else None
        weights = iter_weights(folder, into=into if dense else None, select=select, ahead=ahead, mapped=mapped)
    if capture is not None:
        weights = capture.capture(weights)
    target = {"int8": "Q8_0", "int4": "Q4_1"}.get(config.quantization)
    if target is None or not blocks_ok:
        if target is not None:
            logger.warning("--quantization %s applies on one CPU process only; loading dense weights", target)
        return weights
    return _quantized(weights, target)


def _shard_select(cuts: ShardCuts, rename: Callable[[str], str]) -> Select:
    """The reader's ``select`` for a rank: its cut of each checkpoint tensor, by the decoder's name."""

    def select(name: str, _dtype: torch.dtype, shape: list[int]) -> Any:
        return cuts.select(rename(name), shape)

    return select


def _quantized(weights: Iterator[tuple[str, Any]], qtype: str) -> Iterator[tuple[str, Any]]:
    """Linear and embedding weights (2-D, input size a multiple of 32) as ``qtype`` blocks; the rest as it is."""
    for name, tensor in weights:
        if isinstance(tensor, torch.Tensor) and tensor.dim() == 2 and tensor.shape[1] % 32 == 0:
            yield name, QUANTIZERS[qtype](tensor)
        else:
            yield name, tensor


def describe_weights(model: torch.nn.Module, dtype: torch.dtype) -> str:
    """What is served, for the model card line: per weight format, how many tensors and their bytes."""
    formats: dict[str, list[int]] = {}
    seen: set[int] = set()
    for module in model.modules():
        q = getattr(module, "quant", None)
        parts = (q.parts if isinstance(q, QuantParts) else (q,)) if q is not None else ()
        tensors = [("blocks " + p.qtype, p.data) for p in parts]
        tensors += [(str(p.dtype).removeprefix("torch."), p) for p in module.parameters(recurse=False)]
        tensors += [(str(p.dtype).removeprefix("torch."), p) for p in getattr(module, "_plain_parts", ())]
        for kind, t in tensors:
            # A meta weight was released for its packed copy, which has its bytes (and is this module's own), or
            # stands for its parts (counted as themselves), or for the tied head's packed copy it reads (counted
            # with the head).
            elsewhere = getattr(module, "_plain_parts", ()) or getattr(module, "_bf16_rows", None) is not None
            if t.device.type == "meta" and elsewhere:
                continue
            key = id(t) if t.device.type == "meta" else t.data_ptr()
            if key in seen:
                continue
            seen.add(key)
            if t.device.type == "meta":
                kind += " packed"
            entry = formats.setdefault(kind, [0, 0])
            entry[0] += 1
            entry[1] += t.nbytes
    total = sum(b for _, b in formats.values())
    parts = ", ".join(f"{n} {kind} tensors {b / 2**20:.1f} MiB" for kind, (n, b) in sorted(formats.items()))
    return f"activations {str(dtype).removeprefix('torch.')}, weights {total / 2**20:.1f} MiB ({parts})"


def return_freed_heap() -> None:
    """Hand the heap that loading freed back to the OS (glibc's ``malloc_trim``; a no-op elsewhere).

    Loading frees what it made on the way (float32 copies of re-quantized GGUF tensors, read buffers), and glibc
    keeps such pages mapped for later use: they stayed resident as the engine's. SmolLM2-135M in ``Q5_K_M`` (16
    Q5_K tensors re-quantized through float32): 213 MiB more resident after loading, 165 MiB once trimmed.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def load_model(
    config: EngineConfig,
    *,
    lean_tokenizer: bool = False,
    shard: Callable[[LlamaForCausalLM], ShardCuts] | None = None,
) -> LoadedModel:
    """Build the model on the meta device, let ``shard`` (tensor parallelism) cut it down to one rank's shard
    and return the cuts the checkpoint's tensors need (read as cut from safetensors; cut after reading from a
    GGUF file), load the weights one tensor at a time, then pack them for the CPU kernels (``prepack``: the plain
    copy goes, layer by layer, unless --keep-plain-weights)."""
    start = time.perf_counter()
    folder = model_folder(config)
    hf_config = model_config(config, folder)
    args = ModelArgs.from_hf_config(hf_config)
    tokenizer = load_tokenizer(tokenizer_folder(config, folder), lean=lean_tokenizer)
    pooling, capture = None, None
    if serves_embeddings(config.runner, folder, hf_config):
        pooling = read_pooling(folder, hf_config, tokenizer)
        if pooling.labels is not None:  # a classifier's head is taken from the checkpoint as it streams by
            capture = HeadCapture(pooling.default, len(pooling.labels), args.hidden_size, args.tie_word_embeddings)
        # The vocabulary's head is never read: it is the embedding's (tied), and a head the checkpoint has is skipped.
        args = dataclasses.replace(args, tie_word_embeddings=True)
        served = "scores" if pooling.labels is not None else "embeddings"
        logger.info("serving %s (--runner pooling): %s", served, pooling.describe())
    elif is_classifier(hf_config):
        raise ValueError(
            f"{hf_config.architectures[0]} is a sequence classifier: it scores and generates no text; serve it with "
            "--runner pooling (or auto)"
        )
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device, hf_config)
    load_start = time.perf_counter()
    with one_intra_op_thread():
        model = build_model(args, dtype, device)
        rename = renamer(args.architecture)
        cuts = shard(model) if shard is not None else None
        select = _shard_select(cuts, rename) if cuts is not None else None
        into, staging = None, None
        # Plain weights are packed for oneDNN as they arrive, where oneDNN serves this dtype (see linear.py).
        packs = device.type == "cpu" and not config.keep_plain_weights and onednn_usable(dtype)
        if device.type == "cpu":
            staging = StagingPool() if packs else None
            # Weights served as stored are mapped from the file, not read (safetensors_read).
            mapping = dtype == torch.bfloat16 and plain_bf16_weights() and cuts is None
            into = MergedRows(model, dtype, rename, staging, map_weights=mapping)
        if config.load_format == "dummy":
            if cuts is not None:
                raise ValueError("--load-format dummy runs on one process (no tensor parallelism)")
            dummy_weights(model, device, config.seed)
            if capture is not None:
                capture.dummy(config.seed)
        else:
            weights = model_weights(folder, hf_config, config, device, into, select, capture)
            cut = cuts.cut if cuts is not None else None
            packer = LoadPacker(staging=staging) if packs else None
            try:
                model.load_weights(weights, device=device, on_weight=packer, transform=cut)
            finally:
                if packer is not None:
                    packer.finish()
        prepack(model, keep_plain=config.keep_plain_weights)  # what is left: a tied head, --keep-plain-weights
    if device.type == "cpu":
        return_freed_heap()
    load_seconds = time.perf_counter() - load_start
    logger.info(
        "loaded %s (%s, %d layers) on %s in %.1fs: %s",
        config.model,
        args.architecture,
        args.num_layers,
        device,
        time.perf_counter() - start,
        describe_weights(model, dtype),
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
        load_seconds=load_seconds,
        pooling=pooling,
        classifier=capture.head(device) if capture is not None else None,
    )
