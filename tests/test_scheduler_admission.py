"""Admission arithmetic of the scheduler, on the scheduler and KV cache manager alone (no model).

Admission keeps KV in reserve for the tokens running requests will still generate. Two ways that reserve can be
wrong: counting slots already allocated this step a second time, and reserving all of a huge ``max_new_tokens``
(the server sets it to all the room left when a client omits ``max_tokens``, as the OpenAI SDK does).
"""

from __future__ import annotations

from radixserve.runtime.batch import BatchPlan
from radixserve.runtime.config import EngineConfig
from radixserve.runtime.kv_cache import KVCacheManager
from radixserve.runtime.request import Req
from radixserve.runtime.sampling_params import SamplingParams
from radixserve.runtime.scheduler import Scheduler


def _scheduler(num_slots: int, **config) -> Scheduler:
    cfg = EngineConfig(max_total_tokens=num_slots, **config)
    return Scheduler(cfg, KVCacheManager(num_slots, enable_radix=True, strict=True))


def _complete(plan: BatchPlan) -> None:
    """What the engine does after a step: the chunks' KV is computed (nothing is sampled here)."""
    for chunk in plan.chunks:
        chunk.req.num_computed = chunk.end


def _prompt(i: int, n: int) -> list[int]:
    return [1000 * (i + 1) + j for j in range(n)]  # no two requests share a prefix


def test_one_step_admits_every_request_that_fits() -> None:
    """Five 190-token prompts fit a 1,000-slot pool together; the step that admits them must see that, not count
    each admitted prompt's slots twice (once allocated, once reserved)."""
    sched = _scheduler(1000, chunked_prefill_size=2048)
    for i in range(5):
        sched.add(Req(f"r{i}", _prompt(i, 190), SamplingParams(max_new_tokens=1)))
    plan = sched.schedule()
    assert plan is not None
    assert len(plan.chunks) == 5, [c.req.rid for c in plan.chunks]


def test_a_running_prefill_is_not_reserved_twice() -> None:
    """A long prompt finishing its prefill this step has its last chunk allocated already; the room that leaves
    (700 slots) admits a 100-token request."""
    sched = _scheduler(2600, chunked_prefill_size=1024)
    sched.add(Req("long", _prompt(0, 1900), SamplingParams(max_new_tokens=1)))
    first = sched.schedule()
    assert first is not None and [c.end for c in first.chunks] == [1024]
    _complete(first)
    sched.add(Req("small", _prompt(1, 100), SamplingParams(max_new_tokens=1)))
    second = sched.schedule()
    assert second is not None
    assert [c.req.rid for c in second.chunks] == ["long", "small"]


def test_requests_without_max_tokens_do_not_block_admission() -> None:
    """16 chat requests whose max_new_tokens is all the room left (16,384-token pool): at least 8 run at once."""
    pool = 16384
    sched = _scheduler(pool)
    for i in range(16):
        prompt = _prompt(i, 30)
        sched.add(Req(f"r{i}", prompt, SamplingParams(max_new_tokens=pool - len(prompt))))
    plan = sched.schedule()
    assert plan is not None
    assert len(sched.running) >= 8, len(sched.running)


def test_drafts_proposed_for_another_state_of_the_sequence_are_dropped() -> None:
    """Drafts continue the sequence they were proposed for: after a step that moved it on without verifying them
    (the prefill of a retracted request, a jump-forward's chunk), they are dropped, not verified against a grammar
    that has moved on (that once failed constrained requests under speculation)."""
    sched = _scheduler(200)
    req = Req("r", _prompt(0, 8), SamplingParams(max_new_tokens=8))
    sched.add(req)
    _complete(sched.schedule())  # the prompt's KV
    req.output_ids.append(5)  # the sampled token: the request decodes next
    req.draft_ids, req.draft_base = [6, 7], req.total
    plan = sched.schedule()
    assert plan is not None and plan.chunks[0].draft == (6, 7)
    req.num_computed = plan.chunks[0].end
    sched.cache.trim(req)  # the drafts rejected
    req.output_ids.append(9)
    req.draft_ids, req.draft_base = [1, 2], req.total - 1  # proposed before the sequence moved on
    plan = sched.schedule()
    assert plan is not None and plan.chunks[0].draft == () and plan.chunks[0].is_decode


