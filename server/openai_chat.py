"""``POST /v1/chat/completions``: OpenAI chat completions, streamed or not, with n choices and tool calls.

Tool calls: with ``tool_choice`` "auto" (or absent) they are parsed from the answer's text
(``server.tool_parser``); with "required" or a named function the output is constrained to the call's JSON
(``server.tool_calls``), so the message is always ``tool_calls`` (content null, finish_reason "tool_calls",
or "length" when max_tokens cut it). "auto" with a ``response_format`` constrains the output to either tool-call
blocks or the formatted answer, and parses it as "auto" does. ``response_format`` and the constraint fields are
enforced by a grammar (``server.constraints``), compiled before the request is submitted.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, Request

from radixserve.runtime.request import FinishReason, ReqOutput
from radixserve.server.constraints import (
    RequestConstraint,
    at_most_one,
    body_constraints,
    compile_constraints,
    response_format_constraint,
)
from radixserve.server.deps import StateDep, require_api_key
from radixserve.server.engine_client import RequestGroup, Result
from radixserve.server.errors import bad_request, request_failed
from radixserve.server.extra_fields import check_extra_fields
from radixserve.server.logprobs import chat_logprobs
from radixserve.server.params import budget, openai_params
from radixserve.server.protocol import ChatCompletionRequest
from radixserve.server.state import ServerState
from radixserve.server.streaming import DONE, SSEResponse, stream_chunk
from radixserve.server.tokens import encode
from radixserve.server.tool_calls import ToolCallScanner, forced_tool_constraint, tool_or_answer_constraint
from radixserve.server.tool_parser import ToolCallStream, parse_tool_calls

router = APIRouter(dependencies=[Depends(require_api_key)], tags=["OpenAI"])


def finish_reason(reason: FinishReason | None, error: str | None, code: str | None = None) -> str:
    """OpenAI's finish_reason for an engine one; a request that failed in the engine is an error for it alone."""
    if reason == FinishReason.ERROR:
        raise request_failed(error, code)
    return reason.value if reason is not None else FinishReason.ABORT.value


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass(frozen=True)
class ToolOutput:
    """How an answer's tool calls are read: ``names`` offered (empty: none are read), ``forced`` (the output is the
    call JSON itself, ``server.tool_calls``), ``bare_json`` (a bare JSON object may be a call; not under the union
    grammar, where it is the answer)."""

    names: frozenset[str] = frozenset()
    forced: bool = False
    bare_json: bool = True


def _check_options(req: ChatCompletionRequest) -> tuple[RequestConstraint | None, bool]:
    """``(the request's constraint, whether it forces tool calls)``; at most one constraint per request."""
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    tool = forced_tool_constraint(req)
    fmt = response_format_constraint(req.response_format)  # validated even when unused: malformed stays a 400
    if tool is not None:
        # As in OpenAI's API, response_format governs a content answer only, and a forced call never gives one.
        fmt = None
    constraint = at_most_one([*body_constraints(req), fmt, tool])
    if constraint is not None and constraint is fmt:
        # "auto" with a format: a call is still possible, so the answer's format joins it.
        constraint = tool_or_answer_constraint(req, fmt) or fmt
    return constraint, tool is not None


@router.post("/v1/chat/completions", summary="Create a chat completion (OpenAI-compatible)")
async def chat_completions(body: ChatCompletionRequest, request: Request, state: StateDep):
    check_extra_fields(body, "/v1/chat/completions")
    state.check_model(body.model)
    engine = state.ready_engine()
    constraint, forced = _check_options(body)
    text, parse_tools = state.render_chat(body)
    prompt_ids = encode(engine.tokenizer, text, add_special_tokens=False)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_new = budget(requested, len(prompt_ids), engine.max_context_len, state.kv_total_tokens, "messages")
    params = openai_params(
        body,
        max_new_tokens=max_new,
        vocab_size=engine.vocab_size,
        return_logprob=body.logprobs,
        top_logprobs=body.top_logprobs or 0,
        constraint=constraint.spec if constraint is not None else None,
        defaults=state.sampling_defaults,
    )
    await compile_constraints(engine, state.metrics, [constraint])
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    group = RequestGroup(engine, state.metrics, state.inflight)
    group.submit([(prompt_ids, p, f"{cid}-{i}") for i, p in enumerate(params)])
    names = frozenset(t.function.name for t in body.tools or []) if parse_tools and not forced else frozenset()
    union = constraint is not None and constraint.spec.kind == "tool_or_answer"
    tools = ToolOutput(names, forced, bare_json=not union)
    created = int(time.time())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return SSEResponse(_stream(group, body, state, cid, created, tools, include_usage))
    results = await group.collect(request)
    choices = [_choice(i, r, body, state, tools) for i, r in enumerate(results)]
    return {
        "id": cid,
        "object": "chat.completion",
        "created": created,
        "model": state.served_name,
        "choices": choices,
        "usage": usage(results[0].prompt_tokens, sum(r.completion_tokens for r in results), results[0].cached_tokens),
    }


