"""StepThreads: small steps run on whichever of 1 and the configured thread count is faster, as timed."""

from __future__ import annotations

import pytest
import torch

from radixserve.runtime.threads import BACKOFF_RATIO, MAX_PROBE_EVERY, MAX_TUNED_TOKENS, PROBE_EVERY, StepThreads


def drive(tuner: StepThreads, cost: dict[int, float], steps: int, tokens: int = 8) -> list[int]:
    """Run ``steps`` fake steps where a step on ``t`` threads takes ``cost[t]`` seconds; the thread counts used."""
    used = []
    for _ in range(steps):
        threads, probe = tuner.choose(tokens, 2)
        tuner.record(tokens, threads, probe, cost[threads])
        used.append(threads)
    return used


def test_tries_both_then_runs_the_faster_and_probes_the_other() -> None:
    tuner = StepThreads()
    used = drive(tuner, {2: 0.030, 1: 0.035}, 2 + 4 * PROBE_EVERY)  # close: worth re-timing often
    assert used[:2] == [2, 1]
    assert used[2:].count(1) == 4  # one probe per PROBE_EVERY steps
    assert all(t == 2 for i, t in enumerate(used[2:], 1) if i % PROBE_EVERY)


def test_follows_a_change_of_load_both_ways() -> None:
    tuner = StepThreads()
    drive(tuner, {2: 0.030, 1: 0.050}, 50)
    loaded = drive(tuner, {2: 0.150, 1: 0.060}, 50)  # other jobs took the second core: two threads stall
    assert loaded[-20:].count(1) >= 19
    quiet = drive(tuner, {2: 0.030, 1: 0.050}, 20 * PROBE_EVERY)
    assert quiet[-PROBE_EVERY:].count(2) >= PROBE_EVERY - 1


def test_a_setting_that_clearly_loses_is_probed_less_and_less() -> None:
    # One thread on a compute-bound step: ~1.9x slower, so probing it every PROBE_EVERY steps would cost ~6%.
    tuner = StepThreads()
    used = drive(tuner, {2: 0.200, 1: 0.380}, 2 + 1000)
    assert BACKOFF_RATIO * 0.200 < 0.380  # the premise: it loses by more than the ratio
    assert used[2:].count(1) <= 7  # probes after 16, 32, 64, ... steps: not 1000 // PROBE_EVERY = 62
    assert tuner._classes[8].probe_every >= 512


def test_a_setting_that_loses_by_far_is_probed_less_and_less() -> None:
    tuner = StepThreads()
    used = drive(tuner, {2: 1.0, 1: 0.050}, 5000)
    assert used.count(2) < 5000 // PROBE_EVERY // 4
    assert tuner._classes[8].probe_every == MAX_PROBE_EVERY


def test_large_steps_one_thread_configs_and_disabled_tuners_are_left_alone() -> None:
    assert StepThreads().choose(MAX_TUNED_TOKENS + 1, 2) == (2, False)
    assert StepThreads().choose(8, 1) == (1, False)
    assert StepThreads(enabled=False).choose(8, 2) == (2, False)


def test_step_restores_the_configured_thread_count() -> None:
    before = torch.get_num_threads()
    tuner = StepThreads()
    for _ in range(3):
        with tuner.step(8) as threads:
            assert torch.get_num_threads() == threads
        assert torch.get_num_threads() == before


def test_timing_on_a_thread_of_its_own_runs_on_the_serving_thread_count_and_gives_back_the_callers() -> None:
    """Inside ``one_intra_op_thread`` (loading), ``on_a_thread_of_its_own`` runs its function with the thread count
    steps run with (``serving_threads``), returns its value or raises its error, and leaves the caller's count."""
    from radixserve.runtime.threads import on_a_thread_of_its_own, one_intra_op_thread, serving_threads

    configured = torch.get_num_threads()
    seen: list[int] = []
    with one_intra_op_thread():
        assert torch.get_num_threads() == 1 and serving_threads() == configured
        got = on_a_thread_of_its_own(lambda: seen.append(torch.get_num_threads()) or "done", serving_threads())
        assert got == "done" and seen == [configured] and torch.get_num_threads() == 1
        with pytest.raises(ZeroDivisionError):
            on_a_thread_of_its_own(lambda: 1 / 0, 2)
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == configured and serving_threads() == configured
