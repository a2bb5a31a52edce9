"""A fault caused by one request fails that request alone, and what it computed never reaches other requests.

* a model step that raises because of one request's input: the others of the batch finish as if it were absent;
* a request whose step produced non-finite numbers: its KV is freed, not put into the radix cache, so a later
  request with the same prompt does not reuse it;
* a KV pool that runs dry with nothing left to retract: that request fails, the engine keeps serving.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from radixserve.runtime.engine import Engine
from radixserve.runtime.sampling_params import SamplingParams

POISON = 77  # a token id whose presence in a step makes the simulated kernel raise


def _greedy(n: int = 8) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture
def engine(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Engine]:
    monkeypatch.setenv("RADIXSERVE_CHECK_INTEGRITY", "1")
    eng = Engine(model=str(tiny_model_dir), device="cpu", max_total_tokens=2048)
    yield eng
    eng.shutdown()


def _prompts() -> list[list[int]]:
    return [[5 + (13 * i + j) % 150 for j in range(12 + i)] for i in range(4)]


def test_a_step_that_raises_fails_only_the_request_that_caused_it(engine: Engine) -> None:
    prompts = _prompts()
    expected = engine.generate(input_ids=prompts, sampling_params=_greedy())
    engine.flush_cache()
    model = engine.core.runner.model
    real_forward = model.forward

    def forward(input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        if bool((input_ids == POISON).any()):
            raise RuntimeError("simulated kernel fault")
        return real_forward(input_ids, positions, ctx)

    engine.call(lambda core: setattr(model, "forward", forward))
    try:
        poisoned = [[POISON, *prompts[0][1:]]]
        results = engine.generate(input_ids=prompts + poisoned, sampling_params=_greedy())
    finally:
        engine.call(lambda core: setattr(model, "forward", real_forward))
    metas = [r["meta_info"] for r in results]
    assert [m["finish_reason"] for m in metas] == ["length"] * 4 + ["error"], metas
    assert "simulated kernel fault" in metas[4]["error"]
    assert [r["output_ids"] for r in results[:4]] == [r["output_ids"] for r in expected]
    engine.call(lambda core: core.cache.check(core.scheduler.holders()))


def test_kv_of_a_request_with_non_finite_numbers_is_not_cached(engine: Engine) -> None:
    model = engine.core.runner.model
    real_forward = model.forward

    def forward(input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        hidden = real_forward(input_ids, positions, ctx)
        if bool((input_ids == POISON).any()):
            hidden = hidden.clone()
            hidden[-1] = float("nan")  # as a numerical fault of this request's step would leave it
        return hidden

    prompt = [POISON, *range(20, 60)]
    engine.call(lambda core: setattr(model, "forward", forward))
    try:
        failed = engine.generate(input_ids=prompt, sampling_params=_greedy())
    finally:
        engine.call(lambda core: setattr(model, "forward", real_forward))
    assert failed["meta_info"]["finish_reason"] == "error", failed["meta_info"]
    assert "non-finite" in failed["meta_info"]["error"]
    cached = engine.call(lambda core: core.cache.peek_prefix_len(prompt + [1]))
    assert cached == 0, f"{cached} tokens of the failed request's KV were put into the radix cache"
    again = engine.generate(input_ids=prompt, sampling_params=_greedy())
    assert again["meta_info"]["finish_reason"] == "length"
    assert again["meta_info"]["cached_tokens"] == 0
    engine.call(lambda core: core.cache.check(core.scheduler.holders()))


def test_a_dry_pool_fails_the_last_request_not_the_engine(tiny_model_dir: Path) -> None:
    """Slots taken from under the engine (as a leak would) leave a lone decoding request without room; it fails
    with a message that says so, the engine stays alive and serves the next request once the slots are back."""
    engine = Engine(model=str(tiny_model_dir), device="cpu", max_total_tokens=256)
    try:
        stolen = engine.call(lambda core: core.cache.allocator.alloc(256 - 40))
        assert stolen is not None
        result = engine.generate(input_ids=list(range(10, 30)), sampling_params=_greedy(30))
        meta = result["meta_info"]
        assert meta["finish_reason"] == "error", meta
        assert "KV cache" in meta["error"] and "retract" in meta["error"]
        assert engine.alive, engine.error
        engine.call(lambda core: core.cache.allocator.free(stolen))
        engine.call(lambda core: core.cache.check(core.scheduler.holders()))
        ok = engine.generate(input_ids=list(range(10, 30)), sampling_params=_greedy(30))
        assert ok["meta_info"]["finish_reason"] == "length"
    finally:
        engine.shutdown()
