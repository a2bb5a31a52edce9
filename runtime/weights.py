"""Reading a resolved HF-style model folder: its config, its tokenizer, and its safetensors weights.

The folder is what ``runtime.model_source.resolve_model`` returns: ``config.json``, one or more
``*.safetensors`` files and the tokenizer files. Weights come out under their HF parameter names
(``model.embed_tokens.weight``, ``model.layers.N.self_attn.q_proj.weight``, ...); ``lm_head.weight`` is
absent when the checkpoint ties it to the embeddings, and the consumer must handle that.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from tqdm import tqdm

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase


def safetensors_files(folder: Path) -> list[Path]:
    """The folder's ``*.safetensors`` files in a stable (sorted) order; ValueError when there are none."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"model folder {folder} does not exist or is not a directory")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"model folder {folder} has no *.safetensors file; convert the checkpoint to safetensors "
            "(save_pretrained(..., safe_serialization=True)) or pass a .gguf file instead"
        )
    return files


def count_tensors(folder: Path) -> int:
    """How many tensors ``iter_weights(folder)`` yields (reads only the safetensors headers)."""
    total = 0
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            total += len(list(f.keys()))
    return total


def iter_weights(folder: Path, *, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, cpu_tensor)`` for every tensor of every ``*.safetensors`` file in ``folder``.

    Invariants: each name is yielded exactly once (a name present in two files raises ValueError, since a
    silent overwrite would load the wrong weights); tensors keep the dtype they were stored in (casting is
    the consumer's job); files are read in sorted order, tensors in each file's key order. A tqdm bar
    ("Loading weights") on stderr counts tensors unless ``progress`` is False.
    """
    files = safetensors_files(folder)
    seen: dict[str, Path] = {}
    with tqdm(total=count_tensors(folder), desc="Loading weights", unit="tensor", file=sys.stderr,
              disable=not progress, dynamic_ncols=True) as bar:
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                    if name in seen:
                        raise ValueError(
                            f"tensor {name!r} appears in both {seen[name].name} and {file.name}; "
                            "remove the stale safetensors file from the model folder"
                        )
                    seen[name] = file
                    yield name, f.get_tensor(name)
                    bar.update(1)


def load_hf_config(folder: Path) -> PretrainedConfig:
    """The folder's ``config.json`` as a transformers config (architecture-specific class)."""
    from transformers import AutoConfig

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ValueError(f"model folder {folder} has no config.json")
    return AutoConfig.from_pretrained(str(folder))


def load_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """The folder's fast (Rust ``tokenizers``) tokenizer; ValueError when only a slow one is available.

    The engine relies on the fast tokenizer for offsets and incremental detokenization speed.
    """
    from transformers import AutoTokenizer

    folder = Path(folder)
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
        raise ValueError(f"model folder {folder} has no tokenizer.json / tokenizer_config.json")
    tokenizer = AutoTokenizer.from_pretrained(str(folder), use_fast=True)
    if not tokenizer.is_fast:
        raise ValueError(
            f"the tokenizer in {folder} is not a fast tokenizer; add a tokenizer.json "
            "(e.g. save it once with transformers' PreTrainedTokenizerFast)"
        )
    return tokenizer
