"""Drafts from a second, smaller model with the target's tokenizer (``--speculative-algorithm draft``).

The draft model runs in the engine process beside the target, on the same device and in the same dtype, with
its own weights, its own KV pool and its own slot allocator, all owned by ``DraftModelDrafter``. For each
request it keeps the draft KV of a prefix of the request's tokens (``DraftKV``). After each target step, one
``propose_batch`` call drafts for every request that may speculate:

1. **Rollback.** The tokens the draft KV holds are compared with the request's tokens. Past the first
   difference (a rejected draft, the target's own next token), the slots go back to the draft pool. So accepted
   drafts, jump-forward tokens and stops need no special case.
2. **Catch-up.** One batched pass computes, for every drafting request, the tokens its draft KV lacks: the whole
   prompt the first time, afterwards the target's last token plus any accepted draft whose KV was not computed.
   The last row of each request gives its first draft token.
3. **Drafting.** K - 1 batched one-token passes give the rest. The drafts' own KV stays, to be kept or rolled
   back on the next call.

A constrained request's drafts are the draft model's argmax among the tokens its grammar allows after the drafts
before them (its matcher advances through them and is rolled back after), so they never leave the grammar.

Drafts are the draft model's argmax. That is a deterministic proposal, so the target's verification
(``Sampler.verify``: accept a draft with the probability the target gives it) is exact whatever the request's
sampling parameters, and seeds reproduce. This is the "target-only" verification SGLang uses for its tree drafts.

Memory: the draft pool has as many slots as the target's (``Engine`` sizes both together). Draft KV is not
shared between requests (no radix tree): a draft model is small, so its prompt catch-up is cheap next to the
target's prefill. When the pool runs short, the draft KV of the least recently drafting requests is dropped
(they catch up again when they next draft). A request that still does not fit does not draft this step. Catch-up
is chunked: at most ``chunk_tokens`` prompt tokens per call over all requests, and a request whose catch-up is
unfinished does not draft yet.

Invariant: a request's tokens (``Req.all_ids``) only ever grow, so ``DraftKV.tokens[:valid]`` stays a prefix of
them; the draft slots of a request are in ``DraftKV.slots`` or in the free list, never both.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from radixserve.runtime import envs
from radixserve.runtime.attention import attention_backend
from radixserve.runtime.attention.base import AttentionBackend, ForwardContext
from radixserve.runtime.config import EngineConfig
from radixserve.runtime.grammar import grammar_mask
from radixserve.runtime.kv_pool import KVPool, SlotAllocator
from radixserve.runtime.loader import LoadedModel, load_model
from radixserve.runtime.request import Req
from radixserve.runtime.speculative import Drafter
from radixserve.runtime.step_layout import StepRow, lay_out
from radixserve.runtime.threads import StepThreads

logger = logging.getLogger("radixserve.speculative")


@dataclass
class DraftKV:
    """The draft model's KV of one request: ``slots[i]`` holds the K/V of ``tokens[i]`` at position ``i``."""

    tokens: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    valid: int = 0  # tokens[:valid] are known to equal the request's first tokens


@dataclass
class _Row:
    req: Req
    kv: DraftKV
    k: int  # drafts wanted (0: catch-up only)
    start: int  # position of the first token computed in the catch-up pass
    spare: list[int]  # free slots for the K/V of drafts 1 .. k-1, taken as they are computed
    drafts: list[int] = field(default_factory=list)
    advanced: int = 0  # draft tokens the request's grammar took while drafting (rolled back after)


