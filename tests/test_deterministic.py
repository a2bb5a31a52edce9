"""``--enable-deterministic-inference``: a token's numbers do not depend on how its prompt was split into prefill
chunks, on what the radix cache held, or on what ran beside it. Compared bit for bit through the log-probabilities
of greedy tokens, float32, on a tiny random model: the same prompt computed whole, after half of it was cached, in
16-token chunks, and beside other requests. The weights are served as Q8_0 blocks, as the built-in model's are: the
block kernel computes each row on its own (plain float32 weights go through oneDNN / MKL, whose results for one to
three rows can differ from the same rows in a larger batch), and its int8 rounding of the activations is what turns
a last-bit difference into a different token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixserve.runtime.attention import attention_backend
from radixserve.runtime.engine import Engine
from radixserve.runtime.sampling_params import SamplingParams
from tests.tiny_model import make_tiny_model

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, return_logprob=True)
ONE = SamplingParams(max_new_tokens=1, temperature=0.0)


def _run(engine: Engine, ids: list[int]) -> list[tuple[int, float]]:
    out = engine.generate(input_ids=ids, sampling_params=GREEDY)
    return [(t.token_id, t.logprob) for t in out["meta_info"]["output_token_logprobs"]]


def _prompts(engine: Engine) -> list[list[int]]:
    texts = [
        "The history of the printing press begins in the fifteenth century, when movable type " * 3,
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 2,
        "Records: name=Ada, year=1815; name=Alan, year=1912; name=Grace, year=1906. The record of Alan is",
    ]
    return [engine.tokenizer.encode(t) for t in texts]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_tokens_numbers_do_not_depend_on_chunks_cache_or_batch(tmp_path: Path, arch: str) -> None:
    # gemma3: sliding-window layers and a query scale (the layers with options) take the same rows.
    options = {"config_overrides": {"sliding_window": 16}} if arch == "gemma3" else {}
    folder = make_tiny_model(tmp_path / arch, arch=arch, num_layers=2, seed=5, **options)
    common = dict(model=str(folder), device="cpu", dtype="float32", quantization="int8", max_total_tokens=4096)
    whole_engine = Engine(**common, deterministic_inference=True)
    chunked_engine = Engine(**common, deterministic_inference=True, chunked_prefill_size=16)
    try:
        prompts = _prompts(whole_engine)
        assert all(len(p) > 40 for p in prompts)
        for ids in prompts:
            whole_engine.flush_cache()
            whole = _run(whole_engine, ids)
            whole_engine.flush_cache()
            whole_engine.generate(input_ids=ids[: len(ids) // 2 + 3], sampling_params=ONE)  # cache half of it
            assert _run(whole_engine, ids) == whole
            chunked_engine.flush_cache()
            assert _run(chunked_engine, ids) == whole
        # Beside each other, in one batch, after a flush: the same numbers again.
        whole_engine.flush_cache()
        together = whole_engine.generate(input_ids=prompts, sampling_params=GREEDY)
        for ids, out in zip(prompts, together, strict=True):
            whole_engine.flush_cache()
            got = [(t.token_id, t.logprob) for t in out["meta_info"]["output_token_logprobs"]]
            assert got == _run(whole_engine, ids)
    finally:
        whole_engine.shutdown()
        chunked_engine.shutdown()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_deterministic_attention_computes_what_the_default_path_does(tmp_path: Path, arch: str) -> None:
    """Same numbers as the default attention paths to float32 rounding (plain weights, whose products agree to
    ~1e-6), sliding windows and query scales included."""
    options = {"config_overrides": {"sliding_window": 16}} if arch == "gemma3" else {}
    folder = make_tiny_model(tmp_path / arch, arch=arch, num_layers=2, seed=6, **options)
    common = dict(model=str(folder), device="cpu", dtype="float32", quantization="none", max_total_tokens=4096)
    outs = []
    for deterministic in (False, True):
        engine = Engine(**common, deterministic_inference=deterministic)
        try:
            outs.append([_run(engine, ids) for ids in _prompts(engine)])
        finally:
            engine.shutdown()
    for default, deterministic in zip(*outs, strict=True):
        assert [t for t, _ in default] == [t for t, _ in deterministic]
        assert max(abs(a - b) for (_, a), (_, b) in zip(default, deterministic, strict=True)) < 1e-4


def test_deterministic_inference_is_refused_where_it_cannot_hold() -> None:
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="soft-capping"):
        attention_backend(True, cpu, torch.float32, softcap=50.0)
    with pytest.raises(ValueError, match="--device cpu with --dtype float32 or bfloat16"):
        attention_backend(True, cpu, torch.float16, softcap=None)
    assert attention_backend(True, cpu, torch.float32, softcap=None).deterministic
