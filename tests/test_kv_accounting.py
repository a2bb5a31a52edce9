"""Engine-level KV accounting: after any mix of finished, aborted and retracted requests, every slot is free or
held by the radix tree, and the tree's integrity holds; checked after every single step."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from runtime.engine import Engine
from runtime.request import FinishReason, Req
from runtime.sampling_params import SamplingParams


@pytest.mark.parametrize("radix", [True, False])
def test_random_mix_keeps_kv_accounting(tiny_model_dir: Path, radix: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXSERVE_CHECK_INTEGRITY", "1")
    engine = Engine(
        model=str(tiny_model_dir),
        device="cpu",
        max_total_tokens=300,
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