class DraftModelDrafter(Drafter):
    def __init__(
        self,
        model: Any,
        pool: KVPool,
        backend: AttentionBackend,
        device: torch.device,
        *,
        max_draft: int,
        vocab_size: int,
        grammar_vocab: int,
        max_positions: int,
        chunk_tokens: int,
    ) -> None:
        super().__init__(max_draft)
        self.model, self.pool, self.backend, self.device = model, pool, backend, device
        self.allocator = SlotAllocator(pool.num_slots, strict=envs.check_integrity())
        self.kv: OrderedDict[str, DraftKV] = OrderedDict()  # least recently drafting first
        self.vocab_size = vocab_size  # the smaller of the two models' vocabularies: drafts stay inside both
        self.grammar_vocab = grammar_vocab  # the target's: the size of its grammars' masks
        self.max_positions = max_positions
        self.chunk_tokens = chunk_tokens
        self.dropped = 0  # draft KV of idle requests dropped to make room
        self.threads = StepThreads(enabled=torch.device(device).type == "cpu" and envs.tune_threads())

    # --- bookkeeping --------------------------------------------------------------------------------------
    def release(self, req: Req) -> None:
        kv = self.kv.pop(req.rid, None)
        if kv is not None:
            self.allocator.free(kv.slots)

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def info(self) -> dict[str, int | str]:
        return {
            "algorithm": "draft",
            "max_draft_tokens": self.max_draft,
            "draft_kv_total_tokens": self.pool.num_slots,
            "draft_kv_free_tokens": self.allocator.num_free,
            "draft_kv_requests": len(self.kv),
            "draft_kv_dropped": self.dropped,
        }

    def _rollback(self, kv: DraftKV, tokens: list[int]) -> None:
        """Keep the longest prefix of the draft KV whose tokens are the request's, short of its last token (whose
        logits give the first draft, so it is always computed again)."""
        n, m = kv.valid, min(len(kv.tokens), len(tokens) - 1)
        while n < m and kv.tokens[n] == tokens[n]:
            n += 1
        n = min(n, m)
        if n < len(kv.tokens):
            self.allocator.free(kv.slots[n:])
            del kv.tokens[n:], kv.slots[n:]
        kv.valid = n

    def _reserve(self, n: int, keep: set[str]) -> list[int] | None:
        """``n`` free draft slots, dropping the draft KV of the least recently drafting requests not in ``keep``
        if needed; None (nothing taken) when even that is not enough."""
        slots = self.allocator.alloc(n)
        while slots is None:
            victim = next((rid for rid in self.kv if rid not in keep), None)
            if victim is None:
                return None
            self.allocator.free(self.kv.pop(victim).slots)
            self.dropped += 1
            slots = self.allocator.alloc(n)
        return slots

    # --- drafting -----------------------------------------------------------------------------------------
    def propose_batch(self, wants: list[tuple[Req, int]]) -> list[list[int]]:
        keep = {req.rid for req, _ in wants}
        budget = self.chunk_tokens
        rows: list[_Row] = []
        out: dict[str, list[int]] = {}
        for req, limit in wants:
            tokens = req.all_ids
            k = min(self.budget(req, limit), self.max_positions - len(tokens))
            if k <= 0 or budget <= 0:
                continue
            kv = self.kv.pop(req.rid, None) or DraftKV()
            self.kv[req.rid] = kv  # now the most recently drafting
            self._rollback(kv, tokens)
            new = tokens[len(kv.tokens) :]
            if len(new) > budget:
                new, k = new[:budget], 0  # a long prompt catches up over several calls before drafting
            slots = self._reserve(len(new) + max(0, k - 1), keep)
            if slots is None:
                continue
            start = len(kv.tokens)
            kv.tokens.extend(new)
            kv.slots.extend(slots[: len(new)])
            kv.valid = len(kv.tokens)
            budget -= len(new)
            rows.append(_Row(req, kv, k, start, slots[len(new) :]))
        if rows:
            try:
                self._draft(rows)
            except Exception:  # noqa: BLE001 - a failing draft step costs the drafts, never the requests
                logger.exception("the draft model's step failed; these requests draft again from scratch")
                for row in rows:
                    self.allocator.free(row.spare)
                    self.release(row.req)
                return [[] for _ in wants]
            out = {row.req.rid: row.drafts for row in rows}
        return [out.get(req.rid, []) for req, _ in wants]

    @torch.inference_mode()
    def _draft(self, rows: list[_Row]) -> None:
        try:
            self._draft_passes(rows)
        finally:
            for r in rows:
                if r.advanced:  # the grammar only ever keeps accepted tokens: the drafts come off again
                    r.req.grammar.rollback(r.advanced)
                    r.advanced = 0
                self.allocator.free(r.spare)  # a row cut short by its grammar leaves some unused
                r.spare = []

    def _draft_passes(self, rows: list[_Row]) -> None:
        # Catch-up: one-token rows over a cached prefix are decode rows, which the layout lists first.
        step = [StepRow(r.kv.tokens[r.start :], r.start, r.kv.slots, r.start > 0 and len(r.kv.tokens) - r.start == 1)
                for r in rows]  # fmt: skip
        order = sorted(range(len(rows)), key=lambda i: not step[i].decode)
        rows[:] = [rows[i] for i in order]
        step = [step[i] for i in order]
        last, at = [], 0
        for r in rows:
            at += len(r.kv.tokens) - r.start
            last.append(at - 1)
        active = [i for i, r in enumerate(rows) if r.k > 0]
        hidden = self._forward(step)
        if active:
            self._take_argmax(rows, active, hidden[torch.tensor([last[i] for i in active], device=self.device)])
        for j in range(1, max((r.k for r in rows), default=0)):
            active = [i for i in active if rows[i].k > j]
            if not active:
                break
            step = []
            for i in active:
                r = rows[i]
                r.kv.tokens.append(r.drafts[-1])
                r.kv.slots.append(r.spare.pop())  # the spare slots move into the draft KV one by one
                step.append(StepRow([r.drafts[-1]], len(r.kv.tokens) - 1, r.kv.slots, True))
            self._take_argmax(rows, active, self._forward(step))

    def _forward(self, step: list[StepRow]) -> torch.Tensor:
        input_ids, positions, meta = lay_out(step, self.device)
        with self.threads.step(len(input_ids)):
            return self.model(input_ids, positions, ForwardContext(meta, self.pool, self.backend))

    def _take_argmax(self, rows: list[_Row], active: list[int], hidden: torch.Tensor) -> None:
        """Each active row's next draft: the draft model's argmax among the tokens its request's grammar allows
        after the drafts so far (the grammar advances through them). A row whose grammar takes no token or is
        complete drafts no further."""
        logits = self.model.compute_logits(hidden)[:, : self.vocab_size].float()
        reqs = [rows[i].req for i in active]
        allowed = grammar_mask(reqs, self.grammar_vocab, self.device)
        if allowed is not None:
            logits.masked_fill_(~allowed[:, : self.vocab_size], float("-inf"))
        for j, (i, token) in enumerate(zip(active, logits.argmax(dim=-1).tolist(), strict=True)):
            r = rows[i]
            grammar = r.req.grammar
            if grammar is not None:
                if not bool(allowed[j, token]) or grammar.error() is not None or not grammar.accept_token(token):
                    r.k = len(r.drafts)
                    continue
                r.advanced += 1
                if grammar.is_terminated():
                    r.k = len(r.drafts) + 1
            r.drafts.append(token)


