"""The model runner: turns a ``BatchPlan`` into tensors, runs one forward pass, and samples.

It owns the model weights and the KV pool tensors; it never decides what runs (that is the scheduler's job) and
never touches the slot allocator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from radixserve.runtime import envs
from radixserve.runtime.attention.base import AttentionBackend, AttentionMetadata, ForwardContext
from radixserve.runtime.batch import BatchPlan, Failure, StepResult
from radixserve.runtime.classifier_head import classify_rows
from radixserve.runtime.grammar import draft_mask, grammar_failure, grammar_mask
from radixserve.runtime.greedy import finite_rows
from radixserve.runtime.kv_pool import KVPool
from radixserve.runtime.logprobs import token_logprobs
from radixserve.runtime.pooling import Pooling
from radixserve.runtime.request import ErrorCode, Req, TokenLogprob
from radixserve.runtime.sampler import NonFiniteLogitsError, Sampler
from radixserve.runtime.step_layout import StepRow, lay_out
from radixserve.runtime.threads import StepThreads
from radixserve.runtime.transfer import tensor_on

if TYPE_CHECKING:
    from radixserve.runtime.cuda_graph import DecodeGraphs
    from radixserve.runtime.lora import LoRABatch, LoRAs


def pool_chunk(pooling: Pooling, hidden: torch.Tensor, start: int, reaches_end: bool) -> torch.Tensor | None:
    """What one computed chunk (its rows ``hidden``, prompt positions from ``start``) adds to a request's
    embedding, in float32 on the CPU: the last row where the chunk reaches the prompt's end (``last``), the sum of
    its rows (``mean``), the first row of the prompt (``cls``); None where it adds nothing."""
    if pooling.kind == "last":
        row = hidden[-1] if reaches_end else None
    elif pooling.kind == "mean":
        row = hidden.sum(dim=0, dtype=torch.float32)  # (no float32 copy of the chunk)
    else:
        row = hidden[0] if start == 0 else None
    return None if row is None else row.float().cpu()


class CausalLM(Protocol):
    """What the runner needs of a model: ``LlamaForCausalLM``, or the leader's handle on a sharded one."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor: ...
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...
    def greedy_tokens(self, hidden: torch.Tensor, vocab: int) -> torch.Tensor: ...


