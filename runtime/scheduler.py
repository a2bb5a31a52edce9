"""Continuous batching with chunked prefill, cache-aware admission and retraction.

The scheduler owns the waiting queue, the running set and every request's slot list; it hands the model runner
one ``BatchPlan`` per step. One step is: make room for every decode (evict, then retract the requests with the
least progress), continue partial prefills, then admit waiting requests while the prefill token budget, the
batch size cap and the KV reservation allow.

With ``--schedule-policy priority`` (vLLM's): a request's ``priority`` orders admission (lower first; longest
cached prefix among equals), retraction takes the worst priority first, and before each step running requests of
a worse priority than the best waiting one go back to the queue while that one could not be admitted (the
running cap, or too little KV). Under the other policies every priority is 0, and the same rules reduce to theirs.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable

from radixserve.runtime.batch import BatchPlan, ScheduledChunk
from radixserve.runtime.config import EngineConfig
from radixserve.runtime.kv_cache import KVCacheManager
from radixserve.runtime.request import FinishReason, Req

logger = logging.getLogger("radixserve.scheduler")

# Share of a running request's remaining max_new_tokens that admission keeps in reserve. It starts cautious,
# relaxes while no retraction happens, and tightens again on each retraction (requests often stop early, so
# reserving all of max_new_tokens would leave the pool half empty).
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.15
NEW_TOKEN_RATIO_DECAY = 0.002
# A waiting request that shares at least this many not-yet-cached tokens with one admitted in the same step, and
# at least half of what it would compute, waits a step so the shared part is computed once and then hit in the
# cache. (Deferring for a short shared head, like a chat template's default system prompt, costs a whole step of
# time to first token; an embedding or a score read at the last token, which generates nothing, always waits.)
IN_BATCH_PREFIX_DEFER = 32
# Beyond this many waiting requests, longest-prefix ordering costs more than it saves.
LPM_MAX_QUEUE = 256
# The most of a request's remaining max_new_tokens that admission reserves KV for (SGLang clips at 4,096). A
# client that omits max_tokens (the OpenAI SDK and LangChain do by default) gets all the room left in the context
# as its budget; reserving a share of that would let a handful of such requests hold back every other. Outputs
# that do run long are what retraction is for. On small pools the clip is an eighth of the pool, so that at the
# initial ratio a dozen short-prompt requests run at once.
MAX_RESERVED_NEW_TOKENS = 4096
# Below this many shared tokens, attending to a cached prefix once per group of decode rows (cascade attention)
# costs more than it saves.
MIN_SHARED_PREFIX = 64


def _retraction_order(req: Req) -> tuple[int, int, float]:
    """The request retracted first has the largest key: the worst priority, then the least progress, then the
    latest arrival."""
    return (req.params.priority, -len(req.output_ids), req.arrival_time)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Scheduler:
    def __init__(self, config: EngineConfig, cache: KVCacheManager) -> None:
        self.config = config
        self.cache = cache
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.num_retractions = 0
        self.reserve_clip = min(MAX_RESERVED_NEW_TOKENS, max(1, cache.num_slots // 8))
        # Requests that scheduling had to fail (no KV for them and nothing left to retract); the engine core
        # takes them after each ``schedule`` and finishes them.
        self.failed: list[Req] = []

    # --- queue --------------------------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def remove(self, req: Req) -> None:
        """Take a finished or aborted request out and give back its KV."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.cache.release(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def holders(self) -> Iterable[Req]:
        """Requests that may hold KV (for the accounting check)."""
        return list(self.running) + list(self.waiting)

    # --- one step -----------------------------------------------------------------------------------------
    def schedule(self) -> BatchPlan | None:
        self._preempt_for_priority()
        decodes = self._schedule_decodes()
        budget = self.config.chunked_prefill_size
        extends: list[ScheduledChunk] = []
        for req in self.running:
            if not self._is_decoding(req):
                if budget <= 0:
                    break
                chunk = self._extend_chunk(req, budget)
                if chunk is None:
                    break
                budget -= chunk.end - chunk.start
                extends.append(chunk)
        if budget > 0:
            extends.extend(self._admit(budget, extends))
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        if not decodes and not extends:
            if self.running:
                # No running request got a slot and none will finish to free one: without a retraction (or a
                # failure, when one request is left) nothing could ever run again.
                self._relieve()
            return None
        # A request admitted with all but its last token cached is a one-token chunk too: it joins the decodes,
        # which the plan must list first (the model runner lays out decode rows before extends).
        chunks = decodes + extends
        return BatchPlan(tuple([c for c in chunks if c.is_decode] + [c for c in chunks if not c.is_decode]))

    def lookahead(self, reqs: list[Req]) -> BatchPlan | None:
        """The decode step after the one in flight, for ``reqs`` (each in that step, as a decode whose token is not
        appended yet): a slot each for the position after it. ``None``, with nothing taken, when the pool is short
        (cached prefixes may be evicted; nothing is retracted): the caller then lets the step in flight finish."""
        slots = self.cache.alloc(len(reqs))
        if slots is None:
            return None
        chunks = []
        for req, slot in zip(reqs, slots, strict=True):
            req.slots.append(slot)
            start = req.num_computed + 1
            chunks.append(ScheduledChunk(req, start, start + 1, sample=True))
        return BatchPlan(tuple(chunks))

    def _is_decoding(self, req: Req) -> bool:
        return req.num_computed > 0 and req.total - req.num_computed == 1

    def _schedule_decodes(self) -> list[ScheduledChunk]:
        while True:
            decoding = [r for r in self.running if self._is_decoding(r)]
            if not decoding:
                return []
            slots = self.cache.alloc(len(decoding))
            if slots is not None:
                break
            self._relieve()
        shared = self.cache.shared_prefixes(decoding, MIN_SHARED_PREFIX)
        chunks = []
        many = len(decoding) > self.config.speculative_max_batch
        for req, slot, prefix in zip(decoding, slots, shared):
            req.slots.append(slot)
            draft = self._draft_slots(req, many)
            if draft:
                chunks.append(ScheduledChunk(req, req.num_computed, req.total, sample=True, draft=draft))
            else:
                chunks.append(ScheduledChunk(req, req.num_computed, req.total, sample=True, shared_prefix=prefix))
        return chunks

    def _draft_slots(self, req: Req, many: bool) -> tuple[int, ...]:
        """The request's drafts, with a KV slot each, or none: when the batch is too large for greedy rows to
        gain (see ``runtime.speculative``) or the pool has no spare slots (drafts never evict or retract)."""
        draft, req.draft_ids = tuple(req.draft_ids), []
        if draft and req.draft_base != req.total:
            # Proposed for another state of the sequence (a step ran in between without consuming them, e.g. the
            # prefill of a retracted request): a constrained request's grammar has moved on since.
            draft = ()
        if not draft or (many and req.params.greedy) or self.cache.num_free < len(draft):
            return ()
        slots = self.cache.alloc(len(draft))
        if slots is None:
            return ()
        req.slots.extend(slots)
        return draft

    def _relieve(self) -> None:
        """Free KV for the others: retract a request, or, with one left, fail it (its KV is freed)."""
        if self._retract_one():
            return
        req = self.running.pop()
        # The engine refuses requests larger than the pool, so this means KV was lost (a leak, a fault); the
        # request fails with a reason and the engine goes on serving.
        req.fail(
            f"the KV cache ({self.cache.num_slots} tokens) has no free slot for this request and nothing is left "
            "to retract; retry it, and report this if it repeats"
        )
        self.cache.release(req)
        self.failed.append(req)
        logger.error("%s failed: KV pool exhausted with nothing left to retract", req.rid)

    def take_failed(self) -> list[Req]:
        failed, self.failed = self.failed, []
        return failed

    def _retract_one(self) -> bool:
        """Send the running request of the worst priority, and then the least progress, back to the queue, its KV
        cached for the resume."""
        # A lone request always fits (the engine refuses anything larger than the pool), so retracting it
        # could only loop; running out with one request left means the accounting is broken.
        if len(self.running) <= 1:
            return False
        self._retract(max(self.running, key=_retraction_order))
        return True

    def _preempt_for_priority(self) -> None:
        """Retract running requests of a worse priority than the waiting request admission tries first, while that
        one could not be admitted: the running cap is reached, or the KV it needs is not there (see the module
        docstring). None is retracted when all of them together would not make that room.

        The KV count is exact where requests share a prefix: a slot frees only once every request holding it is
        retracted (``_freed_slots``), and the part of ``best``'s prompt that a request staying in the batch holds
        in the tree needs no new KV (admission shares it)."""
        if self.config.schedule_policy != "priority" or not self.waiting or not self.running:
            return
        best = self._ordered_waiting()[0]  # the one ``_admit`` tries first (it stops at the first that fails)
        worse = sorted((r for r in self.running if r.params.priority > best.params.priority), key=_retraction_order)
        need = self._future_need(best)

        def room(freed: list[Req]) -> bool:  # (their KV goes to the tree or the free list: available either way)
            cap = len(self.running) - len(freed) < self.config.max_running_requests
            kept = [r for r in self.running if r not in freed]
            kv = self.cache.available() + self._freed_slots(freed, kept)
            reserved = self._reserved() - sum(self._future_need(r) for r in freed)
            return cap and kv - reserved >= need - self._held_prefix(best, kept)

        if not worse or room([]) or not room(worse):
            return
        while worse and not room([]):
            self._retract(worse.pop(), tighten=False)  # the ratio is the admission's estimate: left as it was

    @staticmethod
    def _freed_slots(freed: list[Req], kept: list[Req]) -> int:
        """Slots that retracting ``freed`` makes available: those no request in ``kept`` holds too (requests share
        slots only through the tree's prefixes)."""
        if not freed:
            return 0
        held = {slot for r in kept for slot in r.slots}
        return len({slot for r in freed for slot in r.slots} - held)

    @staticmethod
    def _held_prefix(req: Req, kept: list[Req]) -> int:
        """Tokens of ``req``'s prompt that a request in ``kept`` holds in the tree (locked: not in ``available()``,
        and admission shares them rather than allocating)."""
        pooling = req.params.pooling
        if pooling is not None and pooling.needs_whole_prompt:  # (mean or first-token pooling takes no prefix)
            return 0
        tokens = req.cache_ids
        shared = (min(_common_prefix(tokens, r.cache_ids), len(r.slots), len(r.prompt_ids)) for r in kept)
        return min(max(shared, default=0), len(tokens) - 1)  # (its last token is always computed)

    def _retract(self, victim: Req, tighten: bool = True) -> None:
        """Send ``victim`` back to the head of the queue, its KV cached for the resume. ``tighten``: a retraction
        for want of KV says the reservation ratio was too low."""
        self.running.remove(victim)
        self.cache.release(victim)
        victim.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(victim)
        if tighten:
            self.new_token_ratio = min(1.0, self.new_token_ratio + 0.3)
        logger.info("retracted %s (%d tokens generated) to free KV", victim.rid, len(victim.output_ids))

    def _extend_chunk(self, req: Req, budget: int) -> ScheduledChunk | None:
        n = min(req.total - req.num_computed, budget)
        slots = self.cache.alloc(n)
        if slots is None:
            return None
        start = req.num_computed
        req.slots.extend(slots)
        return ScheduledChunk(req, start, start + n, sample=start + n == req.total)

    def _future_need(self, req: Req) -> float:
        """KV the request is expected to need beyond the slots it holds (this step's included): the rest of its
        tokens, and a share of its remaining output (clipped, see ``MAX_RESERVED_NEW_TOKENS``)."""
        remaining = min(max(0, req.params.max_new_tokens - len(req.output_ids)), self.reserve_clip)
        return req.total - len(req.slots) + remaining * self.new_token_ratio

    def _reserved(self) -> float:
        """KV that running requests are expected to still need."""
        return sum(self._future_need(r) for r in self.running)

    def _ordered_waiting(self) -> list[Req]:
        waiting = list(self.waiting)
        policy = self.config.schedule_policy
        scores: dict[int, int] = {}
        if policy in ("lpm", "priority") and self.cache.tree is not None and len(waiting) <= LPM_MAX_QUEUE:
            scores = {id(r): self.cache.peek_prefix_len(r.cache_ids) for r in waiting}
        if scores or policy == "priority":
            # Best priority first; then retracted requests resume first; then longest cached prefix; stable on
            # arrival order.
            waiting.sort(key=lambda r: (r.params.priority, r.num_retractions == 0, -scores.get(id(r), 0)))
        return waiting

    def _admit(self, budget: int, extends: list[ScheduledChunk]) -> list[ScheduledChunk]:
        admitted: list[ScheduledChunk] = []
        if not self.waiting:
            return admitted
        # Prompts being prefilled this step; a waiting request sharing a long uncached head with one of them
        # waits so that head is computed once.
        in_flight = [c.req.cache_ids for c in extends]  # (a salted prompt shares nothing with another salt's)
        reserved = self._reserved()
        deferred: int | None = None  # the best priority that waits a step for its shared head
        for req in self._ordered_waiting():
            if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                break
            if deferred is not None and req.params.priority > deferred:
                break  # the room is kept for the request that waits (it may be what a preemption freed)
            tokens = req.cache_ids
            if self.cache.tree is not None and in_flight:
                cached = self.cache.peek_prefix_len(tokens)
                shared = max(_common_prefix(tokens, other) for other in in_flight) - cached
                # (An embedding or a score read at the last token has no first token to hurry: it always waits for
                # a shared head. Mean or first-token pooling takes no cached prefix: waiting would gain it nothing.)
                pooling = req.params.pooling
                worth = 2 * shared >= len(tokens) - cached or (pooling is not None and not pooling.needs_whole_prompt)
                if shared >= IN_BATCH_PREFIX_DEFER and worth:
                    deferred = req.params.priority if deferred is None else deferred
                    continue
            cached = self.cache.admit(req)
            if self.running and self.cache.available() - reserved < self._future_need(req):
                self.cache.release(req)
                break
            chunk = self._extend_chunk(req, budget)
            if chunk is None:
                self.cache.release(req)
                break
            if req.cached_tokens is None:
                req.cached_tokens = cached
            self.waiting.remove(req)
            self.running.append(req)
            budget -= chunk.end - chunk.start
            reserved += self._future_need(req)  # its chunk's slots are allocated: only the rest is reserved
            admitted.append(chunk)
            in_flight.append(tokens)
        return admitted

    def fail_all(self, reason: FinishReason, error: str | None = None) -> list[Req]:
        """Finish every request (engine shutdown or a fatal fault) and free their KV."""
        reqs = list(self.running) + list(self.waiting)
        for req in reqs:
            req.finish_reason = reason
            req.error = error
            self.remove(req)
        return reqs