def _choice(index: int, res: Result, body: ChatCompletionRequest, state: ServerState, tools: ToolOutput) -> dict:
    reason = finish_reason(res.finish_reason, res.error, res.error_code)
    message: dict[str, Any] = {"role": "assistant", "content": res.text}
    if tools.forced:
        scanner = ToolCallScanner()
        scanner.feed(res.text)
        calls = scanner.finish()
        if calls:  # else (cut before a name was complete) the partial text stays content
            message = {"role": "assistant", "content": None, "tool_calls": [c.to_openai() for c in calls]}
            reason = "tool_calls" if scanner.complete else reason
    elif tools.names:
        content, calls = parse_tool_calls(res.text, set(tools.names), bare_json=tools.bare_json)
        if calls:
            message = {"role": "assistant", "content": content, "tool_calls": [c.to_openai() for c in calls]}
            reason = "tool_calls"
    assert state.token_names is not None
    return {
        "index": index,
        "message": message,
        "logprobs": chat_logprobs(res.logprobs, state.token_names) if body.logprobs else None,
        "finish_reason": reason,
        "matched_stop": res.matched_stop,
    }


async def _stream(
    group: RequestGroup,
    body: ChatCompletionRequest,
    state: ServerState,
    cid: str,
    created: int,
    tools: ToolOutput,
    include_usage: bool,
) -> AsyncIterator[str]:
    """Per choice: a first delta with the role, content deltas, a last chunk with finish_reason; then the
    usage chunk (if asked for) and [DONE]. Choices interleave as their tokens arrive. A forced tool call
    streams tool-call deltas instead of content: index, id and name first, then argument fragments."""
    names = state.token_names
    assert names is not None

    def chunk(choices: list[dict[str, Any]], usage_: dict[str, Any] | None = None) -> str:
        return stream_chunk(cid, "chat.completion.chunk", created, state.served_name, choices, usage_, include_usage)

    def delta(index: int, d: dict[str, Any], logprobs: Any = None, reason: str | None = None) -> str:
        return chunk([{"index": index, "delta": d, "logprobs": logprobs, "finish_reason": reason}])

    n = len(group.rids)
    filters = [ToolCallStream(set(tools.names), bare_json=tools.bare_json) if tools.names else None for _ in range(n)]
    scanners = [ToolCallScanner() if tools.forced else None for _ in range(n)]
    finals: list[ReqOutput | None] = [None] * n
    try:
        for i in range(n):
            yield delta(i, {"role": "assistant", "content": None if tools.forced else ""})
        async for i, out in group:
            reason = finish_reason(out.finish_reason, out.error, out.error_code) if out.finished else None
            lps = chat_logprobs(out.logprobs, names) if body.logprobs and out.logprobs else None
            scanner = scanners[i]
            if scanner is not None:
                for event in _forced_deltas(scanner, out, lps, reason):
                    yield delta(i, *event)
                if out.finished:
                    finals[i] = out
                continue
            filt = filters[i]
            text = filt.feed(out.text) if filt is not None else out.text
            if text or lps:
                yield delta(i, {"content": text}, lps)
            if not out.finished:
                continue
            finals[i] = out
            if filt is not None:
                rest, calls = filt.finish()
                if rest:
                    yield delta(i, {"content": rest})
                if calls:
                    yield delta(i, {"tool_calls": [c.to_openai(k) for k, c in enumerate(calls)]})
                    reason = "tool_calls"
            yield delta(i, {}, None, reason)
        if include_usage:
            done = [f for f in finals if f is not None]
            yield chunk([], usage(done[0].prompt_tokens, sum(f.completion_tokens for f in done), done[0].cached_tokens))
        yield DONE
    finally:
        group.close()


def _forced_deltas(
    scanner: ToolCallScanner, out: ReqOutput, lps: Any, reason: str | None
) -> list[tuple[dict[str, Any], Any, str | None]]:
    """``(delta, logprobs, finish_reason)`` events of one output of a forced tool call (logprobs on the first)."""
    events: list[tuple[dict[str, Any], Any, str | None]] = [
        ({"tool_calls": [d]}, None, None) for d in scanner.feed(out.text)
    ]
    if lps:
        if events:
            events[0] = (events[0][0], lps, None)
        else:
            events.append(({}, lps, None))
    if out.finished:
        if not scanner.calls or all(c.name is None for c in scanner.calls):
            if scanner.text:  # cut before a name was complete: the text is content, as without streaming
                events.append(({"content": scanner.text}, None, None))
        elif scanner.complete:
            reason = "tool_calls"
        events.append(({}, None, reason))
    return events
