"""The engine core: one synchronous ``step()`` = schedule, run the model, apply results.

Single-threaded by design: the ``Engine`` wraps it in a thread, tests drive it directly. It owns the scheduler
(and through it the KV cache manager) and the model runner; requests enter with ``add`` and leave as
``ReqOutput`` messages returned from ``step``/``abort``.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from radixserve.runtime import envs
from radixserve.runtime.batch import BatchPlan, Failure, ScheduledChunk, StepResult
from radixserve.runtime.config import EngineConfig
from radixserve.runtime.detokenizer import IncrementalDetokenizer, StopChecker
from radixserve.runtime.distributed.tensor_parallel import WorkerDiedError
from radixserve.runtime.grammar import GrammarViolation, grammar_cut, grammar_failure
from radixserve.runtime.kv_cache import KVCacheManager
from radixserve.runtime.kv_tier import KVTier
from radixserve.runtime.model_runner import ModelRunner, PendingStep
from radixserve.runtime.pooling import gather
from radixserve.runtime.request import ErrorCode, FinishReason, Req, ReqOutput
from radixserve.runtime.scheduler import Scheduler
from radixserve.runtime.speculative import Drafter, NgramDrafter, can_speculate
from radixserve.runtime.stats import EngineStats
from radixserve.runtime.transfer import tensor_on
from radixserve.runtime.validation import validate_request

if TYPE_CHECKING:
    from radixserve.runtime.lora import LoRAAdapter
    from radixserve.runtime.pooling import PoolingModel

logger = logging.getLogger("radixserve.engine")


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        tokenizer,
        eos_token_ids: set[int],
        vocab_size: int,
        max_context_len: int,
        tier: KVTier | None = None,
        drafter: Drafter | None = None,
        pooling: PoolingModel | None = None,
    ) -> None:
        self.config = config
        self.pooling = pooling  # --runner pooling: requests are embeddings (``SamplingParams.pooling``)
        self.runner = runner
        # The adapters a request may name: replaced whole on the engine thread (read from any thread).
        self.lora_names = self.runner.loras.names if self.runner.loras is not None else ()
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.max_context_len = max_context_len
        self.check_integrity = envs.check_integrity()
        self.cache = KVCacheManager(
            runner.pool.num_slots, enable_radix=not config.disable_radix_cache, strict=self.check_integrity, tier=tier
        )
        self.scheduler = Scheduler(config, self.cache)
        self.stats = EngineStats()
        self._by_rid: dict[str, Req] = {}
        # Constrained requests whose grammar is still compiling; they join the scheduler when it is ready.
        self.grammar_queue: list[Req] = []
        self.jump_forward = not config.disable_jump_forward
        # The draft model's drafter is built by the ``Engine`` (it loads a model); the n-gram one needs nothing.
        self.drafter = drafter
        if drafter is None and config.speculative_algorithm == "ngram":
            k, lo, hi = config.speculative_num_draft_tokens, config.speculative_ngram_min, config.speculative_ngram_max
            self.drafter = NgramDrafter(k, min_n=lo, max_n=hi)
        self._to_propose: list[Req] = []  # requests that took a token this step: they may draft for the next
        # Overlap (CUDA graphs): a greedy decode step launched and not applied yet; the next is launched before it
        # is read back, so the device runs while its results are applied (``_advance``).
        # (self.drafter: an ngram drafter is made above, with no drafter passed in)
        self.overlap = runner.graphs is not None and not config.disable_overlap_schedule and self.drafter is None
        self._pending: PendingStep | None = None

    # --- admission ----------------------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params) -> None:
        """Raise ``ValueError`` if the request can never be served; cheap, safe to call from any thread."""
        validate_request(
            prompt_ids,
            params,
            self.vocab_size,
            self.max_context_len,
            self.cache.num_slots,
            self.config.schedule_policy,
            self.lora_names,
            self.pooling,
        )

    def add(self, req: Req) -> None:
        self.validate(req.prompt_ids, req.params)
        if req.rid in self._by_rid:
            raise ValueError(f"request id {req.rid!r} is already in use")
        req.detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids, req.params.skip_special_tokens)
        req.stop_checker = StopChecker(req.params.stop) if req.params.stop else None
        if req.params.lora_name is not None:
            assert self.runner.loras is not None  # (validate checked the name)
            req.lora_key = self.runner.loras.adapters[req.params.lora_name].key
        self._by_rid[req.rid] = req
        self.cache.prefetch(req)
        if req.grammar_future is not None:
            self.grammar_queue.append(req)
        else:
            self.scheduler.add(req)

    def poll_grammars(self) -> list[ReqOutput]:
        """Move requests whose grammar finished compiling into the scheduler; fail those whose compile failed."""
        outputs: list[ReqOutput] = []
        still: list[Req] = []
        for req in self.grammar_queue:
            fut = req.grammar_future
            if not fut.done():
                still.append(req)
                continue
            req.grammar_future = None
            exc = fut.exception()
            if exc is not None:
                req.fail(f"invalid constraint: {exc}", ErrorCode.GRAMMAR)
                outputs.append(self._finish(req))
            else:
                req.grammar = fut.result().new_matcher()
                self.scheduler.add(req)
        self.grammar_queue = still
        return outputs

    def abort(self, rid: str) -> ReqOutput | None:
        req = self._by_rid.get(rid)
        if req is None or req.finished:
            return None
        req.finish_reason = FinishReason.ABORT
        self.stats.requests_aborted += 1
        if req in self.grammar_queue:
            self.grammar_queue.remove(req)
        return self._finish(req)

    def has_work(self) -> bool:
        """Whether ``step`` has something to compute now (compiling grammars wake the loop when done)."""
        return (
            self._pending is not None
            or self.scheduler.has_work()
            or any(r.grammar_future.done() for r in self.grammar_queue)
        )

    # --- one step -----------------------------------------------------------------------------------------
    def step(self) -> list[ReqOutput]:
        outputs = self.poll_grammars() if self.grammar_queue else []
        if self._pending is not None:
            outputs += self._advance()
            if self._pending is not None:  # the next step is in flight already
                return outputs
        plan = self.scheduler.schedule()
        outputs += [self._finish(req) for req in self.scheduler.take_failed()]
        if plan is None:
            return outputs
        self.stats.forward_steps += 1
        if self.overlap and self._may_chain(plan) and self.runner.can_launch([c.req for c in plan.chunks]):
            try:
                self._pending = self.runner.launch(plan)  # applied by the next ``step``, after the one after it
                return outputs
            except Exception:  # noqa: BLE001 - run it the plain way, whose halving finds a request at fault
                logger.exception("launching a decode step failed; running it without the overlap")
        result = self._run(plan)
        outputs += self._apply(plan, result)
        if self.check_integrity:
            self.cache.check(self.scheduler.holders())
        return outputs

    def _may_chain(self, plan: BatchPlan) -> bool:
        """Whether the step after ``plan`` can be planned before ``plan``'s results are in: every row a plain
        decode, nobody waiting to be admitted (the next step would then be the scheduler's to plan)."""
        return (
            not self.scheduler.waiting
            and not self.grammar_queue
            and all(c.is_decode and not c.draft for c in plan.chunks)
        )

    def _continues(self, req: Req) -> bool:
        """Whether a request in the step in flight takes another token after it, as far as is known before its
        token is read: not finished, and neither its length nor the context ends it with that token."""
        return (
            not req.finished
            and len(req.output_ids) + 1 < req.params.max_new_tokens
            and req.total + 1 < self.max_context_len
        )

    def _advance(self) -> list[ReqOutput]:
        """Apply the launched step. When every row goes on decoding, the step after it is launched first (one
        more slot per request, its input tokens the launched step's, taken on the device), so the device runs it
        while this one's results are read, detokenized and sent. A request that turns out to stop here (EOS, a
        stop string) had a row in that next step for nothing: its slot was freed with the request, and the row's
        result is dropped when it is applied."""
        pending, self._pending = self._pending, None
        assert pending is not None
        nxt = None
        undo: list[Req] = []
        if self._may_chain(pending.plan):
            keep = [i for i, c in enumerate(pending.plan.chunks) if self._continues(c.req)]
            reqs = [pending.plan.chunks[i].req for i in keep]
            if reqs and self.runner.can_launch(reqs):
                plan = self.scheduler.lookahead(reqs)
                if plan is not None:
                    tokens = pending.tokens
                    if len(keep) < len(pending.plan.chunks):
                        tokens = tokens[tensor_on(keep, tokens.device)]  # not waiting for the step in flight
                    try:
                        nxt = self.runner.launch(plan, tokens)
                        self.stats.forward_steps += 1
                        self.stats.overlapped_steps += 1
                    except Exception:  # noqa: BLE001 - the scheduler plans the next step the plain way
                        logger.exception("launching the next decode step failed; it runs without the overlap")
                        undo = reqs
        outputs = self._apply(pending.plan, self.runner.finish(pending))
        for req in undo:  # the slot the lookahead took goes back (past num_computed once this step is applied)
            if not req.finished:
                self.cache.trim(req)
        if self.check_integrity:
            self.cache.check(self.scheduler.holders())
        self._pending = nxt
        return outputs

    def _run(self, plan: BatchPlan) -> StepResult:
        """Run the plan; if the step raises, rerun it in halves, so that a fault one request causes (its input, a
        kernel's limit) fails that request alone and the rest of the batch completes. Rerunning writes the same
        KV into the same slots; only a seeded request whose draw had already happened when the step raised can
        draw differently."""
        try:
            return self.runner.run(plan)
        except WorkerDiedError:
            raise  # no step can run any more: the engine stops and /health says why
        except Exception as exc:  # noqa: BLE001 - a model fault fails the requests that cause it, not the engine
            if len(plan.chunks) == 1:
                logger.exception("model step failed for request %s", plan.chunks[0].req.rid)
                return StepResult.failed(1, Failure(f"model step failed: {type(exc).__name__}: {exc}"))
            logger.warning(
                "model step of %d requests failed (%s: %s); rerunning it in halves to find the request at fault",
                len(plan.chunks),
                type(exc).__name__,
                exc,
            )
            first, second = plan.split()
            return self._run(first).then(self._run(second))

    def _apply(self, plan: BatchPlan, result: StepResult) -> list[ReqOutput]:
        outputs: list[ReqOutput] = []
        now = time.monotonic()
        for i, chunk in enumerate(plan.chunks):
            req = chunk.req
            if req.finished:
                continue
            try:
                out = self._apply_one(i, chunk, result, now)
            except Exception as exc:  # noqa: BLE001 - one request's fault (e.g. detokenizing) fails only it
                if isinstance(exc, GrammarViolation):
                    req.fail(str(exc), exc.code)
                else:
                    logger.exception("request %s failed while applying its step", req.rid)
                    req.fail(f"{type(exc).__name__}: {exc}")
                out = self._finish(req)
            if out is not None:
                outputs.append(out)
        if self._to_propose:
            self._propose(self._to_propose)
            self._to_propose = []
        self.stats.retractions = self.scheduler.num_retractions
        return outputs

    def _apply_one(self, i: int, chunk: ScheduledChunk, result: StepResult, now: float) -> ReqOutput | None:
        req = chunk.req
        if req.admit_time is None:
            req.admit_time = now
            self.stats.prompt_tokens += len(req.prompt_ids)
            self.stats.cached_prompt_tokens += req.cached_tokens or 0
        if i in result.errors:  # this step's KV is not computed (or not to be trusted): it is freed, not cached
            req.fail(result.errors[i].message, result.errors[i].code)
            return self._finish(req)
        if chunk.draft:
            return self._apply_draft(i, chunk, result, now)
        req.num_computed = chunk.end
        if result.prompt_logprobs and result.prompt_logprobs[i]:
            req.prompt_logprobs.extend(result.prompt_logprobs[i])
        if req.params.pooling is not None:
            gather(req, chunk.start, chunk.sample, result.pooled.get(i))
        if not chunk.is_decode:
            self.cache.cache_prefix(req)
        token = result.next_tokens[i]
        if token is None:
            if chunk.sample:  # max_new_tokens == 0: the prompt alone was asked for
                req.finish_reason = FinishReason.LENGTH
                return self._finish(req)
            return None
        self._append_token(req, token, result.logprobs[i], now)
        if self._can_jump(req):
            self._jump_forward(req, now)
        if req.finished:
            return self._finish(req)
        if self.drafter is not None:
            self._to_propose.append(req)
        return self._delta(req)

    def _apply_draft(self, i: int, chunk: ScheduledChunk, result: StepResult, now: float) -> ReqOutput | None:
        """A verified speculative chunk: the accepted drafts and the token after them join the output (as far as
        no stop condition ends it first); the slots of the rejected drafts go back to the pool."""
        req = chunk.req
        accepted = result.accepted.get(i, [])
        token = result.next_tokens[i]
        assert token is not None and self.drafter is not None
        self.stats.spec_steps += 1
        self.stats.spec_draft_tokens += len(chunk.draft)
        self.stats.spec_accepted_tokens += len(accepted)
        self.drafter.record(req, len(chunk.draft), len(accepted))
        for t in [*accepted, token]:
            self._append_token(req, t, None, now)
            if req.finished:
                break
        # Computed KV: the last token and the accepted drafts (all of the output, when a stop cut it short).
        req.num_computed = min(chunk.end + len(accepted), req.total)
        self.cache.trim(req)
        if self._can_jump(req):
            self._jump_forward(req, now)
        if req.finished:
            return self._finish(req)
        self._to_propose.append(req)
        return self._delta(req)

    def _propose(self, reqs: list[Req]) -> None:
        """Draft the next step's tokens for the requests that may speculate (``runtime.speculative``), in one
        call to the drafter. Greedy requests do not draft while more requests run than a step gains from (the
        scheduler also drops their drafts then, as the count of decoding requests may differ)."""
        assert self.drafter is not None
        busy = len(self.scheduler.running) > self.config.speculative_max_batch
        wants: list[tuple[Req, int]] = []
        for req in reqs:
            if req.finished or not can_speculate(req) or (busy and req.params.greedy):
                continue
            limit = min(req.params.max_new_tokens - len(req.output_ids), self.max_context_len - req.total) - 1
            if limit > 0:
                wants.append((req, limit))
        if not wants:
            return
        for (req, _), draft in zip(wants, self.drafter.propose_batch(wants), strict=True):
            req.draft_ids = grammar_cut(req.grammar, draft) if draft and req.grammar is not None else draft
            req.draft_base = req.total

    def _can_jump(self, req: Req) -> bool:
        """Whether the tokens the grammar forces may be appended without sampling: not when their logprobs are
        asked for, nor with ``allowed_token_ids`` (a forced token outside them must fail the request, in the
        sampler; banned words yield to a grammar that forces them, there and here alike)."""
        p = req.params
        return (
            not req.finished
            and req.grammar is not None
            and self.jump_forward
            and not p.return_logprob
            and not p.allowed_token_ids
        )

    def _jump_forward(self, req: Req, now: float) -> None:
        """Append the tokens the grammar forces next, without a forward pass each: their KV is computed with the
        next step's chunk (``total - num_computed > 1`` makes it an extend), which also samples what follows."""
        for token in req.grammar.forced_tokens():
            if req.finished:
                return
            self._append_token(req, token, None, now)
            req.num_forced_tokens += 1
            self.stats.forced_tokens += 1

    def _append_token(self, req: Req, token: int, logprob, now: float) -> None:
        n_before = len(req.output_ids)
        if req.first_token_time is None:
            req.first_token_time = now
        req.output_ids.append(token)
        self.stats.generated_tokens += 1
        if logprob is not None:
            req.output_logprobs.append(logprob)
        if req.grammar is not None and not req.grammar.accept_token(token):
            if req.grammar.error() is not None:
                raise GrammarViolation(grammar_failure(req, n_before).message)
            raise RuntimeError(f"token {token} was sampled outside the request's grammar")
        params = req.params
        n_out = len(req.output_ids)
        prev_len = len(req.detok.text)
        req.detok.add([token])
        req.output_text = req.detok.text
        if req.stop_checker is not None and n_out >= params.min_new_tokens:
            hit = req.stop_checker.check(req.output_text, prev_len)
            if hit is not None:
                cut, stop = hit
                req.output_text = req.output_text[: cut + len(stop) if params.include_stop_str_in_output else cut]
                req.finish_reason, req.matched_stop = FinishReason.STOP, stop
                return
        stop_token = n_out >= params.min_new_tokens and (
            token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos)
        )
        if stop_token:
            req.finish_reason, req.matched_stop = FinishReason.STOP, token
        elif req.grammar is not None and req.grammar.is_terminated():
            req.finish_reason = FinishReason.STOP  # the grammar is complete: nothing but EOS could follow
        elif n_out >= params.max_new_tokens or req.total >= self.max_context_len:
            req.finish_reason = FinishReason.LENGTH
        if req.finished:
            # Characters held back waiting for the rest of a multi-byte sequence are final now.
            req.detok.flush()
            req.output_text = req.detok.text
            if stop_token and not params.include_stop_str_in_output:
                # As vLLM and SGLang: a stop token's own text (one not skipped as special) is not part of the
                # answer, as a stop string is not.
                req.output_text = req.output_text[:prev_len]

    def _delta(self, req: Req) -> ReqOutput | None:
        """The part of the output not sent yet; text that may still turn out to start a stop string is held."""
        text_end = len(req.output_text)
        if not req.finished and req.stop_checker is not None:
            text_end -= req.stop_checker.hold_back(req.output_text)
        text_end = max(text_end, req.sent_text_len)
        new_tokens = req.output_ids[req.sent_token_len :]
        if not new_tokens and text_end == req.sent_text_len and not req.finished:
            return None
        out = ReqOutput(
            rid=req.rid,
            text=req.output_text[req.sent_text_len : text_end],
            token_ids=new_tokens,
            logprobs=req.output_logprobs[req.sent_logprob_len :],
            finished=req.finished,
            finish_reason=req.finish_reason,
            matched_stop=req.matched_stop,
            error=req.error,
            error_code=req.error_code,
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens or 0,
            prompt_logprobs=req.prompt_logprobs if req.finished and req.wants_prompt_logprobs else None,
            embedding=req.embedding if req.finished else None,
            queue_time=(req.admit_time - req.arrival_time)
            if req.sent_token_len == 0 and req.sent_text_len == 0 and req.admit_time is not None
            else None,
        )
        req.sent_text_len = text_end
        req.sent_token_len = len(req.output_ids)
        req.sent_logprob_len = len(req.output_logprobs)
        return out

    def _finish(self, req: Req) -> ReqOutput:
        req.finish_time = time.monotonic()
        self.scheduler.remove(req)
        if self.drafter is not None:
            self.drafter.release(req)
        self._by_rid.pop(req.rid, None)
        if req.finish_reason != FinishReason.ABORT:
            self.stats.requests_finished += 1
        out = self._delta(req)
        assert out is not None  # a finished request always yields its final message
        return out

    def flush_cache(self) -> bool:
        return self.cache.flush()

    def load_lora(self, adapter: LoRAAdapter) -> tuple[str, ...]:
        """Serve ``adapter`` from the next step on (``ValueError`` if its name is taken); the names served now."""
        assert self.runner.loras is not None
        self.runner.loras.add(adapter)
        self.lora_names = self.runner.loras.names
        return self.lora_names

    def unload_lora(self, name: str) -> tuple[str, ...]:
        """Stop serving the adapter ``name``: ``LookupError`` if there is none, ``ValueError`` while requests use it;
        the names served now. Its cached KV is left to eviction (no request can reach it: a new load has a new
        ``key``)."""
        assert self.runner.loras is not None
        if name not in self.runner.loras.adapters:
            raise LookupError(f"no LoRA adapter is named {name!r} on this server")
        users = sum(1 for r in self._by_rid.values() if r.params.lora_name == name)
        if users:
            raise ValueError(f"the LoRA adapter {name!r} is in use by {users} requests; unload it when they finish")
        self.runner.loras.remove(name)
        self.lora_names = self.runner.loras.names
        return self.lora_names

    def kv_usage(self) -> dict[str, int]:
        total = self.cache.num_slots
        free = self.cache.num_free
        evictable = self.cache.evictable
        return {
            "total_tokens": total,
            "free_tokens": free,
            "evictable_tokens": evictable,
            "cached_tokens": self.cache.cached,
            "in_use_tokens": total - free - evictable,
        }
