"""What the in-process ``Engine`` and the ``EngineProcess`` share: the blocking ``generate`` and the async
``stream`` built on ``submit``/``abort``, and the messages of requests that end without running."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from radixserve.runtime.request import Req, ReqOutput
from radixserve.runtime.sampling_params import SamplingParams

Sink = Callable[[ReqOutput], None]
EMBED_WAVE = 256  # ``embed`` submits this many inputs at a time


class EngineAPI(ABC):
    """The serving API: what the HTTP server, the DSL and tests call. Implementations are thread-safe."""

    tokenizer: Any
    model_name: str
    vocab_size: int
    max_context_len: int

    @abstractmethod
    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, sink: Sink, rid: str | None = None) -> str:
        """Queue one request; ``sink`` receives its ``ReqOutput`` messages (on an engine-side thread: keep it
        cheap). Raises ``ValueError`` for a request that can never be served, ``EngineOverloadedError`` when the
        waiting queue is full and ``EngineDeadError`` when the engine has stopped."""

    @abstractmethod
    def abort(self, rid: str) -> None: ...

    @property
    @abstractmethod
    def lora_names(self) -> tuple[str, ...]:
        """The LoRA adapters served now (``--lora-modules``, and those loaded since)."""

    @abstractmethod
    def load_lora(self, name: str, path: str) -> tuple[str, ...]:
        """Serve the PEFT adapter in ``path`` as ``name``: ``ValueError`` (a message for the client) if the name is
        empty or taken, or the folder is not an adapter of this model. Returns the names served now."""

    @abstractmethod
    def unload_lora(self, name: str) -> tuple[str, ...]:
        """Stop serving ``name``: ``LookupError`` if there is no such adapter, ``ValueError`` while requests use
        it. Returns the names served now."""

    def submit_all(self, requests: Sequence[tuple[Sequence[int], SamplingParams, Sink]]) -> list[str]:
        """Queue every ``(prompt_ids, params, sink)`` or none: at the first refusal, those already queued are
        aborted and the refusal is raised (a caller never holds the rids of half a batch)."""
        rids: list[str] = []
        try:
            for prompt_ids, params, sink in requests:
                rids.append(self.submit(prompt_ids, params, sink))
        except BaseException:
            for rid in rids:
                self.abort(rid)
            raise
        return rids

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: SamplingParams | dict[str, Any] | list[Any] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Blocking generation for one prompt or a batch (text or token ids). Returns ``{"text", "output_ids",
        "meta_info"}`` per prompt."""
        single = isinstance(prompt, str) or (input_ids is not None and input_ids and isinstance(input_ids[0], int))
        if prompt is not None:
            prompts = [prompt] if isinstance(prompt, str) else list(prompt)
            ids_list = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        elif input_ids is not None:
            ids_list = [input_ids] if single else list(input_ids)  # type: ignore[list-item]
        else:
            raise ValueError("give prompt or input_ids")
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(ids_list):
                raise ValueError(f"{len(sampling_params)} sampling params for {len(ids_list)} prompts")
            param_list = [as_params(p) for p in sampling_params]
        else:
            param_list = [as_params(sampling_params) for _ in ids_list]
        done: list[Future[dict[str, Any]]] = [Future() for _ in ids_list]
        self.submit_all([(ids, p, Collector(f)) for ids, p, f in zip(ids_list, param_list, done)])  # type: ignore[misc]
        results = [f.result() for f in done]
        return results[0] if single else results

    def embed(
        self,
        inputs: Sequence[str] | Sequence[Sequence[int]],
        dimensions: int | None = None,
        normalize: bool | None = None,
    ) -> list[ReqOutput]:
        """Blocking embeddings (``--runner pooling``) of texts (tokenized with the model's special tokens, as
        sentence-transformers does) or token ids; each final ``ReqOutput`` has its ``embedding`` (a classifier's:
        its outputs, before the activation), or ``error``.
        The inputs go in ``EMBED_WAVE`` at a time; ``ValueError`` as ``submit`` raises it (for a wave's inputs
        before any of them runs; earlier waves have run)."""
        pooling = getattr(self, "pooling", None)
        if pooling is None:
            raise ValueError("this engine generates text: embeddings need --runner pooling")
        params = pooling.request(dimensions, normalize)
        ids = [self.tokenizer.encode(x) if isinstance(x, str) else list(x) for x in inputs]

        def sink(fut: Future[ReqOutput]) -> Sink:
            return lambda out: fut.set_result(out) if out.finished else None

        results: list[ReqOutput] = []
        for lo in range(0, len(ids), EMBED_WAVE):  # each input is a request: the waiting queue is bounded
            wave = ids[lo : lo + EMBED_WAVE]
            done: list[Future[ReqOutput]] = [Future() for _ in wave]
            one = SamplingParams(max_new_tokens=0, pooling=params)
            self.submit_all([(p, replace(one), sink(f)) for p, f in zip(wave, done)])
            results += [f.result() for f in done]
        return results

    async def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams, rid: str | None = None
    ) -> AsyncIterator[ReqOutput]:
        """Yield the request's incremental outputs; closing the iterator early aborts the request."""
        loop = asyncio.get_running_loop()
        outq: asyncio.Queue[ReqOutput] = asyncio.Queue()
        rid = self.submit(prompt_ids, params, lambda out: loop.call_soon_threadsafe(outq.put_nowait, out), rid)
        finished = False
        try:
            while True:
                out = await outq.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)


def as_params(p: SamplingParams | dict[str, Any] | None) -> SamplingParams:
    """A fresh ``SamplingParams`` per request: requests never share mutable parameter objects."""
    if isinstance(p, SamplingParams):
        return replace(p)
    return SamplingParams(**(p or {}))


def final_output(req: Req) -> ReqOutput:
    """The one message of a request that ends without having run (refused, failed on entry, shut down)."""
    return ReqOutput(
        rid=req.rid,
        text="",
        token_ids=[],
        logprobs=[],
        finished=True,
        finish_reason=req.finish_reason,
        error=req.error,
        error_code=req.error_code,
        prompt_tokens=len(req.prompt_ids),
        completion_tokens=len(req.output_ids),
    )


class Collector:
    """Accumulates a request's outputs into the dict that ``Engine.generate`` returns."""

    def __init__(self, fut: Future[dict[str, Any]]) -> None:
        self.fut = fut
        self.text: list[str] = []
        self.ids: list[int] = []
        self.logprobs: list[Any] = []

    def __call__(self, out: ReqOutput) -> None:
        self.text.append(out.text)
        self.ids.extend(out.token_ids)
        self.logprobs.extend(out.logprobs)
        if out.finished:
            self.fut.set_result(
                {
                    "text": "".join(self.text),
                    "output_ids": self.ids,
                    "meta_info": {
                        "id": out.rid,
                        "prompt_tokens": out.prompt_tokens,
                        "completion_tokens": out.completion_tokens,
                        "cached_tokens": out.cached_tokens,
                        "finish_reason": out.finish_reason.value if out.finish_reason else None,
                        "matched_stop": out.matched_stop,
                        "error": out.error,
                        "error_code": out.error_code,
                        "output_token_logprobs": self.logprobs,
                        "input_token_logprobs": out.prompt_logprobs,
                    },
                }
            )
