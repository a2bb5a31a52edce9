"""SGLang-style native routes: /generate, /tokenize, /detokenize, /server_info, /flush_cache, /abort_request,
/health, /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from radixserve.runtime.request import FinishReason
from radixserve.runtime.sampling_params import SamplingParams
from radixserve.server.constraints import compile_constraints, native_constraint
from radixserve.server.deps import StateDep, require_api_key, require_metrics_key
from radixserve.server.engine_client import RequestGroup, Result
from radixserve.server.errors import APIError, bad_request, from_engine_error, invalid_request, request_failed
from radixserve.server.extra_fields import check_extra_fields
from radixserve.server.logprobs import native_logprobs, prompt_entries
from radixserve.server.metrics import CONTENT_TYPE
from radixserve.server.params import native_params
from radixserve.server.protocol import AbortRequest, ChatCompletionRequest, ChatMessage, GenerateRequest, Tool
from radixserve.server.state import ServerState
from radixserve.server.streaming import DONE, SSEResponse, sse
from radixserve.server.tokens import encode

router = APIRouter(dependencies=[Depends(require_api_key)], tags=["Native"])
health_router = APIRouter(tags=["Native"])


def _prompts(body: GenerateRequest, tokenizer: Any) -> tuple[bool, list[list[int]]]:
    """``(single, token ids per prompt)``. Text is tokenized without special tokens, as ``Engine.generate``
    does, so the HTTP and in-process APIs see the same ids for the same text."""
    if (body.text is None) == (body.input_ids is None):
        raise bad_request("give exactly one of text or input_ids", "text")
    if body.text is not None:
        single = isinstance(body.text, str)
        texts = [body.text] if isinstance(body.text, str) else list(body.text)
        ids = [encode(tokenizer, t, add_special_tokens=False) for t in texts]
    else:
        raw = body.input_ids or []
        single = bool(raw) and isinstance(raw[0], int)
        ids = [list(raw)] if single else [list(x) for x in raw]  # type: ignore[arg-type]
    if not ids:
        raise bad_request("the batch is empty", "text" if body.text is not None else "input_ids")
    return single, ids


def _rids(body: GenerateRequest, n: int, single: bool) -> list[str | None]:
    if body.rid is None:
        return [None] * n
    if isinstance(body.rid, str):
        return [body.rid] if single else [f"{body.rid}-{i}" for i in range(n)]
    if len(body.rid) != n:
        raise bad_request(f"{len(body.rid)} rids for {n} prompts", "rid")
    return list(body.rid)


def _finish(res: Result) -> dict[str, Any] | None:
    if res.finish_reason is None:
        return None
    if res.finish_reason == FinishReason.ERROR:
        raise request_failed(res.error, res.error_code)
    if res.finish_reason == FinishReason.LENGTH:
        return {"type": "length", "length": res.completion_tokens}
    if res.finish_reason == FinishReason.STOP:
        return {"type": "stop", "matched": res.matched_stop}
    return {"type": res.finish_reason.value, "message": res.error}


def _result(
    rid: str,
    res: Result,
    prompt_ids: list[int],
    params: SamplingParams,
    body: GenerateRequest,
    state: ServerState,
    start: float,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": rid,
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(res.token_ids),
        "cached_tokens": res.cached_tokens,
        "finish_reason": _finish(res),
        "e2e_latency": time.monotonic() - start,
    }
    if params.return_logprob:
        names = state.token_names if body.return_text_in_logprobs else None
        meta["output_token_logprobs"], meta["output_top_logprobs"] = native_logprobs(res.token_ids, res.logprobs, names)
        if params.logprob_start_len >= 0:
            start_pos = min(params.logprob_start_len, len(prompt_ids))
            entries = prompt_entries(prompt_ids, res.prompt_logprobs)[start_pos:]
            meta["input_token_logprobs"], meta["input_top_logprobs"] = native_logprobs(
                prompt_ids[start_pos:], entries, names
            )
    return {"text": res.text, "output_ids": list(res.token_ids), "meta_info": meta}


def _loras(body: GenerateRequest, n: int) -> list[str | None]:
    """Each prompt's adapter (SGLang's ``lora_path``: one name for all, or one per prompt)."""
    if not isinstance(body.lora_path, list):
        return [body.lora_path] * n
    if len(body.lora_path) != n:
        raise bad_request(f"{len(body.lora_path)} lora_path entries for {n} prompts", "lora_path")
    return list(body.lora_path)


@router.post("/generate", summary="Generate from text or token ids (SGLang-compatible)")
async def generate(body: GenerateRequest, request: Request, state: StateDep):
    check_extra_fields(body, "/generate")
    engine = state.ready_engine()
    single, prompts = _prompts(body, engine.tokenizer)
    raw_params = body.sampling_params
    if isinstance(raw_params, list) and len(raw_params) != len(prompts):
        raise bad_request(f"{len(raw_params)} sampling_params for {len(prompts)} prompts", "sampling_params")
    params = [
        native_params(
            raw_params[i] if isinstance(raw_params, list) else raw_params,
            return_logprob=body.return_logprob,
            top_logprobs_num=body.top_logprobs_num,
            logprob_start_len=body.logprob_start_len if body.return_logprob else -1,
            vocab_size=engine.vocab_size,
            defaults=state.sampling_defaults,
            priority=body.priority,
        )
        for i in range(len(prompts))
    ]
    for i, lora in enumerate(_loras(body, len(prompts))):
        params[i] = replace(params[i], lora_name=lora)
    rids = _rids(body, len(prompts), single)
    raws = raw_params if isinstance(raw_params, list) else [raw_params] * len(prompts)
    constraints = [native_constraint(raw or {}) for raw, p in zip(raws, params) if p.constraint is not None]
    await compile_constraints(engine, state.metrics, constraints)  # a bad grammar is a 400 before any submit
    name = body.rid if isinstance(body.rid, str) and not single else None  # a batch's rids are f"{name}-{i}"
    group = RequestGroup(engine, state.metrics, state.inflight, native=True, name=name)
    group.submit(list(zip(prompts, params, rids)))
    start = time.monotonic()
    if body.stream:
        return SSEResponse(_stream(group, body, state, prompts, params, single, start))
    results = await group.collect(request)
    out = [_result(group.rids[i], r, prompts[i], params[i], body, state, start) for i, r in enumerate(results)]
    return out[0] if single else out


async def _stream(
    group: RequestGroup,
    body: GenerateRequest,
    state: ServerState,
    prompts: list[list[int]],
    params: list[SamplingParams],
    single: bool,
    start: float,
) -> AsyncIterator[str]:
    """Each event carries the request's cumulative text and ids so far (SGLang's format); [DONE] ends it."""
    results = [Result() for _ in prompts]
    try:
        async for i, out in group:
            results[i].add(out)
            payload = _result(group.rids[i], results[i], prompts[i], params[i], body, state, start)
            if not single:
                payload["index"] = i
            yield sse(payload)
        yield DONE
    finally:
        group.close()


class TokenizeRequest(BaseModel):
    """Text (one string or a batch) or chat messages; give exactly one. With messages, the chat fields that change
    the rendering (tools, tool_choice, chat_template_kwargs, continue_final_message) are read as chat reads them."""

    prompt: str | list[str] | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    tools: list[Tool] | None = None
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False


@router.post("/tokenize", summary="Token ids of text, or of chat messages rendered through the chat template")
async def tokenize(body: TokenizeRequest, state: StateDep) -> dict[str, Any]:
    """Text is tokenized as /generate tokenizes it (no special tokens added by default), so the ids returned are
    the ids /generate would see. With ``messages`` the rendered prompt text comes back too (``prompt``): a client
    (the lang/ DSL) reads the served model's role markers from it."""
    engine = state.ready_engine()
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt or messages", "prompt")
    tokenizer, special = engine.tokenizer, body.add_special_tokens
    out: dict[str, Any] = {"max_model_len": engine.max_context_len}
    if body.messages is not None:  # rendered as a chat request renders them (earlier tool calls included)
        fields = body.model_dump(exclude={"prompt", "add_special_tokens"}, exclude_none=True)
        try:
            chat = ChatCompletionRequest.model_validate(fields)
        except ValueError as exc:
            raise invalid_request(exc) from None
        text, _ = state.render_chat(chat)
        out["prompt"], out["tokens"] = text, encode(tokenizer, text, add_special_tokens=special)
        out["count"] = len(out["tokens"])
    elif isinstance(body.prompt, str):
        out["tokens"] = encode(tokenizer, body.prompt, add_special_tokens=special)
        out["count"] = len(out["tokens"])
    else:
        out["tokens"] = [encode(tokenizer, t, add_special_tokens=special) for t in body.prompt or []]
        out["count"] = [len(t) for t in out["tokens"]]
    return out


