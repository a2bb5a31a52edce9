"""``POST /v1/embeddings``: OpenAI's embeddings API, served by a model started with ``--runner pooling``.

Each input is one engine request that computes its prompt and pools its hidden states (``runtime.pooling``); the
inputs of a call are submitted together and batched with everything else running, and a prompt head that another
request computed comes from the radix cache (last-token pooling; ``usage.prompt_tokens_details.cached_tokens``
says how much). ``encoding_format: "base64"`` (what the ``openai`` SDK asks for by default) is the float32 values,
little-endian, in base64, as OpenAI sends them.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import uuid
from collections import deque
from typing import Any

from fastapi import APIRouter, Depends, Request

from radixserve.runtime.pooling import Pooling
from radixserve.runtime.request import FinishReason
from radixserve.runtime.sampling_params import SamplingParams
from radixserve.server.deps import StateDep, require_api_key
from radixserve.server.engine_client import RequestGroup, Result
from radixserve.server.errors import APIError, bad_request, request_failed
from radixserve.server.extra_fields import check_extra_fields
from radixserve.server.params import truncate_prompt
from radixserve.server.protocol import ChatCompletionRequest, ChatMessage, EmbeddingRequest, PoolingInput
from radixserve.server.state import ServerState
from radixserve.server.tokens import item_ids, prompt_items

router = APIRouter(dependencies=[Depends(require_api_key)], tags=["OpenAI"])

MAX_INPUTS = 2048  # OpenAI's limit on inputs per call
WAVE = 256  # a call's inputs in the engine at once (twice that at most: ``_run_in_waves``)


async def pooling_inputs(body: PoolingInput, state: ServerState) -> list[list[int]]:
    """Token ids per input: a text, texts, token ids, or lists of them (OpenAI's four shapes), or each chat
    conversation (``messages``, or one as ``input``) rendered by the chat template, as vLLM's chat form."""
    engine = state.ready_engine()
    chats = _conversations(body)
    if chats is None:
        items = prompt_items(body.input, "input")
        if len(items) > MAX_INPUTS:
            raise bad_request(f"input has {len(items)} items; at most {MAX_INPUTS} per request", "input")
        special = body.add_special_tokens is not False
        return [item_ids(x, k, engine.tokenizer, engine.vocab_size, special, "input") for k, x in enumerate(items)]
    if len(chats) > MAX_INPUTS:
        raise bad_request(f"messages has {len(chats)} conversations; at most {MAX_INPUTS} per request", "messages")

    def render() -> list[list[int]]:  # (templates over thousands of conversations: off the event loop)
        prompts = []
        for k, conversation in enumerate(chats):
            chat = ChatCompletionRequest(messages=conversation, add_generation_prompt=body.add_generation_prompt,
                                         continue_final_message=body.continue_final_message,
                                         chat_template_kwargs=body.chat_template_kwargs)  # fmt: skip
            text, _ = state.render_chat(chat)
            prompts.append(item_ids(text, k, engine.tokenizer, engine.vocab_size, bool(body.add_special_tokens),
                                    "messages"))  # fmt: skip
        return prompts

    return await asyncio.to_thread(render)


def _conversations(body: PoolingInput) -> list[list[ChatMessage]] | None:
    """The request's chat conversations, or None where it sends plain ``input``."""
    if body.messages is not None:
        if body.input is not None:
            raise bad_request("send input or messages, not both", "messages")
        convs = [body.messages] if body.messages and isinstance(body.messages[0], ChatMessage) else body.messages
    elif isinstance(body.input, list) and body.input and isinstance(body.input[0], ChatMessage):
        convs = [body.input]
    elif body.input is None:
        raise bad_request("input (or messages) is required", "input")
    else:
        return None
    if not convs or not all(convs):
        raise bad_request("messages must hold at least one message (in each conversation)", "messages")
    return convs  # type: ignore[return-value]


@router.post("/v1/embeddings", summary="Create embeddings (OpenAI-compatible; --runner pooling)")
async def embeddings(body: EmbeddingRequest, request: Request, state: StateDep):
    check_extra_fields(body, "/v1/embeddings")
    engine = state.ready_engine()
    lora = state.check_model(body.model)
    pooling = _pooling(engine, body.dimensions, body.normalize)
    prompts = fit_prompts(await pooling_inputs(body, state), body.truncate_prompt_tokens, engine, "input")
    results = await embed(state, request, prompts, pooling, lora, body.priority, body.cache_salt)
    data = [_item(k, res, body.encoding_format) for k, res in enumerate(results)]
    prompt_tokens = sum(r.prompt_tokens for r in results)
    return {
        "object": "list",
        "data": data,
        "model": lora or state.served_name,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in results)},
        },
    }


