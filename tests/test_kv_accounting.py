"""Engine-level KV accounting: after any mix of finished, aborted and retracted requests, every slot is free or
held by the radix tree, and the tree's integrity holds; checked after every single step."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from radixserve.runtime.engine import Engine
from radixserve.runtime.request import FinishReason, Req
from radixserve.runtime.sampling_params import SamplingParams


@pytest.mark.parametrize("radix", [True, False])
def test_random_mix_keeps_kv_accounting(tiny_model_dir: Path, radix: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXSERVE_CHECK_INTEGRITY", "1")
    engine = Engine(
        model=str(tiny_model_dir),
        device="cpu",
        max_total_tokens=150,
        chunked_prefill_size=48,
        max_running_requests=6,
        disable_radix_cache=not radix,
    )
    try:
        rng = random.Random(7)
        shared = [rng.randrange(3, 200) for _ in range(40)]

        def drive(core) -> dict[str, int]:
            finished: dict[FinishReason, int] = {}
            live: list[str] = []
            for i in range(40):
                head = shared[: rng.choice([0, 10, 40])]
                prompt = head + [rng.randrange(3, 200) for _ in range(rng.randint(1, 60))]
                params = SamplingParams(
                    max_new_tokens=rng.randint(1, 40),
                    temperature=rng.choice([0.0, 1.0]),
                    ignore_eos=True,
                    return_logprob=rng.random() < 0.3,
                    logprob_start_len=rng.choice([-1, -1, 0, 5]),
                )
                core.add(Req(f"r{i}", prompt, params))
                live.append(f"r{i}")
                for _ in range(rng.randint(0, 3)):
                    for out in core.step():
                        if out.finished:
                            finished[out.finish_reason] = finished.get(out.finish_reason, 0) + 1
                if rng.random() < 0.3 and live:
                    out = core.abort(live.pop(rng.randrange(len(live))))
                    if out is not None:
                        finished[FinishReason.ABORT] = finished.get(FinishReason.ABORT, 0) + 1
            while core.has_work():
                for out in core.step():
                    if out.finished:
                        finished[out.finish_reason] = finished.get(out.finish_reason, 0) + 1
            core.cache.check(core.scheduler.holders())
            usage = core.kv_usage()
            return {
                "done": sum(finished.values()),
                "aborted": finished.get(FinishReason.ABORT, 0),
                "errors": finished.get(FinishReason.ERROR, 0),
                "retractions": core.scheduler.num_retractions,
                "in_use": usage["in_use_tokens"],
                "free_plus_evictable": usage["free_tokens"] + usage["evictable_tokens"],
                "total": usage["total_tokens"],
            }

        result = engine.call(drive, timeout=300)
    finally:
        engine.shutdown()
    assert result["done"] == 40
    assert result["errors"] == 0
    assert result["aborted"] > 0
    assert result["retractions"] > 0, "the pool was sized so that retraction happens"
    assert result["in_use"] == 0
    assert result["free_plus_evictable"] == result["total"]


def test_in_batch_prefix_sharing_defers_only_long_shared_heads(tiny_model_dir: Path) -> None:
    """Two requests sharing a long uncached head: the second waits one step and then hits the cache. Sharing only
    a short head (a chat template's system prompt) is not worth a step: both are prefilled together."""
    engine = Engine(model=str(tiny_model_dir), device="cpu", max_total_tokens=2048)
    try:
        params = SamplingParams(max_new_tokens=2, temperature=0.0)

        def plan_sizes(core, prompts: list[list[int]]) -> list[int]:
            for i, p in enumerate(prompts):
                core.add(Req(f"p{i}-{len(p)}", p, params))
            plan = core.scheduler.schedule()
            sizes = [c.end - c.start for c in plan.chunks]
            result = core.runner.run(plan)
            core._apply(plan, result)
            while core.has_work():
                core.step()
            return sizes

        long_head = list(range(3, 103))
        long_sizes = engine.call(lambda core: plan_sizes(core, [long_head + [5, 6], long_head + [7, 8]]))
        assert long_sizes == [102], "the second request should wait for the shared head to be cached"
        short_head = list(range(300, 340))
        short_sizes = engine.call(
            lambda core: plan_sizes(core, [short_head + list(range(100, 160)), short_head + list(range(200, 260))])
        )
        assert short_sizes == [100, 100]
    finally:
        engine.shutdown()