def test_priority_orders_admission_and_makes_room() -> None:
    """--schedule-policy priority (vLLM's): the lowest value is admitted first, and running requests of a worse
    priority go back to the queue while a better one cannot be admitted; equal priorities never preempt."""
    sched = _scheduler(4096, schedule_policy="priority", max_running_requests=2)
    for rid, prio in (("low-a", 5), ("low-b", 5), ("mid", 1)):
        sched.add(Req(rid, _prompt(len(sched.waiting), 20), SamplingParams(max_new_tokens=50, priority=prio)))
    plan = sched.schedule()
    assert plan is not None and [c.req.rid for c in plan.chunks] == ["mid", "low-a"]
    _complete(plan)
    sched.add(Req("urgent", _prompt(9, 20), SamplingParams(max_new_tokens=50, priority=0)))
    plan = sched.schedule()
    assert plan is not None
    running = {r.rid for r in sched.running}
    assert running == {"mid", "urgent"}, running  # low-a made room (the worst priority), mid kept its place
    assert [r.rid for r in sched.waiting][:1] == ["low-a"] and sched.num_retractions == 1
    sched.add(Req("also-0", _prompt(10, 20), SamplingParams(max_new_tokens=50, priority=0)))
    sched.schedule()
    assert {r.rid for r in sched.running} == {"urgent", "also-0"}  # mid (1) made room; urgent (0) did not
    sched.cache.check(sched.holders())


def test_retraction_takes_the_worst_priority_first() -> None:
    sched = _scheduler(4096, schedule_policy="priority")
    reqs = [Req(f"r{p}", _prompt(p, 20), SamplingParams(max_new_tokens=50, priority=p)) for p in (3, 0, 7, 1)]
    for req in reqs:
        sched.add(req)
    _complete(sched.schedule())
    reqs[2].output_ids = [1] * 10  # progress does not protect a worse priority
    assert sched._retract_one() and [r.rid for r in sched.waiting] == ["r7"]
    # Under the other policies every priority is 0: the least progress goes first, as before.
    lpm = _scheduler(4096)
    for i in range(3):
        lpm.add(Req(f"q{i}", _prompt(i, 20), SamplingParams(max_new_tokens=50)))
    _complete(lpm.schedule())
    lpm.running[0].output_ids, lpm.running[2].output_ids = [1, 1], [1]
    assert lpm._retract_one() and [r.rid for r in lpm.waiting] == ["q1"]


def test_priority_preemption_retracts_no_more_than_it_needs() -> None:
    """One slot short at the running cap: one retraction, and the admission ratio is left as it was (raising it
    per retraction made every next one look necessary: 11 of 30 requests went for a place that one freed). None
    at all when every worse request together would not make the room."""
    sched = _scheduler(8192, schedule_policy="priority", max_running_requests=6)
    for i in range(6):
        sched.add(Req(f"low{i}", _prompt(i, 20), SamplingParams(max_new_tokens=50, priority=5)))
    _complete(sched.schedule())
    ratio = sched.new_token_ratio
    sched.add(Req("urgent", _prompt(7, 20), SamplingParams(max_new_tokens=50, priority=0)))
    sched.schedule()
    assert sched.num_retractions == 1 and "urgent" in {r.rid for r in sched.running}
    assert sched.new_token_ratio <= ratio
    tight = _scheduler(1000, schedule_policy="priority", chunked_prefill_size=1024)
    tight.add(Req("big-0", _prompt(0, 600), SamplingParams(max_new_tokens=10, priority=0)))
    tight.add(Req("small-5", _prompt(1, 100), SamplingParams(max_new_tokens=10, priority=5)))
    _complete(tight.schedule())
    tight.add(Req("mid-1", _prompt(2, 500), SamplingParams(max_new_tokens=10, priority=1)))
    tight.schedule()
    assert tight.num_retractions == 0 and {r.rid for r in tight.running} == {"big-0", "small-5"}


def _step(sched: Scheduler) -> BatchPlan | None:
    """A step as the engine runs it: computed chunks go to the tree, a sampling chunk appends a token; then the
    KV accounting check."""
    plan = sched.schedule()
    for chunk in plan.chunks if plan else ():
        chunk.req.num_computed = chunk.end
        if not chunk.is_decode:
            sched.cache.cache_prefix(chunk.req)
        if chunk.sample:
            chunk.req.output_ids.append(7)
    sched.cache.check(sched.holders())
    return plan


