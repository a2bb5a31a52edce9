"""Reading a resolved HF-style model folder: its config, its tokenizer, and its safetensors weights.

The folder is what ``runtime.model_source.resolve_model`` returns: ``config.json``, one or more
``*.safetensors`` files and the tokenizer files. Weights come out under their HF parameter names
(``model.embed_tokens.weight``, ``model.layers.N.self_attn.q_proj.weight``, ...); ``lm_head.weight`` is
absent when the checkpoint ties it to the embeddings, and the consumer must handle that.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from radixserve.runtime.json_file import read_json_object
from radixserve.runtime.lean_tokenizer import LeanTokenizer

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from radixserve.runtime.safetensors_read import Destination, Mapped, Select


def safetensors_files(folder: Path) -> list[Path]:
    """The folder's weight files in a stable (sorted) order: those ``model.safetensors.index.json`` lists where
    there is one (Mistral's repositories hold a ``consolidated.safetensors`` of the same weights in their own
    names beside the HF shards), else every ``*.safetensors``; ValueError when there are none."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"model folder {folder} does not exist or is not a directory")
    files = sorted(folder.glob("*.safetensors"))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        listed = set(read_json_object(index).get("weight_map", {}).values())
        missing = sorted(name for name in listed if not (folder / name).is_file())
        if missing:
            raise ValueError(f"{index} lists {missing[0]}, which is not in the folder (an incomplete download?)")
        files = [f for f in files if f.name in listed]
    if not files:
        raise ValueError(
            f"model folder {folder} has no *.safetensors file; convert the checkpoint to safetensors "
            "(save_pretrained(..., safe_serialization=True)) or pass a .gguf file instead"
        )
    return files


def count_tensors(folder: Path) -> int:
    """How many tensors ``iter_weights(folder)`` yields (reads only the safetensors headers)."""
    from radixserve.runtime.safetensors_read import read_header

    total = 0
    for file in safetensors_files(folder):
        total += len(read_header(file)[0])
    return total


def iter_weights(
    folder: Path,
    *,
    progress: bool = True,
    into: Destination | None = None,
    select: Select | None = None,
    ahead: int | None = None,
    mapped: Mapped | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, cpu_tensor)`` for every tensor of every ``*.safetensors`` file in ``folder``.

    Invariants: each name is yielded exactly once (a name present in two files raises ValueError, since a
    silent overwrite would load the wrong weights); tensors keep the dtype they were stored in (casting is
    the consumer's job); files are read in sorted order, tensors in each file's key order, each into memory of its
    own (``runtime.safetensors_read``: no memory map keeps the file resident), or where ``into`` says (the loader
    reads the parts of a merged projection into its rows), only the part ``select`` names (a tensor-parallel rank's
    shard: the tensor comes out cut), or, a whole tensor ``mapped`` names, as a view of the file's map, up to
    ``ahead`` bytes ahead on a reader thread (default
    ``safetensors_read.READ_AHEAD_BYTES``). A tqdm bar ("Loading weights") on stderr counts tensors unless
    ``progress`` is False.
    """
    # Imported here: it imports torch, which the front-end process (it only tokenizes) never needs.
    from radixserve.runtime.safetensors_read import READ_AHEAD_BYTES, iter_file, read_ahead

    ahead = READ_AHEAD_BYTES if ahead is None else ahead
    files = safetensors_files(folder)
    seen: dict[str, Path] = {}
    with tqdm(
        total=count_tensors(folder),
        desc="Loading weights",
        unit="tensor",
        file=sys.stderr,
        disable=not progress,
        dynamic_ncols=True,
    ) as bar:
        for file in files:
            for name, tensor in read_ahead(iter_file(file, into, select, mapped), ahead):
                if name in seen:
                    raise ValueError(
                        f"tensor {name!r} appears in both {seen[name].name} and {file.name}; "
                        "remove the stale safetensors file from the model folder"
                    )
                seen[name] = file
                yield name, tensor
                bar.update(1)


# What transformers' config classes fill in when config.json leaves a field out, per model_type (only the fields
# the engine reads). Real checkpoints spell nearly everything out; tiny test configs and old exports may not.
_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "rope_theta": 10000.0, "vocab_size": 32000},
    "mistral": {
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096 * 32,
        "rope_theta": 10000.0,
        "vocab_size": 32000,
        "sliding_window": 4096,
    },
    "qwen2": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "rope_theta": 10000.0, "vocab_size": 151936},
    "qwen3": {
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "rope_theta": 10000.0,
        "vocab_size": 151936,
        "head_dim": 128,
    },
    "qwen3_moe": {
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "rope_theta": 10000.0,
        "vocab_size": 151936,
        "head_dim": 128,
        "decoder_sparse_step": 1,
        "norm_topk_prob": False,
        "mlp_only_layers": [],
    },
    "phi3": {
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "vocab_size": 32064,
    },
    "gemma2": {
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 8192,
        "rope_theta": 10000.0,
        "vocab_size": 256000,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "sliding_window": 4096,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
    },
    "gemma3_text": {
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131072,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10000.0,
        "vocab_size": 262208,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
    },
}
_COMMON_DEFAULTS: dict[str, Any] = {
    "tie_word_embeddings": False,
    "attention_bias": False,
    "rope_scaling": None,
    "head_dim": None,
    "num_key_value_heads": None,
}


def load_hf_config(folder: Path) -> SimpleNamespace:
    """The folder's ``config.json`` as attributes, with the defaults transformers would fill in for the fields the
    engine reads. Read as plain JSON: importing transformers' config classes costs seconds at every start."""
    folder = Path(folder)
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"model folder {folder} has no config.json")
    raw = read_json_object(path)
    fields = {**_COMMON_DEFAULTS, **_CONFIG_DEFAULTS.get(str(raw.get("model_type", "")), {}), **raw}
    return SimpleNamespace(**fields)


