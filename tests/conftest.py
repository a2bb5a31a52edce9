"""Shared fixtures: tiny random-weight models built once per session, and the engine over them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), num_layers=2, hidden=64, heads=4, kv_heads=2)


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2", tie=False, seed=1)
