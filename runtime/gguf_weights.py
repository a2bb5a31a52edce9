"""The weights of a GGUF file under their HF names, blocks kept as they are.

``iter_gguf_weights(path, config)`` yields ``(hf_name, tensor)`` like ``weights.iter_weights`` does for safetensors:
a ``torch.Tensor`` for float tensors (F32, F16, BF16) and a ``quant.QuantTensor`` for Q8_0, Q4_0 and Q4_1, whose
blocks the engine computes with directly. Q5_0, Q5_1, Q4_K, Q5_K and Q6_K stay as they are where the packed kernel
serves them (AVX-512 VNNI or AVX2); elsewhere Q4_K's sub-blocks become Q4_1 blocks and Q5_0 blocks become Q8_0
blocks of exactly the same weights (``k_quants``). Other block types (IQ types, Q2_K, Q3_K, and Q5_1, Q5_K and
Q6_K without the packed kernel) are dequantized with gguf-py and re-quantized to Q8_0: 8.5 bits a weight, an error
far below theirs, and still a quarter of float32. q and k rows come back in HF's rotary layout (GGUF stores
llama.cpp's). Every tensor is copied out of the memory-mapped file, so the mapping can be dropped once loading is
done and only the engine's copy stays resident.
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from radixserve.runtime.gguf_file import GGUFFile, ggml_type
from radixserve.runtime.k_quants import q4_k_to_q4_1, q5_0_to_q8_0
from radixserve.runtime.models.quant import ROW_KERNEL_TYPES, QuantTensor, packed_types, quantize_q8_0, weight_block

logger = logging.getLogger("radixserve.model")

_LAYER_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_FLOAT_TYPES = ("F32", "F16", "BF16")
# Block types rewritten as a kernel's type with the same quants where they are not served as they are.
_REBLOCK = {"Q4_K": ("Q4_1", q4_k_to_q4_1), "Q5_0": ("Q8_0", q5_0_to_q8_0)}


def hf_name(gguf_name: str) -> str | None:
    """The HF parameter name of a GGUF tensor of the llama family, or None for tensors the engine has no use for
    (e.g. ``rope_freqs``, which the config's rope scaling already describes)."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def _unpermute(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows of q or k from llama.cpp's interleaved rotary pairs back to HF's rotate-half halves (whole rows move,
    so the blocks of a quantized weight move with them)."""
    n = rows.shape[0]
    head_dim = n // n_head
    return rows.reshape(n_head, head_dim // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def iter_gguf_weights(
    path: Path, config: Any, *, keep_quantized: bool = True, progress: bool = True
) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
    """Yield the file's tensors as ``(hf_name, tensor)``; with ``keep_quantized=False`` every weight comes out as
    float32 (the exact dequantization, for parity checks and for layers that cannot use the block kernels)."""
    reader = GGUFFile(path)
    # llama.cpp interleaves q/k rows for its rotary pairs in the "llama" architecture (Mistral's files are "llama"
    # too) only; a "qwen2" file keeps HF's rows, as transformers reads it (its LlamaTensorProcessor).
    permuted = reader.metadata.get("general.architecture", "llama") == "llama"
    n_head = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_head
    requantized = 0
    reblocked: dict[str, int] = {}  # "Q4_K as Q4_1": tensors
    with tqdm(total=len(reader.tensors), desc="Loading weights", unit="tensor", file=sys.stderr,
              disable=not progress, dynamic_ncols=True) as bar:  # fmt: skip
        for t in reader.tensors:
            name = hf_name(t.name)
            bar.update(1)
            if name is None:
                continue
            qtype = ggml_type(t.tensor_type)[0]
            shape = t.shape
            raw = reader.data(t).reshape(shape[0] if len(shape) > 1 else 1, -1)
            if qtype in _FLOAT_TYPES:
                value: torch.Tensor | QuantTensor = _float_tensor(raw, qtype).reshape(shape)
            elif len(shape) == 2 and keep_quantized and _served_as_is(qtype, shape[1]):
                value = QuantTensor(qtype, _view(raw), shape, mapped=True)  # type: ignore[arg-type]
            elif len(shape) == 2 and keep_quantized and qtype in _REBLOCK:
                to, rewrite = _REBLOCK[qtype]
                value = QuantTensor(to, torch.from_numpy(rewrite(raw)), shape)  # type: ignore[arg-type]
                key = f"{qtype} as {to}"
                reblocked[key] = reblocked.get(key, 0) + 1
            else:
                from gguf.quants import dequantize  # only for block types the kernels do not take

                dense = torch.from_numpy(dequantize(raw, t.tensor_type).astype(np.float32)).reshape(shape)
                if len(shape) == 2 and keep_quantized and shape[1] % 32 == 0:
                    value, requantized = quantize_q8_0(dense), requantized + 1
                else:
                    value = dense
            if permuted and t.name.startswith("blk.") and t.name.endswith(("attn_q.weight", "attn_k.weight")):
                heads = n_head if "attn_q" in t.name else n_kv
                value = value.rows(_order(shape[0], heads)) if isinstance(value, QuantTensor) else _unpermute(
                    value, heads
                )
            yield name, value
    if reblocked:
        counts = ", ".join(f"{n} {kind}" for kind, n in reblocked.items())
        logger.info("re-blocked GGUF tensors: %s (the same quants, docs/quantization.md)", counts)
    if requantized:
        logger.info("re-quantized %d GGUF tensors of other block types to Q8_0 (docs/quantization.md)", requantized)
    # Drops the memory map once no view of it is left: the loader packs or copies each weight as it comes
    # (QuantTensor.owned), so only a caller that still holds a yielded weight keeps it mapped.
    reader.close()


def _view(raw: np.ndarray) -> torch.Tensor:
    """A tensor over the map's bytes, not a copy: the packed kernel repacks them into a buffer of its own (reading
    the file once), and a weight kept as it is copies them then (``QuantTensor.owned``)."""
    with warnings.catch_warnings():  # the map is read-only; nothing writes through this view
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(raw)


def _served_as_is(qtype: str, k: int) -> bool:
    """Whether the kernels compute with this block type directly (the 5-bit types and the K-quants: only the
    packed kernel does)."""
    if qtype in ROW_KERNEL_TYPES:
        return True
    return qtype in packed_types() and k % weight_block(qtype) == 0


def _order(n: int, n_head: int) -> torch.Tensor:
    """Row order that ``_unpermute`` applies, as an index (for quantized rows)."""
    return _unpermute(torch.arange(n), n_head)


def _float_tensor(raw: np.ndarray, qtype: str) -> torch.Tensor:
    """A copy of a float tensor's bytes out of the map (the map is dropped after loading)."""
    view = {"F32": np.float32, "F16": np.float16, "BF16": np.int16}[qtype]
    tensor = torch.from_numpy(raw.view(view).copy())
    return tensor.view(torch.bfloat16) if qtype == "BF16" else tensor  # numpy has no bfloat16: the raw words
