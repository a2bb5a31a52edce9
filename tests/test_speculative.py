"""Speculative decoding with n-gram drafts (``--speculative-algorithm ngram``) on the tiny random model.

Greedy output must be identical to plain decoding (batched and alone, with the radix cache, under retraction and
aborts, with every slot accounted for after each step); sampled output must keep the target's distribution
(a chi-square test on a fixed seed set); constrained requests speculate within their grammar; requests that
cannot speculate exactly (logprobs, penalties) decode as before.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from radixserve.constrained import ConstraintSpec
from radixserve.runtime.engine import Engine
from radixserve.runtime.request import Req
from radixserve.runtime.sampling_params import SamplingParams
from radixserve.runtime.speculative import PAUSE_AFTER, NgramDrafter
from tests.test_engine import assert_all_free, make_engine

# Prompts with stretches the drafter can copy (the tiny model's own output repeats, too).
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick brown",
    "One, two, three, four, five, six, seven, eight, nine, ten. One, two, three,",
    "def add(a: int, b: int) -> int:\n    return a + b\n\ndef add(a: int, b: int) -> int:\n",
    "hello",
    "A serving engine keeps many requests in flight at once. A serving engine keeps",
]


@pytest.fixture(autouse=True)
def _integrity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXSERVE_CHECK_INTEGRITY", "1")  # KV accounting checked after every step


def _ids(results: list[dict]) -> list[list[int]]:
    return [r["output_ids"] for r in results]


def test_drafter_proposes_the_continuation_of_the_longest_recent_match() -> None:
    drafter = NgramDrafter(max_draft=3)
    req = Req("r", [5, 6, 7, 8, 9, 1, 2, 5, 6, 7], SamplingParams())
    assert drafter.propose(req, 8) == [8, 9, 1]  # "5 6 7" was followed by 8 9 1
    req.output_ids.extend([8, 4])
    assert drafter.propose(req, 8) == []  # "7 8 4" never occurred before
    loop = Req("l", [3, 4, 3, 4, 3], SamplingParams())
    assert drafter.propose(loop, 8) == [4, 3, 4]  # a repeating stretch continues with its period
    assert drafter.propose(loop, 2) == [4, 3]  # the limit (max_new_tokens, the context) caps the draft


def test_drafter_shortens_and_pauses_drafts_that_keep_failing() -> None:
    drafter = NgramDrafter(max_draft=4)
    req = Req("r", [1, 2, 3, 1, 2], SamplingParams())
    drafter.record(req, 4, 0)
    assert req.spec.k == 2
    drafter.record(req, 2, 2)
    assert req.spec.k == 4  # all accepted: back up
    for _ in range(PAUSE_AFTER):
        drafter.record(req, 1, 0)
    assert drafter.propose(req, 8) == []  # paused


@pytest.mark.parametrize("radix", [True, False])
def test_greedy_output_is_identical_batched_and_alone(tiny_model_dir: Path, radix: bool) -> None:
    params = SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True)
    plain = make_engine(tiny_model_dir, disable_radix_cache=not radix)
    try:
        expected = _ids(plain.generate(PROMPTS, params))
        steps = plain.server_info()["cache_stats"]["forward_steps"]
    finally:
        plain.shutdown()
    spec = make_engine(tiny_model_dir, disable_radix_cache=not radix, speculative_algorithm="ngram")
    try:
        assert _ids(spec.generate(PROMPTS, params)) == expected
        stats = spec.server_info()["cache_stats"]
        assert stats["spec_accepted_tokens"] > 0 and stats["spec_tokens_per_step"] > 1.5
        assert stats["forward_steps"] < steps  # it did save steps
        alone = [spec.generate(p, params)["output_ids"] for p in PROMPTS]
        assert alone == expected
        assert_all_free(spec)
    finally:
        spec.shutdown()


def abort_midway(eng: Engine) -> None:
    """Stream every prompt and disconnect after its first delta: each request is aborted, drafts and all."""

    async def run() -> None:
        params = SamplingParams(max_new_tokens=100, temperature=0.0)
        streams = [eng.stream(eng.tokenizer.encode(p, add_special_tokens=False), params) for p in PROMPTS]
        for s in streams:
            async for _ in s:
                break
            await s.aclose()

    asyncio.run(run())


def test_speculation_under_retraction_and_aborts_keeps_every_slot(tiny_model_dir: Path) -> None:
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    roomy = make_engine(tiny_model_dir)
    try:
        expected = _ids(roomy.generate(PROMPTS, params))
    finally:
        roomy.shutdown()
    tight = make_engine(tiny_model_dir, max_total_tokens=200, speculative_algorithm="ngram")
    try:
        assert _ids(tight.generate(PROMPTS, params)) == expected
        assert tight.server_info()["cache_stats"]["retractions"] > 0
        abort_midway(tight)
        assert_all_free(tight)
    finally:
        tight.shutdown()


def test_constrained_requests_speculate_within_their_grammar(tiny_model_dir: Path) -> None:
    """Drafts are cut where they leave the grammar and every verification row is masked by the grammar after the
    drafts before it: greedy output equals plain decoding's, and sampled output stays inside the grammar."""
    import json

    schema = ConstraintSpec("json_schema", {"type": "object", "properties": {"a": {"type": "string"}},
                                            "required": ["a"]})  # fmt: skip
    regex = ConstraintSpec("regex", "(the quick brown fox )+[a-z ]{0,40}")
    greedy = [SamplingParams(max_new_tokens=48, temperature=0.0, constraint=c) for c in (schema, regex)]
    outputs, texts = {}, {}
    for algorithm in ("", "ngram"):
        eng = make_engine(tiny_model_dir, speculative_algorithm=algorithm)
        try:
            results = eng.generate(PROMPTS * 2, greedy * len(PROMPTS))
            outputs[algorithm] = _ids(results)
            texts[algorithm] = [r["text"] for r in results]
            stats = eng.server_info()["cache_stats"]
            if algorithm:
                assert stats["spec_steps"] > 0 and stats["spec_accepted_tokens"] > 0
                sampled = SamplingParams(max_new_tokens=48, temperature=1.0, seed=7, constraint=schema)
                for r in eng.generate(PROMPTS, [sampled] * len(PROMPTS)):
                    if r["meta_info"]["finish_reason"] == "stop":
                        value = json.loads(r["text"])
                        assert isinstance(value, dict) and isinstance(value["a"], str), r["text"]
            assert_all_free(eng)
        finally:
            eng.shutdown()
    assert outputs["ngram"] == outputs[""]


