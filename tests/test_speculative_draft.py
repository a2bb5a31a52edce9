"""Speculative decoding with a draft model (``--speculative-algorithm draft``) on tiny random models.

The targets have untied embeddings: a tiny random model with tied ones just repeats its last token, which any
draft would guess. Drafts come from three models with the target's tokenizer: the target itself (every draft
accepted), the target with noise on its weights (some accepted: rollback of the draft KV is exercised), and an
unrelated model (hardly any accepted). Greedy output must equal plain decoding's in every case, batched and
alone, under retraction, aborts and a draft pool that runs short; sampled output must keep the target's
distribution; the target's and the draft's KV are all accounted for afterwards.
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixserve.constrained import ConstraintSpec
from radixserve.runtime.config import EngineConfig
from radixserve.runtime.engine import Engine
from radixserve.runtime.sampling_params import SamplingParams
from tests.test_engine import assert_all_free, make_engine
from tests.test_speculative import PROMPTS, _chi_square_p, abort_midway
from tests.tiny_model import make_tiny_model

GREEDY = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True)
def _integrity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXSERVE_CHECK_INTEGRITY", "1")  # KV accounting checked after every step


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("draft")
    target = make_tiny_model(root / "target", seed=0, tie=False)
    noisy = root / "noisy"
    shutil.copytree(target, noisy)
    weights = load_file(noisy / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name, w in weights.items():
        if w.dim() == 2:
            weights[name] = w + 0.15 * w.std() * torch.randn(w.shape, generator=gen)
    save_file(weights, noisy / "model.safetensors", metadata={"format": "pt"})
    other = make_tiny_model(root / "other", seed=1, tie=False, num_layers=1)
    foreign = make_tiny_model(root / "foreign", seed=0, vocab_size_hint=300)  # another tokenizer
    return {"target": target, "noisy": noisy, "other": other, "foreign": foreign}


def _draft_engine(models: dict[str, Path], draft: str, **kw) -> Engine:
    kw.setdefault("speculative_num_draft_tokens", 4)
    return make_engine(
        models["target"], speculative_algorithm="draft", speculative_draft_model=str(models[draft]), **kw
    )


def _expected(models: dict[str, Path], params: SamplingParams = GREEDY) -> list[list[int]]:
    plain = make_engine(models["target"])
    try:
        return [r["output_ids"] for r in plain.generate(PROMPTS, params)]
    finally:
        plain.shutdown()


def _assert_drafts_free(eng: Engine) -> None:
    info = eng.server_info()["speculative"]
    assert info["algorithm"] == "draft"
    assert info["draft_kv_free_tokens"] == info["draft_kv_total_tokens"] and info["draft_kv_requests"] == 0, info


@pytest.mark.parametrize(("draft", "acceptance"), [("target", (0.99, 1.0)), ("noisy", (0.2, 0.95)),
                                                   ("other", (0.0, 0.2))])  # fmt: skip
def test_greedy_output_is_identical_batched_and_alone(
    models: dict[str, Path], draft: str, acceptance: tuple[float, float]
) -> None:
    expected = _expected(models)
    eng = _draft_engine(models, draft)
    try:
        assert [r["output_ids"] for r in eng.generate(PROMPTS, GREEDY)] == expected
        alone = [eng.generate(p, GREEDY)["output_ids"] for p in PROMPTS]
        assert alone == expected
        stats = eng.server_info()["cache_stats"]
        lo, hi = acceptance
        assert stats["spec_draft_tokens"] > 0 and lo <= stats["spec_acceptance_rate"] <= hi, stats
        if draft == "target":
            assert stats["spec_tokens_per_step"] > 3  # 4 drafts a step, all accepted but near the end
        assert_all_free(eng)
        _assert_drafts_free(eng)
    finally:
        eng.shutdown()


def test_retraction_aborts_short_draft_pool_and_chunked_catch_up(models: dict[str, Path]) -> None:
    """200 slots for the target (retractions) and the same for the draft (whose KV of idle requests is dropped
    to make room); catch-up prefills of at most 16 tokens a step; then client disconnects mid-stream."""
    expected = _expected(models)
    eng = _draft_engine(models, "noisy", max_total_tokens=200, chunked_prefill_size=16)
    try:
        assert [r["output_ids"] for r in eng.generate(PROMPTS, GREEDY)] == expected
        stats = eng.server_info()["cache_stats"]
        assert stats["retractions"] > 0 and stats["spec_accepted_tokens"] > 0
        assert eng.server_info()["speculative"]["draft_kv_dropped"] > 0
        abort_midway(eng)  # client disconnects: the requests are aborted, their draft KV freed
        assert_all_free(eng)
        _assert_drafts_free(eng)
    finally:
        eng.shutdown()


def test_constrained_greedy_output_is_identical(models: dict[str, Path]) -> None:
    schema = ConstraintSpec("json_schema", {"type": "object", "properties": {"a": {"type": "string"}},
                                            "required": ["a"]})  # fmt: skip
    params = SamplingParams(max_new_tokens=40, temperature=0.0, constraint=schema)
    plain = make_engine(models["target"])
    try:
        expected = [r["output_ids"] for r in plain.generate(PROMPTS, params)]
    finally:
        plain.shutdown()
    eng = _draft_engine(models, "target")
    try:
        assert [r["output_ids"] for r in eng.generate(PROMPTS, params)] == expected
        assert eng.server_info()["cache_stats"]["spec_accepted_tokens"] > 0
        assert_all_free(eng)
    finally:
        eng.shutdown()


def test_drafts_follow_the_grammar(models: dict[str, Path]) -> None:
    """The draft model picks its argmax among the tokens the request's grammar allows after the drafts before it:
    under a regex that admits one string (jump-forward off, so every token is drafted), even an unrelated draft
    model proposes exactly that string, and every draft is accepted."""
    literal = "the quick brown fox jumps over the lazy dog"
    params = SamplingParams(max_new_tokens=40, temperature=0.0, constraint=ConstraintSpec("regex", literal))
    eng = _draft_engine(models, "other", disable_jump_forward=True)
    try:
        assert [r["text"] for r in eng.generate(PROMPTS, params)] == [literal] * len(PROMPTS)
        stats = eng.server_info()["cache_stats"]
        assert stats["spec_draft_tokens"] > 0 and stats["spec_acceptance_rate"] == 1.0, stats
        assert_all_free(eng)
        _assert_drafts_free(eng)
    finally:
        eng.shutdown()


def test_sampled_tokens_keep_the_target_distribution(models: dict[str, Path]) -> None:
    """Drafts are the draft model's argmax, verified by the target alone: tokens 2 to 4 of many seeded samples
    must have plain sampling's frequencies. Fixed seeds: deterministic."""
    n = 400
    prompt = PROMPTS[1]
    counts: dict[str, list[Counter[int]]] = {}
    params = [SamplingParams(max_new_tokens=4, temperature=1.0, top_k=20, seed=1000 + i, ignore_eos=True)
              for i in range(n)]  # fmt: skip
    for algorithm in ("", "draft"):
        eng = _draft_engine(models, "noisy", speculative_num_draft_tokens=3) if algorithm else make_engine(
            models["target"]
        )
        try:
            outs = [r["output_ids"] for r in eng.generate([prompt] * n, params)]
            if algorithm:
                stats = eng.server_info()["cache_stats"]
                assert stats["spec_draft_tokens"] > n and 0 < stats["spec_acceptance_rate"] < 1, stats
                _assert_drafts_free(eng)
            assert_all_free(eng)
        finally:
            eng.shutdown()
        counts[algorithm] = [Counter(o[k] for o in outs) for k in (1, 2, 3)]
    for position in range(3):
        a, b = counts[""][position], counts["draft"][position]
        p = _chi_square_p(a, b)
        assert p > 1e-3, (position, p, a.most_common(5), b.most_common(5))


def test_a_failing_draft_step_costs_only_the_drafts(models: dict[str, Path]) -> None:
    expected = _expected(models)
    eng = _draft_engine(models, "target")
    calls = {"n": 0}

    def broken_every_other(core) -> None:
        forward = core.drafter._forward

        def flaky(step):
            calls["n"] += 1
            if calls["n"] % 2:
                raise RuntimeError("injected draft fault")
            return forward(step)

        core.drafter._forward = flaky

    try:
        eng.call(broken_every_other)
        assert [r["output_ids"] for r in eng.generate(PROMPTS, GREEDY)] == expected
        assert calls["n"] > 2 and eng.alive
        assert_all_free(eng)
        _assert_drafts_free(eng)
    finally:
        eng.shutdown()


def test_a_draft_model_with_another_tokenizer_is_refused(models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="tokenizer"):
        _draft_engine(models, "foreign")


def test_config_names_the_missing_half() -> None:
    with pytest.raises(ValueError, match="--speculative-draft-model"):
        EngineConfig(speculative_algorithm="draft")
    with pytest.raises(ValueError, match="--speculative-algorithm draft"):
        EngineConfig(speculative_draft_model="some/model")
