"""Correctness anchor: greedy output equals HuggingFace transformers' greedy output on the same weights."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from radixserve.runtime.engine import Engine
from radixserve.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.real_model

RAW_PROMPTS = [
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n",
    "import json\n\nwith open('data.json') as f:\n",
    "class Stack:\n    def __init__(self):\n",
    "SELECT name, COUNT(*) FROM users",
    "The history of the Roman Empire began",
    "Photosynthesis is the process by which",
    "In a small village at the edge of the forest, there lived an old woman who",
    "The three primary colors are",
    "To make a cup of tea, first",
    "Water boils at",
]
CHAT_PROMPTS = [
    "What is the capital of Japan?",
    "Write a haiku about the sea.",
    "Explain recursion in one sentence.",
    "List three fruits.",
    "How many legs does a spider have?",
    "Translate 'good morning' into French.",
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    # The GGUF's exact float32 dequantization, as transformers computes with it (the served default keeps blocks).
    eng = Engine(
        model="smollm2-135m-instruct", device="cpu", dtype="float32", quantization="none", max_total_tokens=16384
    )
    yield eng
    eng.shutdown()


def _prompt_ids(tokenizer) -> list[list[int]]:
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in RAW_PROMPTS]
    for q in CHAT_PROMPTS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True)
        ids.append(tokenizer.encode(text, add_special_tokens=False))
    return ids


@torch.inference_mode()
def _hf_greedy(hf: object, engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy continuations, eight prompts a call, left-padded under an attention mask."""
    eos = sorted(engine.core.eos_token_ids)
    outs = []
    for start in range(0, len(prompts), 8):
        group = prompts[start : start + 8]
        width = max(map(len, group))
        ids = torch.tensor([[eos[0]] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        gen = hf.generate(
            ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos, pad_token_id=eos[0]
        )
        outs += [row[width:].tolist() for row in gen]
    return outs


def _strip_eos(ids: list[int], eos: set[int]) -> list[int]:
    return [t for t in ids if t not in eos]


def test_greedy_matches_transformers(engine: Engine, hf_smollm2: object) -> None:
    prompts = _prompt_ids(engine.tokenizer)
    assert len(prompts) == 16
    expected = _hf_greedy(hf_smollm2, engine, prompts)
    eos = engine.core.eos_token_ids
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
    together = engine.generate(input_ids=prompts, sampling_params=params)
    one_by_one = [engine.generate(input_ids=p, sampling_params=params) for p in prompts]
    for name, results in (("together", together), ("one by one", one_by_one)):
        same = sum(
            _strip_eos(r["output_ids"], eos) == _strip_eos(e, eos) for r, e in zip(results, expected)
        )
        assert same >= 15, f"{name}: only {same}/16 prompts match transformers' greedy output"
    # Text, not just ids: decode what transformers produced and compare with our detokenized text.
    tok = engine.tokenizer
    matches = sum(r["text"] == tok.decode(e, skip_special_tokens=True) for r, e in zip(together, expected))
    assert matches >= 15