@dataclass
class PendingStep:
    """A step launched on the device and not read back yet (``ModelRunner.launch``)."""

    plan: BatchPlan
    tokens: torch.Tensor  # [n] on the device: the step's tokens, in chunk order (the next step's input)
    host: torch.Tensor  # [3n]: hidden ok, logits ok, tokens, copied here without blocking
    done: Any  # the CUDA event recorded after that copy (None on CPU, where the copy has happened)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        pool: KVPool,
        backend: AttentionBackend,
        sampler: Sampler,
        device: torch.device,
        graphs: DecodeGraphs | None = None,
        loras: LoRAs | None = None,
        classifier: torch.Tensor | None = None,
    ) -> None:
        self.model = model
        self.classifier = classifier  # a classifier's head, [outputs, hidden] float32 (runtime.classifier_head)
        self.graphs = graphs  # CUDA: plain decode steps replay a captured graph
        self.loras = loras  # the served LoRA adapters (--lora-modules), None without
        self.pool = pool
        self.backend = backend
        self.sampler = sampler
        self.device = device
        # Only a CPU engine shares its cores with the rest of the machine; a GPU step's CPU work is launching.
        self.threads = StepThreads(enabled=torch.device(device).type == "cpu" and envs.tune_threads())

    def _tensor(self, data: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.long, device=self.device)

    def build_metadata(self, plan: BatchPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        rows = []
        for chunk in plan.chunks:
            e = chunk.start + chunk.num_tokens  # past any draft tokens, whose slots follow in req.slots
            slots = chunk.req.slots  # read, not kept, by lay_out: a copy only where slots past e must go
            rows.append(StepRow(chunk.tokens, chunk.start, slots if len(slots) == e else slots[:e], chunk.is_decode))
        return lay_out(rows, self.device, [c.shared_prefix for c in plan.chunks])

    def run(self, plan: BatchPlan) -> StepResult:
        """One forward pass over the plan; samples for every chunk with ``sample`` set, under the grammar of
        each constrained request. Small steps run on the thread count that ``StepThreads`` finds fastest."""
        with self.threads.step(plan.num_tokens):
            return self._run(plan)

    @torch.inference_mode()
    def _run(self, plan: BatchPlan) -> StepResult:
        lora = self._lora_batch(plan)
        widths = [c.num_tokens for c in plan.chunks]  # each chunk's rows in ``hidden``
        if lora is None and self.graphs is not None and self.graphs.fits(plan):
            hidden = self.graphs.run(plan)
        else:
            input_ids, positions, meta = self.build_metadata(plan)
            kept = self._kept_rows(plan) if lora is None else None  # (an adapter's rows are grouped in step order)
            ctx = ForwardContext(meta, self.pool, self.backend, lora, kept[0] if kept is not None else None)
            hidden = self.model(input_ids, positions, ctx)
            if kept is not None:
                widths = kept[1]

        n = len(plan.chunks)
        next_tokens: list[int | None] = [None] * n
        logprobs: list[TokenLogprob | None] = [None] * n
        prompt_lps: list[list[TokenLogprob]] = [[] for _ in range(n)]
        errors: dict[int, Failure] = {}

        last_rows: list[int] = []
        offset = 0
        for width in widths:
            offset += width
            last_rows.append(offset - 1)
        # A chunk's last row attends to all of its KV, so a NaN or inf anywhere in this step's K/V of that request
        # shows there: such a request fails here, before its KV can be cached.
        n_rows = hidden.shape[0]
        hidden_ok = finite_rows(hidden[self._rows(last_rows, n_rows)])
        pooled = self._pool(plan, hidden, widths) if any(c.req.params.pooling is not None for c in plan.chunks) else {}
        if self.classifier is not None:
            self._classify(plan, pooled, hidden, last_rows)

        # Rows to sample, as if every row were finite: the checks' results arrive with the tokens (one transfer).
        candidates = [
            i
            for i, c in enumerate(plan.chunks)
            if not c.draft and c.sample and c.req.params.max_new_tokens > len(c.req.output_ids)
        ]
        fast = (
            bool(candidates)
            and not any(c.draft or c.req.scoring_prompt for c in plan.chunks)
            and self.sampler.argmax_only([plan.chunks[i].req for i in candidates])
        )
        if fast:
            # Every sampled row is plain greedy: the step's one host sync reads tokens and checks together.
            rows = hidden[self._rows([last_rows[i] for i in candidates], n_rows)]
            picked = self.model.greedy_tokens(rows, self.sampler.vocab_size)  # logits checks, then tokens
            flags = torch.cat([hidden_ok, picked]).tolist()
            result = self._greedy_result(n, candidates, flags)
            result.pooled = self._finite_parts(pooled, result.errors)
            return result

        # The general path: the checks first (one transfer for both), then prompt log-probs, drafts and sampling.
        logits = None
        if candidates:
            logits = self.model.compute_logits(hidden[self._rows([last_rows[i] for i in candidates], n_rows)]).float()
            flags = torch.cat([hidden_ok, finite_rows(logits)]).tolist()
        else:
            flags = hidden_ok.tolist()
        keep = self._checks(n, candidates, flags, errors)  # positions in candidates of the rows to sample

        verify: list[tuple[int, int]] = []  # (chunk, its first row) of chunks with drafts
        accepted: dict[int, list[int]] = {}
        offset = 0
        for i, chunk in enumerate(plan.chunks):
            length = widths[i]  # (every row of a chunk with drafts or prompt log-probs: ``_kept_rows``)
            if i not in errors and chunk.draft:
                verify.append((i, offset))
            elif i not in errors and chunk.req.scoring_prompt:
                prompt_lps[i] = self._prompt_logprobs(chunk, hidden[offset : offset + length])
            offset += length

        if keep:
            assert logits is not None
            if len(keep) < len(candidates):
                logits = logits[self._rows(keep, len(candidates))]
            self._sample(plan, [candidates[j] for j in keep], logits, next_tokens, logprobs, errors)
        if verify:
            self._verify(plan, verify, hidden, next_tokens, accepted, errors)
        return StepResult(next_tokens, logprobs, prompt_lps, errors, accepted, self._finite_parts(pooled, errors))

    @staticmethod
    def _finite_parts(pooled: dict[int, torch.Tensor], errors: dict[int, Failure]) -> dict[int, torch.Tensor]:
        """The embedding parts of the chunks that did not fail; one with a NaN or inf (mean pooling reads rows
        the last row's check does not cover) fails its request."""
        kept = {}
        for i, part in pooled.items():
            if i in errors:
                continue
            if bool(torch.isfinite(part).all()):
                kept[i] = part
            else:
                errors[i] = Failure("the model produced non-finite hidden states for this request")
        return kept

    @staticmethod
    def _pool(plan: BatchPlan, hidden: torch.Tensor, widths: list[int]) -> dict[int, torch.Tensor]:
        """What each embedding request's chunk adds to its embedding (``runtime.pooling``), by chunk index."""
        out: dict[int, torch.Tensor] = {}
        offset = 0
        for i, chunk in enumerate(plan.chunks):
            pooling = chunk.req.params.pooling
            if pooling is not None and not pooling.classify:  # (a classifier's part: ``_classify``)
                part = pool_chunk(pooling, hidden[offset : offset + widths[i]], chunk.start, chunk.sample)
                if part is not None:
                    out[i] = part
            offset += widths[i]
        return out

    def _classify(
        self, plan: BatchPlan, pooled: dict[int, torch.Tensor], hidden: torch.Tensor, last_rows: list[int]
    ) -> None:
        """A classifier's part is its outputs at the prompt's last row (``Pooling.classify``): one product with
        the head (``runtime.classifier_head``) for every chunk of the step that reaches its prompt's end."""
        chunks = [i for i, c in enumerate(plan.chunks) if c.sample and c.req.params.pooling is not None]
        if chunks:
            rows = hidden[self._rows([last_rows[i] for i in chunks], hidden.shape[0])]
            outputs = classify_rows(rows, self.classifier).cpu()  # type: ignore[arg-type]
            pooled.update((i, outputs[k]) for k, i in enumerate(chunks))

    def _kept_rows(self, plan: BatchPlan) -> tuple[torch.Tensor, list[int]] | None:
        """The rows whose final hidden states this step reads, and how many of each chunk's that is; None where
        that is all of them (a decode step) or the model computes every row. A chunk's last row is always read
        (sampling, the finiteness check, last-token pooling); every row of a chunk whose drafts are verified,
        whose prompt is scored or whose embedding is the mean of every token; the prompt's first row too for
        first-token pooling (its chunk's rows are then that one and the last, in order)."""
        if not getattr(self.model, "trims_rows", False) or plan.num_decode == len(plan.chunks):
            return None
        rows: list[int] = []
        widths: list[int] = []
        offset = 0
        for chunk in plan.chunks:
            n = chunk.num_tokens
            pooling = chunk.req.params.pooling
            kind = pooling.kind if pooling is not None else None
            if chunk.draft or chunk.req.scoring_prompt or kind == "mean":
                kept = range(offset, offset + n)
            elif kind == "cls" and chunk.start == 0 and n > 1:
                kept = range(offset, offset + n, n - 1)  # (the first row and the last)
            else:
                kept = range(offset + n - 1, offset + n)
            rows.extend(kept)
            widths.append(len(kept))
            offset += n
        if len(rows) == offset:
            return None
        return tensor_on(rows, self.device, torch.long), widths

    def can_launch(self, reqs: list[Req]) -> bool:
        """Whether a decode step of ``reqs`` (one token each) can be launched without waiting (``launch``): it
        replays a captured graph, every row takes its argmax and none runs with an adapter or pools an embedding."""
        return (
            self.graphs is not None
            and 0 < len(reqs) <= self.graphs.max_bs
            and self.sampler.argmax_only(reqs)
            and all(r.params.lora_name is None and r.params.pooling is None for r in reqs)
        )

    def _lora_batch(self, plan: BatchPlan) -> LoRABatch | None:
        if self.loras is None or not self.loras.adapters:
            return None
        return self.loras.batch([c.req.params.lora_name for c in plan.chunks], [c.num_tokens for c in plan.chunks])

    @torch.inference_mode()
    def launch(self, plan: BatchPlan, tokens: torch.Tensor | None = None) -> PendingStep:
        """Start a plain greedy decode step (``can_launch``) and return without waiting for it; ``tokens``: its
        input ids on the device when they are the previous step's output, not read back yet."""
        assert self.graphs is not None
        hidden = self.graphs.run(plan, tokens)
        logits = self.model.compute_logits(hidden)
        out = logits[:, : self.sampler.vocab_size].argmax(dim=-1)
        packed = torch.cat([finite_rows(hidden), finite_rows(logits), out])
        if self.device.type != "cuda":
            return PendingStep(plan, out, packed, None)
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return PendingStep(plan, out, host, done)

    def finish(self, pending: PendingStep) -> StepResult:
        """Wait for a launched step (only for it: steps launched after it keep running) and read its result."""
        if pending.done is not None:
            pending.done.synchronize()
        n = len(pending.plan.chunks)
        return self._greedy_result(n, list(range(n)), pending.host.tolist())

    @staticmethod
    def _greedy_result(n: int, candidates: list[int], flags: list[int]) -> StepResult:
        """A greedy step's result from what it read back: each chunk's hidden-state check, then each sampled
        chunk's logits check, then their tokens."""
        errors: dict[int, Failure] = {}
        next_tokens: list[int | None] = [None] * n
        m = len(candidates)
        for j in ModelRunner._checks(n, candidates, flags, errors):
            next_tokens[candidates[j]] = flags[n + m + j]
        return StepResult(next_tokens, [None] * n, [[] for _ in range(n)], errors, {})

    @staticmethod
    def _checks(n: int, candidates: list[int], flags: list[int], errors: dict[int, Failure]) -> list[int]:
        """Fail the chunks whose checks failed (``flags``: each chunk's hidden-state check, then each candidate's
        logits check); returns the positions in ``candidates`` of the rows that passed both."""
        for i, ok in enumerate(flags[:n]):
            if not ok:
                errors[i] = Failure("the model produced non-finite hidden states for this request")
        keep = []
        for j, i in enumerate(candidates):
            if i in errors:
                continue
            if not flags[n + j]:
                # A numerical fault must fail its own request with a reason, never turn into a bogus token.
                errors[i] = Failure("the model produced non-finite logits for this request")
            else:
                keep.append(j)
        return keep

    def _rows(self, rows: list[int], total: int) -> slice | torch.Tensor:
        """An index of ``rows`` out of ``total``: a slice when they are all of them in order (every decode step),
        else a tensor copied without blocking on the GPU's work (a pageable copy waits for the stream)."""
        if len(rows) == total and rows[-1] == total - 1 and rows == list(range(total)):
            return slice(None)
        return tensor_on(rows, self.device, torch.long)

    def _verify(
        self,
        plan: BatchPlan,
        verify: list[tuple[int, int]],
        hidden: torch.Tensor,
        next_tokens: list[int | None],
        accepted: dict[int, list[int]],
        errors: dict[int, Failure],
    ) -> None:
        """Logits at every position of the chunks with drafts (one matmul), then each request's verification."""
        rows = [r for i, first in verify for r in range(first, first + plan.chunks[i].num_tokens)]
        logits = self.model.compute_logits(hidden[self._rows(rows, hidden.shape[0])]).float()
        at = 0
        for i, _ in verify:
            chunk = plan.chunks[i]
            n = chunk.num_tokens
            rows = logits[at : at + n]
            grammar = chunk.req.grammar
            try:
                if grammar is not None:  # each row constrained by the grammar after the drafts before it
                    allowed = draft_mask(grammar, chunk.draft, rows.shape[1], self.device)
                    if allowed is None:
                        errors[i] = grammar_failure(chunk.req)
                        at += n
                        continue
                    rows.masked_fill_(~allowed, float("-inf"))
                accepted[i], next_tokens[i] = self.sampler.verify(rows, chunk.req, chunk.draft)
            except NonFiniteLogitsError as exc:
                errors[i] = Failure(str(exc), ErrorCode.ENGINE)
            at += n

    def _sample(
        self,
        plan: BatchPlan,
        sample_idx: list[int],
        logits: torch.Tensor,
        next_tokens: list[int | None],
        logprobs: list[TokenLogprob | None],
        errors: dict[int, Failure],
    ) -> None:
        reqs = [plan.chunks[i].req for i in sample_idx]
        allowed = grammar_mask(reqs, logits.shape[1], self.device)
        broken = [j for j, req in enumerate(reqs) if req.grammar is not None and req.grammar.error() is not None]
        if broken:
            # The grammar hit a backend limit while computing this mask: the row means nothing, fail the request.
            for j in broken:
                errors[sample_idx[j]] = grammar_failure(reqs[j])
            keep = sorted(set(range(len(reqs))) - set(broken))
            sample_idx = [sample_idx[j] for j in keep]
            reqs = [reqs[j] for j in keep]
            logits = logits[self._tensor(keep)]
            allowed = allowed[self._tensor(keep)] if allowed is not None else None
            if not sample_idx:
                return
        try:
            out = self.sampler.sample(logits, reqs, allowed)
        except ValueError:
            out = None
        if out is not None:
            for j, i in enumerate(sample_idx):
                next_tokens[i] = out.token_ids[j]
                logprobs[i] = out.logprobs[j]
            return
        # One request's constraints left nothing to sample (the sampler draws nothing before raising, so seeded
        # rows stay reproducible): sample row by row so that only the faulty request fails.
        for j, i in enumerate(sample_idx):
            try:
                row_allowed = allowed[j : j + 1] if allowed is not None else None
                single = self.sampler.sample(logits[j : j + 1], [reqs[j]], row_allowed)
                next_tokens[i] = single.token_ids[0]
                logprobs[i] = single.logprobs[0]
            except NonFiniteLogitsError as exc:  # the model's numbers, whatever the request's grammar
                errors[i] = Failure(str(exc), ErrorCode.ENGINE)
            except ValueError as exc:
                errors[i] = Failure(str(exc), ErrorCode.GRAMMAR if reqs[j].grammar is not None else ErrorCode.ENGINE)

    def _prompt_logprobs(self, chunk, hidden: torch.Tensor) -> list[TokenLogprob]:
        """Log-probs of the prompt tokens predicted inside this chunk: position p predicts token p + 1."""
        req = chunk.req
        prompt_len = len(req.prompt_ids)
        lo = max(chunk.start, req.next_logprob_pos)  # positions scored before a retraction are not scored again
        hi = min(chunk.end, prompt_len - 1)
        if lo >= hi:
            return []
        rows = hidden[lo - chunk.start : hi - chunk.start]
        logits = self.model.compute_logits(rows).float()
        targets = self._tensor(req.prompt_ids[lo + 1 : hi + 1])
        return token_logprobs(logits, targets, req.params.top_logprobs_num, ranks=True)
