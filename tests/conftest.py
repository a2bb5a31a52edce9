"""Shared fixtures: tiny random-weight models built once per session, and the engine over them.

Engines in the tests compute in float32 unless a test asks for another dtype: ``--dtype auto`` picks bfloat16 on
CPUs with bf16 matrix instructions, and the tests that compare greedy output with HF (or across runs) must not
depend on which CPU runs them. Subprocesses (the CLI) get the same through ``RADIXSERVE_DTYPE``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from radixserve.runtime import loader
from tests.tiny_model import make_tiny_model


@pytest.fixture(scope="session", autouse=True)
def _float32_by_default() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loader, "NATIVE_BF16_FLAGS", ())
        mp.setenv("RADIXSERVE_DTYPE", os.environ.get("RADIXSERVE_DTYPE", "float32"))
        yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), num_layers=2, hidden=64, heads=4, kv_heads=2)


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2", tie=False, seed=1)


@pytest.fixture(scope="session")
def hf_smollm2() -> object:
    """transformers' own float32 model of the built-in SmolLM2 GGUF, read by its GGUF loader (the reference the
    parity tests compare with). Loaded once: transformers parses the GGUF's 49K-entry vocabulary in Python (~40 s)."""
    from transformers import AutoModelForCausalLM

    from radixserve.runtime.model_source import resolve_model

    folder = resolve_model("smollm2-135m-instruct")
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf", dtype=torch.float32).eval()
