"""Decode steps on the compiled stack of layers (runtime/models/decode_stack.py) against the Python layers: the same
kernels in the same order, so the same tokens and the same log-probabilities to the bit."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from radixserve.runtime.engine import Engine
from radixserve.runtime.models import bf16_layout, decode_stack, quant
from radixserve.runtime.models.linear import onednn_usable, plain_bf16_weights
from radixserve.runtime.sampling_params import SamplingParams
from tests.tiny_model import make_tiny_lora, make_tiny_model

GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0, return_logprob=True)
PREFIX = "A shared system prompt that every request repeats before its own question. " * 3
QUESTIONS = ["What is a radix tree?", "Name three colours.", "Count to five:", "Why is the sky blue?"]


def _outputs(engine: Engine) -> list[list[tuple[int, float]]]:
    """Each prompt alone, then all at once (multi-row decode steps over a shared prefix)."""
    prompts = [engine.tokenizer.encode(PREFIX + q) for q in QUESTIONS]
    alone = [engine.generate(input_ids=ids, sampling_params=GREEDY) for ids in prompts]
    engine.flush_cache()
    together = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    return [[(t.token_id, t.logprob) for t in o["meta_info"]["output_token_logprobs"]] for o in alone + together]


def _model(engine: Engine) -> torch.nn.Module:
    return engine.core.runner.model


def _expects_stack(quantization: str) -> bool:
    """Blocks need the packed kernel; plain weights run on oneDNN's packed copy, F.linear or the bfloat16 kernel,
    all of which the stack calls."""
    return quant.packed_ops() is not None if quantization != "none" else True


def _clear_choices() -> None:
    """Forget what was decided under the environment a test changed (decided again when next asked)."""
    onednn_usable.cache_clear()
    plain_bf16_weights.cache_clear()
    bf16_layout.chosen.cache_clear()


@pytest.mark.parametrize(
    ("arch", "dtype", "quantization", "env"),
    [
        ("llama", "float32", "int8", {}),
        ("llama", "float32", "int4", {}),
        ("llama", "bfloat16", "int8", {}),
        ("llama", "float32", "none", {}),  # oneDNN's packed weights
        ("llama", "float32", "none", {"ONEDNN_LINEAR": "0"}),  # plain weights on F.linear
        ("llama", "bfloat16", "none", {}),
        # bfloat16 packed for oneDNN (with AMX, where measured faster); and packed in pairs, steps of three rows or
        # more on oneDNN's GEMM over the unpacked weight (with AMX, prefill chunks): those stay off the stack
        ("llama", "bfloat16", "none", {"BF16_LAYOUT": "onednn"}),
        ("llama", "bfloat16", "none", {"BF16_LAYOUT": "pairs", "BF16_UNPACK_FROM_ROWS": "3"}),
        ("qwen2", "float32", "int8", {}),  # q/k/v biases
        ("qwen2", "float32", "none", {}),
    ],
)
def test_the_stack_gives_the_python_layers_tokens_and_logprobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str, dtype: str, quantization: str, env: dict[str, str]
) -> None:
    folder = make_tiny_model(tmp_path / arch, arch=arch, num_layers=3, seed=11)
    for name, value in env.items():
        monkeypatch.setenv(f"RADIXSERVE_{name}", value)
    _clear_choices()
    try:
        runs = {}
        for stack in ("1", "0"):
            monkeypatch.setenv("RADIXSERVE_DECODE_STACK", stack)
            engine = Engine(
                model=str(folder), device="cpu", dtype=dtype, quantization=quantization, max_total_tokens=2048
            )
            try:
                runs[stack] = _outputs(engine)
                built = _model(engine).__dict__.get("_decode_stack")
                if stack == "1":
                    assert (built is not None) == _expects_stack(quantization)
                    pairs = any(getattr(m, "_bf16_packed", False) for m in _model(engine).modules())
                    if "BF16_UNPACK_FROM_ROWS" in env and pairs:  # (AVX-512 BF16) such steps are the Python layers'
                        assert built[1] == int(env["BF16_UNPACK_FROM_ROWS"]) - 1
                else:
                    assert "_decode_stack" not in _model(engine).__dict__  # never built when off
            finally:
                engine.shutdown()
        assert runs["1"] == runs["0"]
        assert all(len(out) == GREEDY.max_new_tokens for out in runs["1"])
    finally:
        for name in env:
            monkeypatch.delenv(f"RADIXSERVE_{name}", raising=False)
        _clear_choices()  # (decided again under the restored environment)


def test_models_the_stack_does_not_cover_keep_the_python_layers(tmp_path: Path) -> None:
    """Sliding windows and query scales (Gemma 3) are not the stack's: it is not built, and decoding works."""
    folder = make_tiny_model(tmp_path / "g", arch="gemma3", num_layers=2, config_overrides={"sliding_window": 16})
    engine = Engine(model=str(folder), device="cpu", dtype="float32", quantization="int8", max_total_tokens=2048)
    try:
        out = engine.generate(input_ids=engine.tokenizer.encode(PREFIX), sampling_params=GREEDY)
        assert len(out["output_ids"]) == GREEDY.max_new_tokens
        assert _model(engine).__dict__.get("_decode_stack", False) is None
    finally:
        engine.shutdown()


