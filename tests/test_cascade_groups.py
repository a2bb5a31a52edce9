"""Cascade attention groups decoding rows by the cached prefix they share in the radix tree.

Chat prompts all begin with the template's first tokens, so every decoding row shares a few leading KV slots with
every other. Rows must be grouped by the longest prefix that several of them share, not by their first slot: one
request with another system prompt must not take the shared system prompt's cascade away from the rest.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from radixserve.runtime.engine import Engine
from radixserve.runtime.sampling_params import SamplingParams

HEAD = [1, 2, 3, 4, 5]  # as a chat template's "<|im_start|>system\n"


def test_an_outlier_does_not_disable_the_shared_prefix_group(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RADIXSERVE_CHECK_INTEGRITY", "1")
    system_a = [10 + (3 * j) % 180 for j in range(200)]
    system_b = [11 + (7 * j) % 170 for j in range(200)]
    prompts = [HEAD + system_a + [100 + i, 101 + i, 102 + i] for i in range(3)] + [HEAD + system_b + [9, 9]]
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)

    engine = Engine(model=str(tiny_model_dir), device="cpu", max_total_tokens=4096)
    try:
        plain = Engine(model=str(tiny_model_dir), device="cpu", max_total_tokens=4096, disable_radix_cache=True)
        try:
            expected = [r["output_ids"] for r in plain.generate(input_ids=prompts, sampling_params=params)]
        finally:
            plain.shutdown()
        runner = engine.core.runner
        real_build = runner.build_metadata
        seen: list[tuple[int, list[tuple[int, int]]]] = []

        def build(plan):
            ids, pos, meta = real_build(plan)
            groups = [(int(g.rows.numel()), int(g.prefix_slots.numel())) for g in meta.prefix_groups]
            seen.append((meta.num_decode, groups))
            return ids, pos, meta

        engine.call(lambda core: setattr(runner, "build_metadata", build))
        got = [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params)]
    finally:
        engine.shutdown()
    assert got == expected
    all_four = [groups for n, groups in seen if n == 4]
    assert all_four, f"the four requests never decoded together: {seen}"
    for groups in all_four:
        assert (3, len(HEAD) + len(system_a)) in groups, groups
