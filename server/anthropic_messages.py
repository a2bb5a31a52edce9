"""``POST /v1/messages`` (Anthropic's Messages API, what the ``anthropic`` SDK and coding agents speak) and
``POST /v1/messages/count_tokens``, over the shared chat turn (``server.chat_core``).

The answer is a list of content blocks: ``thinking`` (with ``--reasoning-parser``), ``text``, then one
``tool_use`` block per call (``input`` is the call's arguments as an object). ``stop_reason`` is ``end_turn``,
``max_tokens``, ``stop_sequence`` (with the matched ``stop_sequence``) or ``tool_use``. Usage counts cached
prompt tokens as ``cache_read_input_tokens`` and the rest as ``input_tokens``, as Anthropic does. Streaming sends
``message_start`` (with the first output, so that its usage has that split too), ``ping``, per block
``content_block_start`` / ``content_block_delta`` (``thinking_delta``, ``text_delta``, ``input_json_delta``) /
``content_block_stop``, then ``message_delta`` (stop reason, output tokens) and ``message_stop``. Errors have
Anthropic's shape ``{"type": "error", "error": {type, message}}`` (``server.errors`` picks it by path), in the
stream as an ``error`` event.

Invariant: the ``partial_json`` fragments of a tool_use block joined are its ``input`` as JSON text.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request

from radixserve.server.anthropic_input import CountTokensRequest, MessagesRequest, chat_request
from radixserve.server.chat_core import (
    ChatChoice,
    ChatRun,
    ChoiceDone,
    TextDelta,
    ToolDelta,
    collect,
    events,
    start_chat,
)
from radixserve.server.deps import StateDep, require_api_key
from radixserve.server.errors import APIError, anthropic_error_body, internal_error
from radixserve.server.extra_fields import check_extra_fields
from radixserve.server.protocol import ChatCompletionRequest
from radixserve.server.state import ServerState
from radixserve.server.streaming import SSEResponse, sse_event
from radixserve.server.tokens import encode

router = APIRouter(dependencies=[Depends(require_api_key)], tags=["Anthropic"])

# An answer cut by an abort (``/abort_request``, a shutdown's drain running out) is a paused turn, Anthropic's
# stop reason for "not finished: send it back (as a prefill) to continue", never ``end_turn``, which would let a
# client take the cut text for a whole answer. (Not an HTTP error: SDKs retry those, routers fail over on 503s.)
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "abort": "pause_turn"}


def _request(body: MessagesRequest, state: ServerState) -> ChatCompletionRequest:
    check_extra_fields(body, "/v1/messages")
    chat = chat_request(body, stream=body.stream)
    if state.reasoning_format is None and chat.max_thinking_tokens is not None:
        chat = chat.model_copy(update={"max_thinking_tokens": None})  # a model that does not think: nothing to cap
    return chat


@router.post("/v1/messages", summary="Create a message (Anthropic Messages API)")
async def create_message(body: MessagesRequest, request: Request, state: StateDep):
    run = await start_chat(_request(body, state), state)
    mid = f"msg_{uuid.uuid4().hex}"
    if body.stream:
        return SSEResponse(_stream(run, state, mid), on_error=lambda exc: [_error_event(exc)])
    choice = (await collect(run, request))[0]
    res = choice.result
    message = _message(mid, run.model, _usage(res.prompt_tokens, res.cached_tokens, res.completion_tokens))
    message["content"] = _content(choice)
    message["stop_reason"], message["stop_sequence"] = _stop(choice.finish_reason, res.matched_stop)
    return message


@router.post("/v1/messages/count_tokens", summary="Count the tokens of a message list (Anthropic Messages API)")
async def count_tokens(body: CountTokensRequest, state: StateDep):
    check_extra_fields(body, "/v1/messages/count_tokens")
    engine = state.ready_engine()  # (first: while loading, an adapter's name is not known yet)
    state.check_model(body.model)
    text, _ = state.render_chat(chat_request(body))
    return {"input_tokens": len(encode(engine.tokenizer, text, add_special_tokens=False))}


def _message(mid: str, model: str, usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }


def _usage(prompt: int, cached: int, output: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output,
    }


def _stop(reason: str, matched: str | int | None) -> tuple[str, str | None]:
    if reason == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return STOP_REASONS.get(reason, "end_turn"), None


def _input(arguments: str) -> Any:
    try:
        return json.loads(arguments) if arguments else {}
    except ValueError:  # cut by max_tokens: what there is, as text
        return {"_partial_arguments": arguments}


def _content(choice: ChatChoice) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if choice.reasoning:
        blocks.append({"type": "thinking", "thinking": choice.reasoning, "signature": ""})
    if choice.content or not (choice.tool_calls or blocks):
        blocks.append({"type": "text", "text": choice.content or ""})
    for call in choice.tool_calls:
        blocks.append({"type": "tool_use", "id": _tool_id(call.id), "name": call.name, "input": _input(call.arguments)})
    return blocks


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _error_event(exc: BaseException) -> str:
    err = exc if isinstance(exc, APIError) else internal_error(exc)
    return sse_event("error", anthropic_error_body(err.status, err.message))


async def _stream(run: ChatRun, state: ServerState, mid: str) -> AsyncIterator[str]:
    blocks: list[str] = []  # the kind of each block started; the last one is open until the next starts

    def start(kind: str, block: dict[str, Any]) -> list[str]:
        out = stop()
        blocks.append(kind)
        return out + [
            sse_event(
                "content_block_start", {"type": "content_block_start", "index": len(blocks) - 1, "content_block": block}
            )
        ]

    def stop() -> list[str]:
        if not blocks or blocks[-1] == "closed":
            return []
        index = len(blocks) - 1
        blocks[-1] = "closed"
        return [sse_event("content_block_stop", {"type": "content_block_stop", "index": index})]

    def delta(d: dict[str, Any]) -> str:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": len(blocks) - 1, "delta": d})

    started = False
    try:
        async for event in events(run):
            out: list[str] = []
            if not started:  # sent with the first output, whose usage says how much of the prompt was cached
                first = event.output
                assert first is not None
                start_msg = _message(mid, run.model, _usage(first.prompt_tokens, first.cached_tokens, 0))
                out += [sse_event("message_start", {"type": "message_start", "message": start_msg})]
                out += [sse_event("ping", {"type": "ping"})]
                started = True
            if isinstance(event, TextDelta) and event.text:
                if event.kind == "reasoning":
                    if not blocks or blocks[-1] != "thinking":
                        out += start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                    out.append(delta({"type": "thinking_delta", "thinking": event.text}))
                else:
                    if not blocks or blocks[-1] != "text":
                        out += start("text", {"type": "text", "text": ""})
                    out.append(delta({"type": "text_delta", "text": event.text}))
            elif isinstance(event, ToolDelta):
                if event.id is not None:
                    block = {"type": "tool_use", "id": _tool_id(event.id), "name": event.name, "input": {}}
                    out += start("tool_use", block)
                if event.arguments:
                    out.append(delta({"type": "input_json_delta", "partial_json": event.arguments}))
            elif isinstance(event, ChoiceDone):
                if not blocks:
                    out += start("text", {"type": "text", "text": ""})
                out += stop()
                res = event.output
                reason, sequence = _stop(event.finish_reason, res.matched_stop)
                usage = _usage(res.prompt_tokens, res.cached_tokens, res.completion_tokens)
                message_delta = {"stop_reason": reason, "stop_sequence": sequence}
                out.append(
                    sse_event("message_delta", {"type": "message_delta", "delta": message_delta, "usage": usage})
                )
                out.append(sse_event("message_stop", {"type": "message_stop"}))
            for line in out:
                yield line
    except APIError as exc:
        yield _error_event(exc)
    finally:
        run.group.close()