@dataclass
class DraftModel:
    """The loaded draft model, before its pool is sized (with the target's, in ``Engine``)."""

    loaded: LoadedModel

    @property
    def model(self) -> Any:
        return self.loaded.model

    def kv_bytes_per_token(self) -> int:
        args = self.loaded.args
        return KVPool.bytes_per_token(args.num_layers, args.num_kv_heads, args.head_dim, self.loaded.dtype)

    def drafter(self, config: EngineConfig, num_slots: int, target_vocab: int) -> DraftModelDrafter:
        args, device, dtype = self.loaded.args, self.loaded.device, self.loaded.dtype
        pool = KVPool(num_slots, args.num_layers, args.num_kv_heads, args.head_dim, dtype, device)
        backend = attention_backend(
            config.deterministic_inference, device, dtype, args.attn_softcap, config.attention_backend
        )
        logger.info(
            "draft model %s: KV pool of %d tokens (%.1f MiB), up to %d draft tokens a step",
            config.speculative_draft_model, num_slots, pool.nbytes / 2**20, config.speculative_num_draft_tokens,
        )  # fmt: skip
        return DraftModelDrafter(
            self.loaded.model,
            pool,
            backend,
            device,
            max_draft=config.speculative_num_draft_tokens,
            vocab_size=min(target_vocab, args.vocab_size),
            grammar_vocab=target_vocab,
            max_positions=args.max_position_embeddings,
            chunk_tokens=config.chunked_prefill_size,
        )


def load_draft_model(config: EngineConfig, target: LoadedModel, lean_tokenizer: bool) -> DraftModel:
    """Load ``--speculative-draft-model`` in the target's dtype on its device; refuse another tokenizer."""
    loaded = load_model(draft_config(config, target.dtype), lean_tokenizer=lean_tokenizer)
    check_tokenizers(target.tokenizer, loaded.tokenizer, config.speculative_draft_model)
    return DraftModel(loaded)


def draft_config(config: EngineConfig, dtype: torch.dtype) -> EngineConfig:
    """The ``EngineConfig`` that loads the draft model: its own path, the target's dtype and device, one rank."""
    return replace(
        config,
        model=config.speculative_draft_model,
        revision="",
        tokenizer="",
        dtype=str(dtype).removeprefix("torch."),
        quantization=config.speculative_draft_quantization,
        speculative_algorithm="",
        speculative_draft_model="",
        tp=1,
        nnodes=1,
        node_rank=0,
        dist_init_addr="",
    )


def check_tokenizers(target: Any, draft: Any, draft_path: str) -> None:
    """Refuse a draft model whose tokenizer is not the target's: same size, same token for every id."""
    if len(target) != len(draft):
        raise ValueError(
            f"--speculative-draft-model {draft_path}: its tokenizer has {len(draft)} tokens, the target's "
            f"{len(target)}; a draft model must share the target's tokenizer"
        )
    ids = list(range(len(target)))
    if target.convert_ids_to_tokens(ids) != draft.convert_ids_to_tokens(ids):
        raise ValueError(
            f"--speculative-draft-model {draft_path}: its tokenizer maps ids to other tokens than the target's; "
            "a draft model must share the target's tokenizer"
        )