def test_requests_that_cannot_speculate_exactly_decode_as_before(tiny_model_dir: Path) -> None:
    cases = [
        SamplingParams(max_new_tokens=24, temperature=0.0, return_logprob=True),
        SamplingParams(max_new_tokens=24, temperature=0.0, repetition_penalty=1.3),
        SamplingParams(max_new_tokens=24, temperature=0.0, min_new_tokens=24),
    ]
    outputs = {}
    for algorithm in ("", "ngram"):
        eng = make_engine(tiny_model_dir, speculative_algorithm=algorithm)
        try:
            outputs[algorithm] = [eng.generate(PROMPTS[0], p)["output_ids"] for p in cases]
            verified = eng.server_info()["cache_stats"]["spec_steps"]
        finally:
            eng.shutdown()
    assert outputs["ngram"] == outputs[""]
    assert verified <= 3  # only the min_new_tokens request, once past its minimum


def _chi_square_p(a: Counter[int], b: Counter[int]) -> float:
    """Two-sample chi-square test of homogeneity (categories with fewer than 10 pooled samples merged); the
    p-value by the Wilson-Hilferty approximation of the chi-square tail."""
    pooled = a + b
    common = [t for t, c in pooled.items() if c >= 10]
    cats = [(a[t], b[t]) for t in common] + [(sum(a.values()) - sum(a[t] for t in common),
                                              sum(b.values()) - sum(b[t] for t in common))]
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for ca, cb in cats:
        total = ca + cb
        if total == 0:
            continue
        ea, eb = total * na / (na + nb), total * nb / (na + nb)
        stat += (ca - ea) ** 2 / ea + (cb - eb) ** 2 / eb
    df = max(1, len([c for c in cats if sum(c)]) - 1)
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_sampled_tokens_keep_the_target_distribution(tiny_model_dir: Path) -> None:
    """Tokens 2 to 4 of many seeded samples: with speculation they come out of verification (the prompt holds
    nearly every token of the vocabulary and the drafter looks up single tokens, so whatever was sampled has a
    continuation to propose); their frequencies must match plain sampling's. Fixed seeds: deterministic."""
    n = 500
    gen = torch.Generator().manual_seed(0)
    probe = make_engine(tiny_model_dir)
    vocab = probe.vocab_size
    probe.shutdown()
    prompt = torch.randperm(vocab - 3, generator=gen)[:300].add(3).tolist()
    counts: dict[str, list[Counter[int]]] = {}
    outputs: dict[str, list[list[int]]] = {}
    for algorithm in ("", "ngram"):
        eng = make_engine(tiny_model_dir, speculative_algorithm=algorithm, speculative_ngram_min=1)
        try:
            params = [
                SamplingParams(max_new_tokens=4, temperature=1.0, top_k=20, seed=1000 + i, ignore_eos=True)
                for i in range(n)
            ]
            outs = _ids(eng.generate(input_ids=[prompt] * n, sampling_params=params))
            if algorithm:
                stats = eng.server_info()["cache_stats"]
                assert stats["spec_draft_tokens"] > n and 0 < stats["spec_acceptance_rate"] < 1
            assert_all_free(eng)
        finally:
            eng.shutdown()
        counts[algorithm] = [Counter(o[k] for o in outs) for k in (1, 2, 3)]
        outputs[algorithm] = outs
    # Each emitted token takes the draw plain decoding gives its position: a seed gives the same tokens with or
    # without drafts (but where the verify rows' logits differ from a decode row's in the last bits at a draw's
    # boundary), so whether a step drafts (which depends on the batch) cannot change a seeded output.
    same = sum(a == b for a, b in zip(outputs[""], outputs["ngram"]))
    assert same >= n - 5, same
    for position in range(3):
        a, b = counts[""][position], counts["ngram"][position]
        p = _chi_square_p(a, b)
        assert p > 1e-3, (position, p, a.most_common(5), b.most_common(5))


