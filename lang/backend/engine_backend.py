"""``EngineBackend``: programs run against an in-process ``Engine``, without HTTP.

Parameters go through the server's own ``native_params`` and prompts through the same tokenizer call as
``/generate``, so a program sees the same validation, the same token ids and the same refusals (with the status
the server would answer) whichever backend it runs on.
"""

from __future__ import annotations

import itertools
import queue
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from radixserve.constrained import GrammarError
from radixserve.lang.backend.base import Backend, GenOutput, overload_backoff_s
from radixserve.lang.errors import BackendError
from radixserve.runtime.errors import EngineOverloadedError
from radixserve.runtime.request import FinishReason, ReqOutput
from radixserve.runtime.sampling_params import SamplingParams
from radixserve.server.constraints import native_constraint
from radixserve.server.engine_client import Result
from radixserve.server.errors import APIError, from_engine_error
from radixserve.server.logprobs import native_logprobs, prompt_entries
from radixserve.server.params import native_params
from radixserve.server.tokens import TokenNames, encode

if TYPE_CHECKING:
    from radixserve.runtime.engine import Engine

OVERLOAD_PATIENCE_S = 600.0  # how long a request refused for a full queue is sent again (RuntimeEndpoint: timeout)


class EngineBackend(Backend):
    """``EngineBackend(engine)``; the caller keeps owning (and shuts down) the engine."""

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.engine = engine
        self._names = TokenNames(engine.tokenizer)

    def __repr__(self) -> str:
        return f"EngineBackend({self.engine.model_name!r})"

    # --- helpers --------------------------------------------------------------------------------------------
    def _params(self, raw: dict[str, Any], return_logprob: bool, top: int, start: int = -1) -> SamplingParams:
        try:
            return native_params(
                raw,
                return_logprob=return_logprob,
                top_logprobs_num=top,
                logprob_start_len=start if return_logprob else -1,
                vocab_size=self.engine.vocab_size,
            )
        except APIError as exc:
            raise _backend_error(exc) from None

    def _compile(self, raw: dict[str, Any]) -> None:
        """Compile the request's grammar constraint before submitting, as the server does, so that a bad regex or
        schema is the server's 400 naming the field rather than a failed request."""
        try:
            constraint = native_constraint(raw)
        except APIError as exc:
            raise _backend_error(exc) from None
        if constraint is None:
            return
        try:
            self.engine.compile(constraint.spec).result()
        except GrammarError as exc:
            raise _backend_error(constraint.error(exc)) from None
        except ValueError as exc:  # the model's vocabulary cannot carry a grammar
            message = f"{constraint.param}: constrained decoding is not available for this model: {exc}"
            raise BackendError(message, 400, constraint.param, "unsupported_constraint") from None

    def _encode(self, text: str) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # over HTTP the server refuses the body the same way
            raise BackendError(f"the text is not valid Unicode (a lone surrogate at {exc.start})", 400) from None
        return encode(self.engine.tokenizer, text, add_special_tokens=False)

    def _submit(self, ids: Sequence[int], params: SamplingParams) -> tuple[str, queue.SimpleQueue[ReqOutput]]:
        return self._submit_all([ids], params)[0]

    def _submit_all(
        self, batch: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[tuple[str, queue.SimpleQueue[ReqOutput]]]:
        """Submit every sequence or none. While the engine's queue is full the batch is sent again after a
        growing, jittered wait (within ``OVERLOAD_PATIENCE_S``), as ``RuntimeEndpoint`` retries a 429."""
        patience = time.monotonic() + OVERLOAD_PATIENCE_S
        for attempt in itertools.count():
            queues: list[queue.SimpleQueue[ReqOutput]] = [queue.SimpleQueue() for _ in batch]
            try:
                rids = self.engine.submit_all([(ids, params, q.put) for ids, q in zip(batch, queues)])
                return list(zip(rids, queues))
            except Exception as exc:  # noqa: BLE001 - mapped to the status the HTTP server would answer
                if not isinstance(exc, EngineOverloadedError) or time.monotonic() >= patience:
                    raise _backend_error(from_engine_error(exc, native=True)) from None
            time.sleep(overload_backoff_s(attempt))
        raise AssertionError("unreachable")

    def queue_bound(self) -> int | None:
        return int(self.engine.config.max_queued_requests)

    def _wait(self, rid: str, outputs: queue.SimpleQueue[ReqOutput], on_text: Callable[[str], None] | None) -> Result:
        """Accumulate the request's outputs; an exception here (e.g. from ``on_text``) aborts the request."""
        result = Result()
        try:
            while result.finish_reason is None:
                out = outputs.get()
                result.add(out)
                if on_text is not None and out.text:
                    on_text(out.text)
        except BaseException:
            self.engine.abort(rid)
            raise
        if result.finish_reason == FinishReason.ERROR:
            raise BackendError(f"the request failed inside the engine: {result.error}", 500, code="engine_error")
        if result.finish_reason == FinishReason.ABORT:
            raise BackendError(f"the request was aborted: {result.error or 'the engine stopped'}", 503)
        return result

    def _meta(self, rid: str, prompt_len: int, res: Result, return_logprob: bool) -> dict[str, Any]:
        finish: dict[str, Any] = (
            {"type": "length", "length": res.completion_tokens}
            if res.finish_reason == FinishReason.LENGTH
            else {"type": "stop", "matched": res.matched_stop}
        )
        meta: dict[str, Any] = {
            "id": rid,
            "prompt_tokens": prompt_len,
            "completion_tokens": len(res.token_ids),
            "cached_tokens": res.cached_tokens,
            "finish_reason": finish,
        }
        if return_logprob:
            meta["output_token_logprobs"], meta["output_top_logprobs"] = native_logprobs(
                res.token_ids, res.logprobs, self._names
            )
        return meta

    # --- Backend --------------------------------------------------------------------------------------------
    def generate(
        self,
        prompt: str,
        sampling: dict[str, Any],
        *,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        on_text: Callable[[str], None] | None = None,
    ) -> GenOutput:
        params = self._params(sampling, return_logprob, top_logprobs_num)
        self._compile(sampling)
        ids = self._encode(prompt)
        rid, outputs = self._submit(ids, params)
        res = self._wait(rid, outputs, on_text)
        return GenOutput(res.text, list(res.token_ids), self._meta(rid, len(ids), res, return_logprob))

    def prefill(self, prompt: str) -> dict[str, Any]:
        ids = self._encode(prompt)
        rid, outputs = self._submit(ids, self._params({"max_new_tokens": 0}, False, 0))
        return self._meta(rid, len(ids), self._wait(rid, outputs, None), False)

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return [self._encode(t) for t in texts]

    def prompt_logprobs(
        self, input_ids: list[list[int]], start: int, routing_text: str | None = None
    ) -> list[list[float]]:
        if start < 1:
            raise ValueError("prompt_logprobs: start must be >= 1 (nothing predicts the first token)")
        params = self._params({"max_new_tokens": 0}, True, 0, start)
        submitted = self._submit_all(input_ids, params)  # all at once: one batch, shared head once
        out = []
        for ids, (rid, outputs) in zip(input_ids, submitted):
            entries = prompt_entries(ids, self._wait(rid, outputs, None).prompt_logprobs)[start:]
            out.append([e.logprob for e in entries if e is not None])
        return out

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        try:
            return str(
                self.engine.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=add_generation_prompt, tokenize=False
                )
            )
        except Exception as exc:  # noqa: BLE001 - Jinja errors, as the server reports them
            raise BackendError(f"the chat template could not render these messages: {exc}", 400, "messages") from None

    def server_info(self) -> dict[str, Any]:
        return dict(self.engine.server_info())

    def flush_cache(self) -> None:
        if not self.engine.flush_cache():
            message = "the prefix cache cannot be flushed while requests are running"
            raise BackendError(message, 400, code="cache_in_use")


def _backend_error(exc: APIError) -> BackendError:
    return BackendError(exc.message, exc.status, exc.param, exc.code)
