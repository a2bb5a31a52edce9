"""``/v1/responses``: OpenAI's Responses API (what the OpenAI Agents SDK speaks by default), over the chat turn.

``POST`` runs one chat turn (``server.chat_core``) and returns a response object whose ``output`` holds, in
order, a ``reasoning`` item (with ``--reasoning-parser``), a ``message`` item with the answer, and one
``function_call`` item per tool call. Streaming sends the Responses event sequence (``server.responses_events``):
``response.created``, ``response.in_progress``, then per output item ``output_item.added``, its deltas
(``reasoning_text.delta``, ``content_part.added`` + ``output_text.delta`` + ``content_part.done``,
``function_call_arguments.delta``) and ``output_item.done``, and last ``response.completed`` (or
``response.incomplete`` when max_output_tokens cut it); every event has a ``sequence_number``. ``store`` (default
true) keeps the response for ``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}``
(``server.responses_store``).

``background: true`` returns at once with status ``queued``; the response runs on in the server
(``server.responses_background``): ``GET`` polls it (``queued``, ``in_progress``, then final), ``POST
.../cancel`` stops it (status ``cancelled``, with the output made so far), and one created with ``stream: true``
can be streamed again from any event (``GET ...?stream=true&starting_after=N``). A client that disconnects from
a background response does not stop it.

Invariants: item ids are fixed when an item is added and the completed response carries the same items (the SDK
checks it); the streamed deltas of an item joined equal its text or arguments in the completed response.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request

from radixserve.server.chat_core import ChatRun, ChoiceDone, TextDelta, ToolDelta, collect, events, start_chat
from radixserve.server.deps import StateDep, require_api_key
from radixserve.server.errors import APIError, internal_error
from radixserve.server.extra_fields import check_extra_fields
from radixserve.server.logprobs import chat_logprobs
from radixserve.server.protocol import ChatCompletionRequest
from radixserve.server.responses_background import BackgroundRun, not_streamable, replay
from radixserve.server.responses_events import Emitter, error_event, message_item, new_id, output_items
from radixserve.server.responses_input import ResponsesRequest, chat_request, renamed_error
from radixserve.server.responses_store import StoredResponse
from radixserve.server.state import ServerState
from radixserve.server.streaming import SSEResponse

logger = logging.getLogger("radixserve.server")

router = APIRouter(dependencies=[Depends(require_api_key)], tags=["OpenAI"])


@dataclass
class _Turn:
    """One response being made: the request, its translation and what the output items will be called."""

    body: ResponsesRequest
    chat: ChatCompletionRequest
    conversation: list[dict[str, Any]]
    id: str = field(default_factory=lambda: new_id("resp"))
    created: float = field(default_factory=time.time)
    run: ChatRun | None = None
    emitter: Emitter = field(default_factory=Emitter)
    status: str = "queued"  # then in_progress once the engine has produced output, then final
    final: dict[str, Any] | None = None  # the finished response (completed or incomplete)
    error: APIError | None = None  # the engine failed the request

    def envelope(self, state: ServerState, status: str, output: list[dict[str, Any]], **extra: Any) -> dict:
        body = self.body
        fmt = (body.text or {}).get("format") or {"type": "text"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": int(self.created),
            "status": status,
            "background": body.background,
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.run.model if self.run is not None else state.served_name,
            "output": output,
            "parallel_tool_calls": bool(body.parallel_tool_calls) if body.parallel_tool_calls is not None else True,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": body.store,
            "temperature": body.temperature,
            "text": {"format": fmt},
            "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [],
            "top_p": body.top_p,
            "truncation": "disabled",
            "usage": None,
            "metadata": body.metadata or {},
            **extra,
        }


async def _start(body: ResponsesRequest, state: ServerState) -> _Turn:
    check_extra_fields(body, "/v1/responses")
    if body.background and not body.store:
        raise APIError(400, "a background response is polled from the store: send store: true", param="store")
    if body.background and state.config.responses_store_size == 0:
        raise APIError(
            400,
            "background responses need the response store, which --responses-store-size 0 turned off",
            param="background",
        )
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = state.responses.get(body.previous_response_id)
        if previous is None and state.background.get(body.previous_response_id) is not None:
            raise APIError(
                400,
                f"previous response {body.previous_response_id!r} is still running in the background: wait until "
                "its status is final (GET /v1/responses/{id}), or cancel it",
                param="previous_response_id",
            )
        if previous is None and body.previous_response_id in state.foreground:
            raise APIError(
                400,
                f"previous response {body.previous_response_id!r} is still running: send this turn once it has ended",
                param="previous_response_id",
            )
        if previous is None:
            raise APIError(
                400,
                f"previous response {body.previous_response_id!r} was not found: it was not stored (store: false), "
                "was deleted, or has been evicted from this server's store",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        history = list(previous.conversation)
    try:
        chat, conversation = chat_request(body, history)
    except APIError as exc:
        raise renamed_error(exc) from None
    turn = _Turn(body, chat, conversation)
    try:
        turn.run = await start_chat(chat, state, prompt_param="input")
    except APIError as exc:
        raise renamed_error(exc) from None
    return turn


@router.post("/v1/responses", summary="Create a model response (OpenAI Responses API)")
async def create_response(body: ResponsesRequest, request: Request, state: StateDep):
    turn = await _start(body, state)
    assert turn.run is not None
    if body.background:
        render = lambda: turn.envelope(state, turn.status, turn.emitter.items)  # noqa: E731
        run = BackgroundRun(turn.id, render, body.stream, abandon=lambda: _abandon(turn, state))
        state.background.start(run, lambda run: _run_in_background(turn, state, run))
        if body.stream:
            return SSEResponse(run.follow(None), on_error=lambda exc: [error_event(exc, 0)])
        return copy.deepcopy(run.snapshot())
    if body.stream:
        return SSEResponse(_stream(turn, state), on_error=lambda exc: [error_event(exc, 0)])
    state.foreground.add(turn.id)
    try:
        choice = (await collect(turn.run, request))[0]
    finally:
        state.foreground.discard(turn.id)
    items = output_items(choice, _logprobs(turn, choice.result.logprobs, state))
    response = _finish(turn, state, choice.finish_reason, choice.result, items)
    _store(turn, state, response)
    return response


@router.get("/v1/responses/{response_id}", summary="Retrieve a response (a background one while it runs)")
async def get_response(
    response_id: str,
    state: StateDep,
    stream: bool = False,
    starting_after: Annotated[int | None, Query(ge=0)] = None,
):
    """The response as it is now; with ``stream=true`` (a background response created streaming) its events
    after ``starting_after``, then, while it runs, each event as it comes."""
    run = state.background.get(response_id)
    if run is not None:
        if not stream:
            return copy.deepcopy(run.snapshot())
        if not run.keep_events:
            raise not_streamable(response_id)
        return SSEResponse(run.follow(starting_after), on_error=lambda exc: [error_event(exc, 0)])
    entry = _stored(response_id, state)
    if not stream:
        return entry.response
    if entry.events is None:
        raise not_streamable(response_id)
    return SSEResponse(replay(entry.events, starting_after))


@router.post("/v1/responses/{response_id}/cancel", summary="Cancel a background response")
async def cancel_response(response_id: str, state: StateDep):
    """Stop a background response: status ``cancelled``, with the output made so far. Cancelling one that has
    already ended returns it as it ended."""
    run = state.background.get(response_id)
    if run is not None:
        await run.cancel()
        assert run.final is not None
        return run.final
    entry = None if response_id in state.foreground else _stored(response_id, state)  # (running: not stored yet)
    if entry is None or not entry.response.get("background"):
        raise APIError(
            400,
            f"response {response_id!r} was not created with background: true; only background responses can be "
            "cancelled",
            param="response_id",
        )
    return entry.response


@router.delete("/v1/responses/{response_id}", summary="Delete a stored response (a running one is cancelled)")
async def delete_response(response_id: str, state: StateDep):
    if response_id in state.foreground:  # (it would be stored when it ends: deleted, it would come back)
        raise APIError(
            400,
            f"response {response_id!r} is still running for its caller; delete it once it has ended",
            param="response_id",
        )
    run = state.background.get(response_id)
    if run is not None:
        await run.cancel()
    if not state.responses.delete(response_id):
        _stored(response_id, state)
    return {"id": response_id, "object": "response", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items", summary="The input items of a stored response")
async def response_input_items(
    response_id: str,
    state: StateDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
):
    """A page of the conversation the response answered, newest first unless ``order`` is ``asc``, ``limit``
    items after the item ``after``, as OpenAI pages lists. Item ids are the response's id and the item's place."""
    entry = _stored(response_id, state)
    items = [i for m in entry.conversation[:-1] for i in _input_item(m)]
    tail = response_id.removeprefix("resp_")
    for k, item in enumerate(items):
        prefix = "fc" if item["type"] == "function_call" else "fco" if item["type"].endswith("output") else "msg"
        item["id"] = f"{prefix}_{tail}_{k}"
    data = items[::-1] if order == "desc" else items
    if after is not None:
        ids = [i["id"] for i in data]
        if after not in ids:
            raise APIError(400, f"no input item of {response_id!r} has the id {after!r}", param="after")
        data = data[ids.index(after) + 1 :]
    page = data[:limit]
    first, last = (page[0]["id"], page[-1]["id"]) if page else (None, None)
    return {"object": "list", "data": page, "first_id": first, "last_id": last, "has_more": len(data) > limit}


def _stored(response_id: str, state: ServerState) -> StoredResponse:
    """A response in the store (a background one still running is not there yet: callers look there first)."""
    entry = state.responses.get(response_id)
    if entry is None:
        raise APIError(404, f"no stored response has the id {response_id!r}", param="response_id", code="not_found")
    return entry


def _input_item(message: dict[str, Any]) -> list[dict[str, Any]]:
    if message["role"] == "tool":
        return [{"type": "function_call_output", "call_id": message["tool_call_id"], "output": message["content"]}]
    items = []
    if message.get("content"):
        kind = "output_text" if message["role"] == "assistant" else "input_text"
        items.append(
            {"type": "message", "role": message["role"], "content": [{"type": kind, "text": message["content"]}]}
        )
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        items.append({"type": "function_call", "call_id": call["id"], "name": fn["name"], "arguments": fn["arguments"]})
    return items


def _logprobs(turn: _Turn, lps: Any, state: ServerState) -> list[dict[str, Any]]:
    """The answer's token logprobs as an ``output_text`` part lists them (asked for with ``include``
    ``message.output_text.logprobs`` or ``top_logprobs``): one entry per token, as in a chat completion."""
    if not turn.chat.logprobs or not lps:
        return []
    assert state.token_names is not None
    return chat_logprobs(lps, state.token_names)["content"]


def _usage(res: Any, reasoning: str | None, state: ServerState) -> dict[str, Any]:
    thought = 0
    engine = state.engine  # (not ready_engine: a response that ends while the server drains is still counted)
    if reasoning and engine is not None:
        thought = min(res.completion_tokens, len(engine.tokenizer.encode(reasoning, add_special_tokens=False)))
    return {
        "input_tokens": res.prompt_tokens,
        "input_tokens_details": {"cached_tokens": res.cached_tokens},
        "output_tokens": res.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": thought},
        "total_tokens": res.prompt_tokens + res.completion_tokens,
    }


def _finish(turn: _Turn, state: ServerState, reason: str, res: Any, items: list[dict[str, Any]]) -> dict[str, Any]:
    """The finished response object (not stored yet: ``_store``)."""
    incomplete = reason in ("length", "abort")
    status = "incomplete" if incomplete else "completed"
    details = {"reason": "max_output_tokens" if reason == "length" else "interrupted"} if incomplete else None
    reasoning = next((i["content"][0]["text"] for i in items if i["type"] == "reasoning"), None)
    response = turn.envelope(state, status, items, incomplete_details=details)
    response["usage"] = _usage(res, reasoning, state)
    return response


def _store(turn: _Turn, state: ServerState, response: dict[str, Any], events: list[str] | None = None) -> None:
    """Keep the response, with its conversation (and the events of a streamed background one), when the request
    asked for it."""
    if turn.body.store:
        conversation = tuple([*turn.conversation, _assistant_message(response["output"])])
        state.responses.put(StoredResponse(response, conversation, tuple(events) if events is not None else None))


def _assistant_message(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The response's output as the chat message the next turn's prompt renders."""
    text = "".join(i["content"][0]["text"] for i in items if i["type"] == "message" and i["content"])
    calls = [
        {"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
        for i in items
        if i["type"] == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return message


def _failed(turn: _Turn, state: ServerState, error: APIError) -> dict[str, Any]:
    """The response a failure ended, its ``error.code`` one of OpenAI's (``ResponseError``)."""
    code = "rate_limit_exceeded" if error.status == 429 else "invalid_prompt" if error.status < 500 else "server_error"
    return turn.envelope(state, "failed", turn.emitter.items, error={"code": code, "message": error.message})


def _abandon(turn: _Turn, state: ServerState) -> dict[str, Any]:
    """A background response cancelled before its task ever ran: its requests stopped, stored ``cancelled``."""
    assert turn.run is not None
    turn.run.group.close()
    turn.emitter.close_all("incomplete")
    response = turn.envelope(state, "cancelled", turn.emitter.items)
    turn.status = "cancelled"
    _store(turn, state, response)
    return response


# ------------------------------------------------------------------------------------------------ streaming
async def _stream(turn: _Turn, state: ServerState) -> AsyncIterator[str]:
    # Closing this stream closes the events at once (their ``finally`` aborts the request), not at collection.
    state.foreground.add(turn.id)
    try:
        async with contextlib.aclosing(_turn_events(turn, state, background=False)) as bursts:
            async for lines in bursts:
                for line in lines:
                    yield line
    finally:
        state.foreground.discard(turn.id)


async def _turn_events(turn: _Turn, state: ServerState, background: bool) -> AsyncIterator[list[str]]:
    """The response's events, in bursts (each engine output's). Sets ``turn.final`` (stored at once unless in
    the background, whose runner stores it with its events) or ``turn.error``. A background response is created
    ``queued`` and goes ``in_progress`` with the engine's first output; a streamed one is in progress at once."""
    run, em = turn.run, turn.emitter
    assert run is not None
    try:
        turn.status = "queued" if background else "in_progress"
        yield [em.event("response.created", response=turn.envelope(state, turn.status, []))]
        if not background:
            yield [em.event("response.in_progress", response=turn.envelope(state, "in_progress", []))]
        async for event in events(run):
            out: list[str] = []
            if turn.status == "queued":
                turn.status = "in_progress"
                out.append(em.event("response.in_progress", response=turn.envelope(state, "in_progress", [])))
            if isinstance(event, TextDelta | ToolDelta):
                em.logprobs += _logprobs(turn, event.logprobs, state)
            if isinstance(event, TextDelta) and event.text:
                out += em.text(event)
            elif isinstance(event, ToolDelta):
                out += em.tool(event)
            elif isinstance(event, ChoiceDone):
                status = "incomplete" if event.finish_reason == "length" else "completed"
                out += em.close_all(status)  # the last item open is the one max_output_tokens cut
                if not any(i["type"] in ("message", "function_call") for i in em.items):
                    out += em.add("message", message_item(new_id("msg"), "", "in_progress"))
                    out += em.close("message", status)
                response = _finish(turn, state, event.finish_reason, event.output, em.items)
                turn.final, turn.status = response, response["status"]
                if not background:
                    _store(turn, state, response)  # before the client hears of it: it may continue from it at once
                kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
                out.append(em.event(kind, response=response))
            yield out
    except APIError as exc:  # the engine failed this request: the stream says so, as OpenAI's does
        turn.error, turn.status = exc, "failed"
        yield [em.error(exc)]
    finally:
        run.group.close()


async def _run_in_background(turn: _Turn, state: ServerState, run: BackgroundRun) -> None:
    """Make a background response; whatever ends it (its end, a failure, a cancel) leaves it final and stored.
    Between publishing the last event and storing nothing awaits, so a client that heard of the end finds it."""
    em = turn.emitter
    try:
        async for lines in _turn_events(turn, state, background=True):
            run.publish(lines)
        if turn.final is not None:
            response = turn.final
        else:  # the engine failed it (the stream has the error event): the stream ends with the failed response
            run.publish(em.close_all("incomplete"))
            response = _failed(turn, state, turn.error or APIError(500, "the engine ended the request without output"))
            run.publish([em.event("response.failed", response=response)])
    except asyncio.CancelledError:  # POST .../cancel (or the server's loop shutting down): no event says it
        run.publish(em.close_all("incomplete"))
        response = turn.envelope(state, "cancelled", em.items)
    except Exception as exc:  # noqa: BLE001 - a background response must end final, never stay in_progress
        logger.exception("background response %s failed", turn.id)
        run.publish([em.error(exc), *em.close_all("incomplete")])
        response = _failed(turn, state, internal_error(exc))
        run.publish([em.event("response.failed", response=response)])
    turn.status = response["status"]
    _store(turn, state, response, run.events if run.keep_events else None)
    run.finish(response)