async def embed_texts(
    state: ServerState,
    request: Request,
    model: str | None,
    texts: list[str],
    truncate: int | None,
    priority: int | None,
    param: str,
) -> tuple[list[list[float]], list[Result], str]:
    """The model's own embeddings of ``texts`` (its normalization, every dimension), with their results and the
    name served (an adapter's, or the model's): what scores are made of (``server.score_routes``). ``param``
    names the field a bad text is reported under."""
    engine = state.ready_engine()
    lora = state.check_model(model)
    pooling = _pooling(engine, None, None)
    prompts = [item_ids(text, k, engine.tokenizer, engine.vocab_size, True, param) for k, text in enumerate(texts)]
    results = await embed(state, request, fit_prompts(prompts, truncate, engine, param), pooling, lora, priority, None)
    return [vector_of(res) for res in results], results, lora or state.served_name


def served_pooling(engine: Any, classifier: bool) -> Any:
    """The served ``PoolingModel`` of the kind a route needs (a classifier's, or an embedding model's); else a 400
    naming what this server serves."""
    pooling = engine.pooling
    if pooling is not None and (pooling.labels is not None) == classifier:
        return pooling
    if pooling is None:
        served = "generates text"
    else:
        served = "serves embeddings" if pooling.labels is None else "serves a classifier (score, rerank, classify)"
    need = "a classifier (a *ForSequenceClassification model, or classifier_from_token in --hf-overrides)"
    raise APIError(
        400,
        f"this server {served}; this route needs {need if classifier else 'an embedding model'} served with "
        "--runner pooling",
        param="model",
        code="model_not_supported",
    )


def _pooling(engine: Any, dimensions: int | None, normalize: bool | None) -> Pooling:
    """A request's pooling on this server: a 400 where it serves no embeddings, or cannot give that length."""
    try:
        return served_pooling(engine, classifier=False).request(dimensions, normalize)
    except ValueError as exc:
        raise bad_request(str(exc), "dimensions") from None


def fit_prompts(prompts: list[list[int]], keep: int | None, engine: Any, param: str) -> list[list[int]]:
    """vLLM's ``truncate_prompt_tokens`` (-1: the whole context: an embedding generates nothing), then a 400 for a
    prompt longer than the context."""
    if keep is not None:
        keep = engine.max_context_len if keep == -1 else keep
        prompts = [truncate_prompt(ids, keep, 0, engine.max_context_len) for ids in prompts]
    for k, ids in enumerate(prompts):
        if len(ids) > engine.max_context_len:
            raise bad_request(
                f"input {k} has {len(ids)} tokens, more than the context length {engine.max_context_len}; shorten it "
                "or send truncate_prompt_tokens",
                param,
            )
    return prompts


async def embed(
    state: ServerState,
    request: Request,
    prompts: list[list[int]],
    pooling: Pooling,
    lora: str | None,
    priority: int | None,
    cache_salt: str | None,
) -> list[Result]:
    """Each prompt's embedding request, run (``_run_in_waves``)."""
    name = f"embd-{uuid.uuid4().hex}"
    params: dict[str, Any] = dict(max_new_tokens=0, pooling=pooling, lora_name=lora, priority=priority or 0)
    if cache_salt is not None:
        params["cache_salt"] = cache_salt
    requests = [(ids, SamplingParams(**params), f"{name}-{k}") for k, ids in enumerate(prompts)]
    return await _run_in_waves(requests, request, state, name)


async def _run_in_waves(
    requests: list[tuple[list[int], SamplingParams, str]], request: Request, state: ServerState, name: str
) -> list[Result]:
    """Every request's result, submitted ``WAVE`` at a time with at most two waves in the engine: a call of
    thousands of inputs neither fills the waiting queue (each input is a request) nor leaves the engine idle
    between waves. A refusal or failure aborts the waves still running."""
    engine = state.ready_engine()
    running: deque[asyncio.Future[list[Result]]] = deque()
    results: list[Result] = []
    try:
        for lo in range(0, len(requests), WAVE):
            group = RequestGroup(engine, state.metrics, state.inflight, name=name)
            group.submit(requests[lo : lo + WAVE])
            running.append(asyncio.ensure_future(group.collect(request)))
            if len(running) == 2:
                results += await running.popleft()
        while running:
            results += await running.popleft()
    finally:
        for task in running:  # (a collect that is cancelled aborts its group's requests)
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
    return results


def vector_of(res: Result) -> list[float]:
    if res.finish_reason == FinishReason.ERROR:
        raise request_failed(res.error, res.error_code)
    if res.embedding is None:  # aborted (a shutdown, /abort_request) before its prompt was computed
        raise APIError(503, "the request was aborted before its embedding was computed; send it again")
    return res.embedding


def _item(index: int, res: Result, encoding_format: str) -> dict[str, Any]:
    values: Any = vector_of(res)
    if encoding_format == "base64":
        values = base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
    return {"object": "embedding", "index": index, "embedding": values}
