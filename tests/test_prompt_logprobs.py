"""Prompt log-probabilities (what the DSL's ``select`` scores choices with) survive KV pressure unchanged.

Under pressure the scheduler retracts the running request with the fewest outputs, which is exactly a
prefill-only scoring request part-way through its prompt. When it resumes, the positions it had already scored
must not be scored (and reported) a second time.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from radixserve.runtime.engine import Engine
from radixserve.runtime.request import Req
from radixserve.runtime.sampling_params import SamplingParams


def _requests() -> list[Req]:
    reqs = []
    for i in range(2):  # decoders that keep growing
        prompt = [3 + (7 * i + j) % 190 for j in range(20)]
        reqs.append(Req(f"decode{i}", prompt, SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)))
    for i in range(3):  # prefill-only scoring requests, as `select` sends them
        prompt = [5 + (11 * i + 3 * j) % 180 for j in range(60)]
        reqs.append(Req(f"score{i}", prompt, SamplingParams(max_new_tokens=0, logprob_start_len=0)))
    return reqs


def _run(folder: Path, pressure: bool) -> tuple[dict[str, list[tuple[int, float]]], dict[str, int]]:
    """Run the requests to the end; with ``pressure``, whenever a scoring request is part-way through its prompt,
    the scheduler retracts as it does when the pool runs short (the request with the fewest outputs goes)."""
    engine = Engine(model=str(folder), device="cpu", chunked_prefill_size=16, max_total_tokens=4096)
    try:

        def drive(core) -> tuple[dict[str, list[tuple[int, float]]], dict[str, int]]:
            reqs = _requests()
            for req in reqs:
                core.add(req)
            scored: dict[str, list[tuple[int, float]]] = {}
            while core.has_work():
                sched = core.scheduler
                partial = [r for r in sched.running if r.rid.startswith("score") and 0 < r.num_computed < r.total]
                if pressure and partial and len(sched.running) > 1 and partial[0].num_retractions < 2:
                    victim = min(sched.running, key=lambda r: (len(r.output_ids), -r.arrival_time))
                    assert victim.rid.startswith("score")
                    assert sched._retract_one()
                for out in core.step():
                    if out.finished and out.prompt_logprobs is not None:
                        assert out.error is None, out.error
                        scored[out.rid] = [(lp.token_id, lp.logprob) for lp in out.prompt_logprobs]
            core.cache.check(core.scheduler.holders())
            return scored, {r.rid: r.num_retractions for r in reqs}

        return engine.call(drive, timeout=120)
    finally:
        engine.shutdown()


def test_prompt_logprobs_equal_an_unpressured_run_after_retraction(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RADIXSERVE_CHECK_INTEGRITY", "1")
    expected, _ = _run(tiny_model_dir, pressure=False)
    got, retractions = _run(tiny_model_dir, pressure=True)
    assert sum(retractions[f"score{i}"] for i in range(3)) >= 3, retractions
    assert set(got) == set(expected) == {"score0", "score1", "score2"}
    for rid, want in expected.items():
        assert len(want) == 59  # every prompt token after the first, once
        assert [t for t, _ in got[rid]] == [t for t, _ in want], rid
        assert [lp for _, lp in got[rid]] == pytest.approx([lp for _, lp in want], abs=1e-4), rid


def test_a_request_whose_prompt_is_scored_resumes_from_the_cache() -> None:
    """Once every prompt token is scored, the request is a plain decoder: its cached prefix is no longer cut where
    scoring began (a retracted one recomputed all it had generated), and it leaves the greedy fast path to others."""
    from radixserve.runtime.kv_cache import KVCacheManager
    from radixserve.runtime.request import TokenLogprob

    cache = KVCacheManager(256, enable_radix=True, strict=True)
    prompt = list(range(3, 23))
    warm = Req("warm", prompt + [40, 41], SamplingParams(max_new_tokens=1))
    cache.admit(warm)
    warm.slots += cache.alloc(warm.total - len(warm.slots))
    warm.num_computed = warm.total
    cache.release(warm)
    req = Req("r", prompt, SamplingParams(max_new_tokens=4, logprob_start_len=0))
    assert req.scoring_prompt
    req.prompt_logprobs = [TokenLogprob(t, -1.0) for t in prompt[1:]]
    req.output_ids = [40, 41]
    assert not req.scoring_prompt and req.wants_prompt_logprobs
    assert cache.admit(req) == req.total - 1  # all but the last token, as for any request
    cache.release(req)
    cache.check([])