@pytest.mark.real_model
def test_real_model_greedy_identity_batched_alone_and_under_a_schema() -> None:
    """The built-in model at float32 (the parity dtype): documents whose answers quote them, batched and one by
    one with the radix cache on, and a JSON-schema request beside them (its drafts checked by its grammar). With
    --enable-deterministic-inference: otherwise which prompts share a prefill step, and so which reuse another's
    cached prefix, depends on timing, and the prefill's chunking changes the last bits of the attention, which the
    block kernel's int8 activations can turn into another token (docs/benchmarks.md, "Greedy identity")."""
    from bench.speculative import rag_prompts

    schema = ConstraintSpec(
        "json_schema",
        {"type": "object", "properties": {"place": {"type": "string", "maxLength": 20}}, "required": ["place"]},
    )
    params = SamplingParams(max_new_tokens=64, temperature=0.0)
    outputs = {}
    for algorithm in ("", "ngram"):
        eng = make_engine(
            "smollm2-135m-instruct", dtype="float32", speculative_algorithm=algorithm, deterministic_inference=True
        )
        try:
            tok = eng.tokenizer
            prompts = [tok.encode(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False))
                       for m in rag_prompts(6)]
            batched = _ids(eng.generate(input_ids=prompts, sampling_params=params))
            alone = [eng.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts[:3]]
            constrained = SamplingParams(max_new_tokens=40, temperature=0.0, constraint=schema)
            json_out = eng.generate(input_ids=prompts[0], sampling_params=constrained)["output_ids"]
            outputs[algorithm] = (batched, alone, json_out)
            if algorithm:
                assert eng.server_info()["cache_stats"]["spec_accepted_tokens"] > 100
            assert_all_free(eng)
        finally:
            eng.shutdown()
    # Speculative equals plain, batched and alone; and, deterministic, a prompt alone gives what it gave batched.
    assert outputs["ngram"] == outputs[""]
    batched, alone, _ = outputs[""]
    assert batched[:3] == alone


def test_speculation_turns_the_overlap_schedule_off() -> None:
    """Overlapped steps never carry drafts: with CUDA graphs (the overlap's condition) an n-gram drafter, made by
    the core itself, must switch it off, or it drafts every step for nothing (it checked the argument, None)."""
    from types import SimpleNamespace

    from radixserve.runtime.config import EngineConfig
    from radixserve.runtime.engine_core import EngineCore

    # As on CUDA, graphs captured.
    runner = SimpleNamespace(pool=SimpleNamespace(num_slots=1024), graphs=object(), loras=None)
    for algorithm, overlap in (("", True), ("ngram", False)):
        config = EngineConfig(speculative_algorithm=algorithm)
        core = EngineCore(config, runner, tokenizer=None, eos_token_ids={2}, vocab_size=100, max_context_len=2048)
        assert core.overlap is overlap, algorithm