def _req(rid: str, prompt: list[int], priority: int, max_new: int = 50) -> Req:
    return Req(rid, prompt, SamplingParams(max_new_tokens=max_new, priority=priority))


def test_a_request_retracted_for_an_urgent_one_does_not_take_its_place() -> None:
    """Priority 1 makes room for A (priority 0), whose prompt continues one being prefilled: A waits a step for
    that shared head, and the room stays its own. (It went back to the request just retracted, which the next
    step retracted again.)"""
    sched = _scheduler(1000, schedule_policy="priority", max_running_requests=2, chunked_prefill_size=64)
    sched.add(_req("low", _prompt(9, 10), 1))
    _step(sched)
    sched.add(_req("head", _prompt(0, 100), 0))
    _step(sched)
    sched.add(_req("urgent", [*_prompt(0, 100), 5], 0))
    for _ in range(3):
        _step(sched)
    assert {r.rid for r in sched.running} == {"head", "urgent"}
    assert [r.num_retractions for r in sched.waiting] == [1]


def _head_and_low() -> tuple[list[int], Scheduler]:
    """A 500-slot pool holding a 200-token head (priority 0, cached in the tree) and a 199-token request of
    priority 1: 99 slots free. Returns the head's tokens and the scheduler."""
    system = _prompt(0, 200)
    sched = _scheduler(500, schedule_policy="priority", chunked_prefill_size=2048)
    sched.add(_req("head", system, 0, max_new=1))
    sched.add(_req("low", _prompt(3, 199), 1, max_new=1))
    for _ in range(2):
        _step(sched)
    return system, sched


def test_priority_preemption_counts_shared_prefixes_once() -> None:
    """Prefixes held in the tree for several requests: the urgent request's cached head needs no new KV, so
    nothing is retracted for it; and retracting two requests that share a head frees that head only if no request
    staying holds it, so none is retracted when that would not make the room."""
    system, sched = _head_and_low()
    sched.add(_req("urgent", [*system, *_prompt(5, 20)], 0, max_new=1))  # 99 slots free: its 20 new tokens fit
    _step(sched)
    assert sched.num_retractions == 0 and {r.rid for r in sched.running} == {"head", "low", "urgent"}

    sched = _scheduler(500, schedule_policy="priority", chunked_prefill_size=2048)
    sched.add(_req("head", system, 0, max_new=1))
    _step(sched)
    for i in (3, 4):
        sched.add(_req(f"low{i}", [*system, *_prompt(i, 10)], 1, max_new=1))
    for _ in range(2):
        _step(sched)
    sched.add(_req("big", _prompt(6, 299), 0, max_new=1))  # retracting both lows frees 22 slots, not 299
    _step(sched)
    assert sched.num_retractions == 0 and {r.rid for r in sched.running} == {"head", "low3", "low4"}


def test_priority_preemption_counts_no_shared_prefix_for_an_embedding_that_pools_every_token() -> None:
    """Mean pooling reads every prompt token's hidden state, so it takes no cached prefix: the head another request
    holds does not make room for it, and the request of a worse priority is retracted."""
    from radixserve.runtime.pooling import Pooling

    system, sched = _head_and_low()
    mean = SamplingParams(max_new_tokens=0, priority=0, pooling=Pooling("mean"))
    sched.add(Req("urgent", [*system, *_prompt(5, 20)], mean))  # 220 new slots; 99 free
    _step(sched)
    assert sched.num_retractions == 1 and {r.rid for r in sched.running} >= {"urgent"}


def test_priority_preemption_makes_room_for_the_request_admission_tries_first() -> None:
    """Admission tries the longest cached prefix first among equal priorities: preemption judges that request,
    not the first to arrive (which could not fit anyway, and nothing was retracted for either)."""
    system = _prompt(0, 200)
    sched = _scheduler(500, schedule_policy="priority", max_running_requests=2, chunked_prefill_size=2048)
    sched.add(_req("head", system, 0, max_new=1000))
    sched.add(_req("low", _prompt(3, 50), 1, max_new=1000))
    _step(sched)
    sched.add(_req("huge", _prompt(7, 400), 0, max_new=1))
    sched.add(_req("follow-up", [*system, 1, 2, 3, 4, 5], 0, max_new=1))
    _step(sched)
    assert {r.rid for r in sched.running} == {"head", "follow-up"}
    assert [r.rid for r in sched.waiting] == ["low", "huge"]