@pytest.mark.skipif(quant.packed_ops() is None, reason="no packed kernel on this CPU: the stack has no int8 op")
def test_a_changed_weight_is_picked_up_after_invalidate(tmp_path: Path) -> None:
    """The stack holds the weight tensors: after ``invalidate`` (the weight mover's swaps) it is built again over
    the new ones; until then ``suspend`` keeps decode steps on the Python layers."""
    folder = make_tiny_model(tmp_path / "m", num_layers=2, seed=3)
    engine = Engine(model=str(folder), device="cpu", dtype="float32", quantization="int8", max_total_tokens=2048)
    try:
        ids = engine.tokenizer.encode(PREFIX)
        first = engine.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]
        model = _model(engine)
        old = model.__dict__["_decode_stack"]
        assert old is not None
        decode_stack.suspend(model)
        assert engine.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"] == first
        assert model.__dict__["_decode_stack"] is None
        decode_stack.invalidate(model)
        assert engine.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"] == first
        assert model.__dict__["_decode_stack"] is not None and model.__dict__["_decode_stack"] is not old
    finally:
        engine.shutdown()


def test_rows_that_share_a_prefix_attend_it_together_on_the_stack_as_in_the_layers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Head size 64 in bfloat16: the prompts' shared 102-token prefix makes a group of decode rows, which the decode
    kernel attends together (where AVX-512 BF16 has the prefix kernel), on the stack and in the Python layers
    alike: the same tokens and log-probabilities to the bit."""
    from radixserve.runtime.attention import cpu_kernels, torch_ref

    grouped_steps = []
    prepare = torch_ref.TorchReferenceBackend.prepare

    def counting(self, meta, pool):  # noqa: ANN001, ANN202
        state = prepare(self, meta, pool)
        grouped_steps.append(state.decode is not None and state.decode.groups is not None)
        return state

    monkeypatch.setattr(torch_ref.TorchReferenceBackend, "prepare", counting)
    folder = make_tiny_model(tmp_path / "m", hidden=128, heads=2, kv_heads=1, num_layers=2, seed=5)
    runs = {}
    for stack in ("1", "0"):
        monkeypatch.setenv("RADIXSERVE_DECODE_STACK", stack)
        engine = Engine(model=str(folder), device="cpu", dtype="bfloat16", quantization="none", max_total_tokens=2048)
        try:
            grouped_steps.clear()
            runs[stack] = _outputs(engine)
            assert any(grouped_steps) == (cpu_kernels.prefix_groups_op() is not None)
        finally:
            engine.shutdown()
    assert runs["1"] == runs["0"]


@pytest.mark.parametrize(
    ("dtype", "quantization"), [("float32", "int8"), ("bfloat16", "int8"), ("float32", "none"), ("bfloat16", "none")]
)
def test_lora_rows_on_the_stack_get_the_python_layers_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str, quantization: str
) -> None:
    """Decode steps whose rows use two adapters and the base model, interleaved, scattered and whole: the stack adds
    the same updates as the layers (``LoRABatch.apply``), to the bit."""
    folder = make_tiny_model(tmp_path / "llama", num_layers=3, seed=11)
    first = make_tiny_lora(folder, tmp_path / "a", seed=1)
    second = make_tiny_lora(folder, tmp_path / "b", seed=2, r=4, target_modules=["q_proj", "v_proj", "up_proj"])
    _clear_choices()
    prompts = [[5 + i, 17, 42, 99, 7, 3 + i] for i in range(5)]
    names = ["a", None, "a", "b", None]  # "a" scattered, "b" alone, base rows between
    # Both engines on the same thread count: oneDNN's float32 products of a few rows split their sums by it, and
    # the count a start measures (``StepThreads``) follows the machine's load.
    monkeypatch.setenv("RADIXSERVE_TUNE_THREADS", "0")
    runs = {}
    for stack in ("1", "0"):
        monkeypatch.setenv("RADIXSERVE_DECODE_STACK", stack)
        engine = Engine(model=str(folder), device="cpu", dtype=dtype, quantization=quantization, max_total_tokens=2048,
                        lora_modules=(f"a={first}", f"b={second}"))  # fmt: skip
        try:
            params = [replace(GREEDY, max_new_tokens=8, lora_name=n) for n in names]
            together = engine.generate(input_ids=prompts, sampling_params=params)
            engine.flush_cache()
            alone = engine.generate(input_ids=prompts[0], sampling_params=params[0])  # every row one adapter
            outs = [*together, alone]
            runs[stack] = [[(t.token_id, t.logprob) for t in o["meta_info"]["output_token_logprobs"]] for o in outs]
            if stack == "1":
                assert (_model(engine).__dict__.get("_decode_stack") is not None) == _expects_stack(quantization)
        finally:
            engine.shutdown()
    assert runs["1"] == runs["0"]
    assert runs["1"][0] != runs["1"][1]  # (the adapters act)