# Loading a tokenizer through AutoTokenizer first imports transformers' model-config machinery (~2-4 s at every
# start). Where AutoTokenizer would build the generic fast tokenizer anyway (transformers >= 5, a model type that
# maps to no tokenizer class of its own, a generic tokenizer_class), it is loaded directly from tokenizer.json.
# Other model types (Qwen2's and Gemma's tokenizer classes rebuild parts of the pipeline) keep AutoTokenizer.
_GENERIC_TOKENIZER_MODEL_TYPES = frozenset({"llama", "mistral"})
_GENERIC_TOKENIZER_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})


def load_tokenizer(folder: Path, *, lean: bool = False) -> PreTrainedTokenizerBase:
    """The folder's fast (Rust ``tokenizers``) tokenizer; ValueError when only a slow one is available.

    The engine relies on the fast tokenizer for offsets and incremental detokenization speed. ``lean``: where it
    decodes the same, a ``LeanTokenizer`` (no transformers import; the engine process's choice).
    """
    folder = Path(folder)
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
        raise ValueError(f"model folder {folder} has no tokenizer.json / tokenizer_config.json")
    generic = _generic_fast_tokenizer(folder)
    lean_tokenizer = LeanTokenizer.load(folder) if lean and generic else None
    if lean_tokenizer is not None:
        return lean_tokenizer  # type: ignore[return-value]
    if generic:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), use_fast=True)
    if not tokenizer.is_fast:
        raise ValueError(
            f"the tokenizer in {folder} is not a fast tokenizer; add a tokenizer.json "
            "(e.g. save it once with transformers' PreTrainedTokenizerFast)"
        )
    return tokenizer


def _transformers_major() -> int:
    """transformers' major version, from the ``Version:`` line of its installed metadata without importing it
    (``importlib.metadata.version`` parses the whole file as e-mail headers: 0.11 s of every engine start)."""
    from importlib.metadata import distribution

    text = distribution("transformers").read_text("METADATA") or ""
    for line in text.splitlines():
        if line.startswith("Version:"):
            return int(line.split(":", 1)[1].strip().split(".")[0])
    return 0


def _generic_fast_tokenizer(folder: Path) -> bool:
    if not (folder / "tokenizer.json").is_file() or _transformers_major() < 5:
        return False
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        tok_config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return (
        isinstance(config, dict)
        and isinstance(tok_config, dict)
        and config.get("model_type") in _GENERIC_TOKENIZER_MODEL_TYPES
        and tok_config.get("tokenizer_class") in _GENERIC_TOKENIZER_CLASSES
    )
