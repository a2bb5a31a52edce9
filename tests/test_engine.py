"""The engine on a tiny random-weight model: batching, chunked prefill, retraction, seeds, stops, KV accounting."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from radixserve.runtime.engine import Engine
from radixserve.runtime.sampling_params import SamplingParams

PROMPTS = [
    "def fibonacci(n):\n    if n < 2:",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Once upon a time, in a land far away, there lived",
    "import numpy as np\nx = np.arange(10)\n",
    "Q: What is the capital of France?\nA:",
    "1, 2, 3, 4, 5, 6, 7,",
    "hello",
    "The weather today is sunny and warm, so we",
]


@pytest.fixture(autouse=True)
def _integrity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXSERVE_CHECK_INTEGRITY", "1")


def make_engine(folder: Path, **kw) -> Engine:
    kw.setdefault("max_total_tokens", 4096)
    kw.setdefault("device", "cpu")
    return Engine(model=str(folder), **kw)


@pytest.fixture
def engine(tiny_model_dir: Path) -> Iterator[Engine]:
    eng = make_engine(tiny_model_dir)
    yield eng
    eng.shutdown()


def greedy(n: int = 24, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, **kw)


def assert_all_free(eng: Engine) -> None:
    info = eng.server_info()
    kv = info["kv_cache"]
    assert info["num_running_requests"] == 0 and info["num_waiting_requests"] == 0
    assert kv["in_use_tokens"] == 0, kv
    assert kv["free_tokens"] + kv["evictable_tokens"] == kv["total_tokens"], kv
    eng.call(lambda core: core.cache.check(core.scheduler.holders()))


def texts(results) -> list[str]:
    return [r["text"] for r in results]


def test_batch_equals_one_by_one(engine: Engine) -> None:
    together = texts(engine.generate(PROMPTS, greedy()))
    alone = [engine.generate(p, greedy())["text"] for p in PROMPTS]
    assert together == alone
    assert all(r for r in together)
    assert_all_free(engine)


def test_chunked_prefill_matches_unchunked(tiny_model_dir: Path) -> None:
    long_prompt = " ".join(PROMPTS) * 3
    params = SamplingParams(max_new_tokens=8, temperature=0.0, return_logprob=True, logprob_start_len=0)
    results = {}
    for chunk in (16, 4096):
        eng = make_engine(tiny_model_dir, chunked_prefill_size=chunk, disable_radix_cache=True)
        try:
            results[chunk] = eng.generate(long_prompt, params)
        finally:
            eng.shutdown()
    a, b = results[16], results[4096]
    assert a["text"] == b["text"]
    lp_a = [x.logprob for x in a["meta_info"]["input_token_logprobs"]]
    lp_b = [x.logprob for x in b["meta_info"]["input_token_logprobs"]]
    assert len(lp_a) == len(lp_b) > 100
    assert lp_a == pytest.approx(lp_b, abs=1e-4)


@pytest.mark.parametrize("radix", [True, False])
def test_retraction_under_tiny_pool_keeps_greedy_text(tiny_model_dir: Path, radix: bool) -> None:
    params = greedy(40, ignore_eos=True)
    roomy = make_engine(tiny_model_dir)
    try:
        expected = texts(roomy.generate(PROMPTS, params))
    finally:
        roomy.shutdown()
    tight = make_engine(tiny_model_dir, max_total_tokens=160, disable_radix_cache=not radix)
    try:
        got = texts(tight.generate(PROMPTS, params))
        info = tight.server_info()
        assert info["cache_stats"]["retractions"] > 0, "the pool was meant to be too small for all at once"
        assert_all_free(tight)
    finally:
        tight.shutdown()
    assert got == expected


def test_seed_reproduces_whatever_the_batch(engine: Engine) -> None:
    seeded = SamplingParams(max_new_tokens=16, temperature=1.0, seed=1234)
    alone = engine.generate(PROMPTS[0], seeded)["text"]
    unseeded = SamplingParams(max_new_tokens=16, temperature=1.0)
    # The seeded request sits at different rows among unseeded and differently seeded neighbours.
    for position in (0, 3, 7):
        params = [unseeded] * len(PROMPTS)
        prompts = list(PROMPTS)
        params[position] = seeded
        prompts[position] = PROMPTS[0]
        assert engine.generate(prompts, params)[position]["text"] == alone
    # A different seed gives different text (a random model samples widely at temperature 1).
    other = engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=16, temperature=1.0, seed=99))["text"]
    assert other != alone


def test_stop_string_is_cut_and_reported(engine: Engine) -> None:
    free_text = engine.generate(PROMPTS[1], greedy(32))["text"]
    assert len(free_text) > 6
    stop = free_text[3:6]
    res = engine.generate(PROMPTS[1], greedy(32, stop=[stop]))
    assert res["meta_info"]["finish_reason"] == "stop"
    assert res["meta_info"]["matched_stop"] == stop
    assert res["text"] == free_text[: free_text.index(stop)]


def test_stop_token_id_and_max_tokens(engine: Engine) -> None:
    free = engine.generate(PROMPTS[2], greedy(12))
    assert free["meta_info"]["finish_reason"] in ("length", "stop")
    if free["meta_info"]["finish_reason"] == "length":
        assert free["meta_info"]["completion_tokens"] == 12
    third = free["output_ids"][2]
    res = engine.generate(PROMPTS[2], greedy(12, stop_token_ids=[third]))
    assert res["meta_info"]["finish_reason"] == "stop"
    assert res["output_ids"] == free["output_ids"][: free["output_ids"].index(third) + 1]


def test_cache_on_and_off_give_same_greedy_text(tiny_model_dir: Path) -> None:
    shared = "You are a helpful assistant. " * 8
    prompts = [shared + p for p in PROMPTS]
    outs = {}
    for disable in (False, True):
        eng = make_engine(tiny_model_dir, disable_radix_cache=disable)
        try:
            first = texts(eng.generate(prompts, greedy()))
            second = texts(eng.generate(prompts, greedy()))
            assert first == second
            info = eng.server_info()
            if not disable:
                assert info["cache_stats"]["cached_prompt_tokens"] > 0
            else:
                assert info["cache_stats"]["cached_prompt_tokens"] == 0
            assert_all_free(eng)
            outs[disable] = first
        finally:
            eng.shutdown()
    assert outs[False] == outs[True]


def test_cached_tokens_reported_on_repeat(engine: Engine) -> None:
    prompt = "A long shared system prompt that repeats. " * 6
    first = engine.generate(prompt, greedy(4))
    second = engine.generate(prompt, greedy(4))
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] >= first["meta_info"]["prompt_tokens"] - 1
    assert second["text"] == first["text"]


def test_abort_and_stream_free_kv(engine: Engine) -> None:
    ids = engine.tokenizer.encode(PROMPTS[0])

    async def run() -> tuple[str, int]:
        pieces = []
        async for out in engine.stream(ids, greedy(20)):
            pieces.append(out.text)
            last = out
        # Abort a long request after its first output.
        n = 0
        agen = engine.stream(ids, SamplingParams(max_new_tokens=500, temperature=0.0, ignore_eos=True))
        async for _ in agen:
            n += 1
            if n == 2:
                break
        await agen.aclose()
        assert last.finished
        return "".join(pieces), n

    streamed, n = asyncio.run(run())
    assert streamed == engine.generate(PROMPTS[0], greedy(20))["text"]
    assert n == 2
    # The abort is processed between steps; poll until the request has left.
    for _ in range(100):
        if engine.server_info()["num_running_requests"] == 0:
            break
    assert_all_free(engine)


def test_rejects_impossible_requests(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, max_total_tokens=64)
    try:
        with pytest.raises(ValueError, match="empty"):
            engine.submit([], greedy(), lambda out: None)
        with pytest.raises(ValueError, match="out of range"):
            engine.submit([10**9], greedy(), lambda out: None)
        with pytest.raises(ValueError, match="pool holds"):
            engine.submit([1, 2, 3], greedy(100), lambda out: None)
        with pytest.raises(ValueError, match="context length"):
            engine.submit([1] * 5000, greedy(1), lambda out: None)
        with pytest.raises(ValueError, match="top_p"):
            engine.submit([1, 2, 3], SamplingParams(top_p=0.0), lambda out: None)
        # The engine still serves after the refusals.
        assert engine.generate(input_ids=[1, 2, 3], sampling_params=greedy(4))["meta_info"]["completion_tokens"] > 0
    finally:
        engine.shutdown()


def test_non_finite_logits_fail_only_their_request(engine: Engine) -> None:
    model = engine.core.runner.model
    original = model.compute_logits
    poison_first_row = {"on": True}

    def faulty(hidden):
        logits = original(hidden)
        if poison_first_row["on"] and logits.shape[0] > 1:
            logits[0] = float("nan")
            poison_first_row["on"] = False
        return logits

    engine.call(lambda core: setattr(model, "compute_logits", faulty))
    try:
        results = engine.generate(PROMPTS[:3], greedy(6))
    finally:
        engine.call(lambda core: setattr(model, "compute_logits", original))
    reasons = [r["meta_info"]["finish_reason"] for r in results]
    assert reasons.count("error") == 1, reasons
    failed = next(r for r in results if r["meta_info"]["finish_reason"] == "error")
    assert "non-finite logits" in failed["meta_info"]["error"]
    assert all(r["text"] for r in results if r["meta_info"]["finish_reason"] != "error")
    assert_all_free(engine)


def test_grammar_hitting_a_backend_limit_fails_alone_as_the_clients_fault(engine: Engine) -> None:
    r"""The probe at compile time follows a few tokens; this regex blows llguidance's lexer limit only once the
    ``[bc]`` head is written, so the failure happens while decoding. It must fail that request with a grammar
    error (a 400 over HTTP), and never a token outside the grammar, while the others finish. (The ``\p{Greek}``
    tail, which Python's ``re`` cannot parse, keeps the submit-time check of forced stretches from refusing it.)"""
    from radixserve.constrained import ConstraintSpec

    pathological = greedy(40, constraint=ConstraintSpec("regex", r"[bc]{12}(a{1000}){1000}(\p{Greek})?"))
    results = engine.generate(PROMPTS[:3], [pathological, greedy(6), greedy(6)])
    meta = results[0]["meta_info"]
    assert (meta["finish_reason"], meta["error_code"]) == ("error", "grammar_error"), meta
    assert "the constraint cannot be followed" in meta["error"] and "too many expressions" in meta["error"]
    assert set(results[0]["text"]) <= {"b", "c"}
    assert all(r["meta_info"]["finish_reason"] == "length" for r in results[1:])
    assert_all_free(engine)


def test_pool_sizes_that_cannot_work_are_refused_naming_the_flag(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A budget the weights and activations already use up was a 1-token pool (every request a 400), a pool past
    the free memory the allocator's raw error, a context past the model's positions silently cut."""
    with pytest.raises(ValueError, match="--mem-fraction-static 0.00 .* leaves no room"):  # (< the 1 GiB reserve)
        make_engine(tiny_model_dir, max_total_tokens=0, mem_fraction_static=1e-4)
    with pytest.raises(ValueError, match="--max-total-tokens 1000000000000 needs"):
        make_engine(tiny_model_dir, max_total_tokens=10**12)
    with caplog.at_level(logging.WARNING, logger="radixserve.engine"):
        eng = make_engine(tiny_model_dir, max_total_tokens=512, max_context_len=10**6)
    eng.shutdown()
    assert "more than the model's 2048 positions" in caplog.text
    assert "fewer than the context length 2048" in caplog.text