class DetokenizeRequest(BaseModel):
    tokens: list[int]


@router.post("/detokenize", summary="The text of token ids (vLLM-compatible)")
async def detokenize(body: DetokenizeRequest, state: StateDep) -> dict[str, Any]:
    """Special tokens are kept, as ``/tokenize`` of the result would need them to give the ids back."""
    engine = state.ready_engine()
    bad = next((t for t in body.tokens if not 0 <= t < engine.vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is out of range [0, {engine.vocab_size})", "tokens")
    return {"prompt": engine.tokenizer.decode(body.tokens, skip_special_tokens=False)}


async def _engine_call(state: ServerState, fn_name: str) -> Any:
    engine = state.ready_engine()
    try:
        return await asyncio.to_thread(getattr(engine, fn_name))
    except TimeoutError:
        raise APIError(503, "the engine did not answer within 30 s; it may be overloaded", code="timeout") from None
    except RuntimeError as exc:  # EngineDeadError
        raise from_engine_error(exc) from None


@router.get("/server_info", summary="Engine state (queues, KV cache, cache statistics) and configuration")
async def server_info(state: StateDep) -> dict[str, Any]:
    info = await _engine_call(state, "server_info")
    return {**info, **state.describe(), "num_inflight_requests": len(state.inflight)}


@router.post("/flush_cache", summary="Drop every cached prefix (refused while requests run)")
async def flush_cache(state: StateDep) -> dict[str, Any]:
    if not await _engine_call(state, "flush_cache"):
        raise APIError(
            400,
            "the prefix cache cannot be flushed while requests are running; retry when the server is idle",
            code="cache_in_use",
        )
    return {"success": True, "message": "the prefix cache was flushed"}


@router.post("/abort_request", summary="Abort running requests by rid (a call's id: all its choices)")
async def abort_request(body: AbortRequest, state: StateDep) -> dict[str, Any]:
    engine = state.ready_engine()
    if body.abort_all:
        rids = list(state.inflight)
    elif body.rid:
        rids = [r for r, group in list(state.inflight.items()) if body.rid in (r, group.name)]
        if not rids:
            raise APIError(404, f"no running request has rid {body.rid!r} (it may have finished)", param="rid")
    else:
        raise bad_request("give a rid, or abort_all: true", "rid")
    for rid in rids:
        engine.abort(rid)
    return {"success": True, "aborted": rids}


@health_router.get(
    "/metrics",
    summary="Prometheus metrics (open unless --protect-metrics)",
    response_class=Response,
    dependencies=[Depends(require_metrics_key)],
)
async def metrics(state: StateDep) -> Response:
    if state.status()[0] == "ready":
        with contextlib.suppress(APIError):  # the engine just stopped: still serve the counters
            state.metrics.refresh(await _engine_call(state, "server_info"))
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


# HEAD too, as every GET route (server.http_compat.HeadAsGet). /ping (GET and POST) is the health check
# SageMaker's containers answer, as vLLM's does.
@health_router.get("/health", summary="200 once the model is loaded and the engine runs, 503 otherwise")
@health_router.get("/ping", include_in_schema=False)
@health_router.post("/ping", include_in_schema=False)
async def health(state: StateDep) -> JSONResponse:
    status, why = state.status()
    body: dict[str, Any] = {"status": status}
    if why:
        body["message"] = why
    return JSONResponse(body, status_code=200 if status == "ready" else 503)


@health_router.get("/version", summary="The server's version (vLLM's route)")
async def version() -> dict[str, str]:
    return {"version": _installed_version()}


@functools.cache
def _installed_version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("radixserve")
    except PackageNotFoundError:  # (run from a source tree that was never installed)
        return "unknown"
