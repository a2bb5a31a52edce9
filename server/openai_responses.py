"""``/v1/responses``: OpenAI's Responses API (what the OpenAI Agents SDK speaks by default), over the chat turn.

``POST`` runs one chat turn (``server.chat_core``) and returns a response object whose ``output`` holds, in
order, a ``reasoning`` item (with ``--reasoning-parser``), a ``message`` item with the answer, and one
``function_call`` item per tool call. Streaming sends the Responses event sequence: ``response.created``,
``response.in_progress``, then per output item ``output_item.added``, its deltas (``reasoning_text.delta``,
``content_part.added`` + ``output_text.delta`` + ``content_part.done``, ``function_call_arguments.delta``)
and ``output_item.done``, and last ``response.completed`` (or ``response.incomplete`` when max_output_tokens
cut it); every event has a ``sequence_number``. ``store`` (default true) keeps the response for
``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}`` (``server.responses_store``).

Invariants: item ids are fixed when an item is added and the completed response carries the same items (the SDK
checks it); the streamed deltas of an item joined equal its text or arguments in the completed response.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request

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
from radixserve.server.errors import APIError, internal_error
from radixserve.server.extra_fields import check_extra_fields
from radixserve.server.logprobs import chat_logprobs
from radixserve.server.protocol import ChatCompletionRequest
from radixserve.server.responses_input import ResponsesRequest, chat_request, renamed_error
from radixserve.server.responses_store import StoredResponse
from radixserve.server.state import ServerState
from radixserve.server.streaming import SSEResponse, sse_event
from radixserve.server.tool_parser import ParsedToolCall

router = APIRouter(dependencies=[Depends(require_api_key)], tags=["OpenAI"])


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _Turn:
    """One response being made: the request, its translation and what the output items will be called."""

    body: ResponsesRequest
    chat: ChatCompletionRequest
    conversation: list[dict[str, Any]]
    id: str = field(default_factory=lambda: _id("resp"))
    created: float = field(default_factory=time.time)
    run: ChatRun | None = None

    def envelope(self, state: ServerState, status: str, output: list[dict[str, Any]], **extra: Any) -> dict:
        body = self.body
        fmt = (body.text or {}).get("format") or {"type": "text"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": int(self.created),
            "status": status,
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": state.served_name,
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
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = state.responses.get(body.previous_response_id)
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
    if body.stream:
        return SSEResponse(_stream(turn, state), on_error=lambda exc: [_error_event(exc, 0)])
    choice = (await collect(turn.run, request))[0]
    items = _items(choice, _logprobs(turn, choice.result.logprobs, state))
    return _finish(turn, state, choice.finish_reason, choice.result, items)


@router.get("/v1/responses/{response_id}", summary="Retrieve a stored response")
async def get_response(response_id: str, state: StateDep):
    return _stored(response_id, state).response


@router.delete("/v1/responses/{response_id}", summary="Delete a stored response")
async def delete_response(response_id: str, state: StateDep):
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


# ------------------------------------------------------------------------------------------------ items
def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def _text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _logprobs(turn: _Turn, lps: Any, state: ServerState) -> list[dict[str, Any]]:
    """The answer's token logprobs as an ``output_text`` part lists them (asked for with ``include``
    ``message.output_text.logprobs`` or ``top_logprobs``): one entry per token, as in a chat completion."""
    if not turn.chat.logprobs or not lps:
        return []
    assert state.token_names is not None
    return chat_logprobs(lps, state.token_names)["content"]


def _message_item(item_id: str, text: str, status: str = "completed", logprobs: list | None = None) -> dict[str, Any]:
    content = [_text_part(text, logprobs)] if status != "in_progress" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _call_item(item_id: str, call: ParsedToolCall, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if status != "in_progress" else "",
        "status": status,
    }


def _items(choice: ChatChoice, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    items = []
    if choice.reasoning:
        items.append(_reasoning_item(_id("rs"), choice.reasoning))
    status = "incomplete" if choice.finish_reason == "length" else "completed"
    if choice.content or not choice.tool_calls:
        items.append(_message_item(_id("msg"), choice.content or "", status, logprobs))
    items += [_call_item(_id("fc"), call) for call in choice.tool_calls]
    if choice.tool_calls:
        items[-1]["status"] = status  # a call cut by max_output_tokens is the last one
    return items


def _usage(res: Any, reasoning: str | None, state: ServerState) -> dict[str, Any]:
    thought = 0
    if reasoning:
        engine = state.ready_engine()
        thought = min(res.completion_tokens, len(engine.tokenizer.encode(reasoning, add_special_tokens=False)))
    return {
        "input_tokens": res.prompt_tokens,
        "input_tokens_details": {"cached_tokens": res.cached_tokens},
        "output_tokens": res.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": thought},
        "total_tokens": res.prompt_tokens + res.completion_tokens,
    }


def _finish(turn: _Turn, state: ServerState, reason: str, res: Any, items: list[dict[str, Any]]) -> dict[str, Any]:
    """The completed response object; stored (with its conversation) when the request asked for it."""
    incomplete = reason in ("length", "abort")
    status = "incomplete" if incomplete else "completed"
    details = {"reason": "max_output_tokens" if reason == "length" else "interrupted"} if incomplete else None
    reasoning = next((i["content"][0]["text"] for i in items if i["type"] == "reasoning"), None)
    response = turn.envelope(state, status, items, incomplete_details=details)
    response["usage"] = _usage(res, reasoning, state)
    if turn.body.store:
        state.responses.put(StoredResponse(response, tuple([*turn.conversation, _assistant_message(items)])))
    return response


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


# ------------------------------------------------------------------------------------------------ streaming
class _Emitter:
    """Numbers the events and keeps the output items as they grow."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, int] = {}  # "reasoning" / "message" / f"call{k}" -> output index while it is open
        self.logprobs: list[dict[str, Any]] = []  # arrived, not sent yet: they go with the next text delta

    def event(self, kind: str, **payload: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **payload}
        self.seq += 1
        return sse_event(kind, data)

    def add(self, key: str, item: dict[str, Any]) -> list[str]:
        """Open an output item (sent with no content yet); a message gets its one output_text part."""
        self.open[key] = len(self.items)
        self.items.append(item)
        added = dict(item, content=[]) if "content" in item else dict(item)
        out = [self.event("response.output_item.added", output_index=self.open[key], item=added)]
        if item["type"] == "message":
            item["content"] = [_text_part("")]
            out.append(self._part("response.content_part.added", self.open[key], _text_part("")))
        return out

    def _part(self, kind: str, index: int, part: dict[str, Any]) -> str:
        return self.event(kind, item_id=self.items[index]["id"], output_index=index, content_index=0, part=part)

    def close(self, key: str, status: str = "completed") -> list[str]:
        index = self.open.pop(key, None)
        if index is None:
            return []
        item = self.items[index]
        item["status"] = status
        out = []
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            out.append(self.event("response.reasoning_text.done", **where, content_index=0, text=text))
        elif item["type"] == "message":
            part = item["content"][0]
            done = {"text": part["text"], "logprobs": part["logprobs"]}
            out.append(self.event("response.output_text.done", **where, content_index=0, **done))
            out.append(self._part("response.content_part.done", index, part))
        else:
            out.append(
                self.event(
                    "response.function_call_arguments.done", **where, name=item["name"], arguments=item["arguments"]
                )
            )
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out


async def _stream(turn: _Turn, state: ServerState) -> AsyncIterator[str]:
    run = turn.run
    assert run is not None
    em = _Emitter()
    try:
        yield em.event("response.created", response=turn.envelope(state, "in_progress", []))
        yield em.event("response.in_progress", response=turn.envelope(state, "in_progress", []))
        async for event in events(run):
            if isinstance(event, TextDelta | ToolDelta):
                em.logprobs += _logprobs(turn, event.logprobs, state)
            if isinstance(event, TextDelta) and event.text:
                for line in _text_events(em, event):
                    yield line
            elif isinstance(event, ToolDelta):
                for line in _tool_events(em, event):
                    yield line
            elif isinstance(event, ChoiceDone):
                status = "incomplete" if event.finish_reason == "length" else "completed"
                for key in list(em.open):  # the last item open is the one max_output_tokens cut
                    for line in em.close(key, status if em.open[key] == len(em.items) - 1 else "completed"):
                        yield line
                if not any(i["type"] in ("message", "function_call") for i in em.items):
                    for line in em.add("message", _message_item(_id("msg"), "", "in_progress")):
                        yield line
                    for line in em.close("message", status):
                        yield line
                response = _finish(turn, state, event.finish_reason, event.output, em.items)
                kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
                yield em.event(kind, response=response)
    except APIError as exc:  # the engine failed this request: the stream says so, as OpenAI's does
        yield _error_event(exc, em.seq)
    finally:
        run.group.close()


def _error_event(exc: BaseException, seq: int) -> str:
    err = exc if isinstance(exc, APIError) else internal_error(exc)
    payload = {"type": "error", "code": str(err.code or err.status), "message": err.message, "param": err.param}
    return sse_event("error", {**payload, "sequence_number": seq})


def _text_events(em: _Emitter, event: TextDelta) -> list[str]:
    out: list[str] = []
    if event.kind == "reasoning":
        if "reasoning" not in em.open:
            out += em.add("reasoning", _reasoning_item(_id("rs"), "", "in_progress"))
        index = em.open["reasoning"]
        em.items[index]["content"][0]["text"] += event.text
        item_id = em.items[index]["id"]
        out.append(
            em.event(
                "response.reasoning_text.delta", item_id=item_id, output_index=index, content_index=0, delta=event.text
            )
        )
        return out
    out += em.close("reasoning")
    if "message" not in em.open:
        out += em.add("message", _message_item(_id("msg"), "", "in_progress"))
    index = em.open["message"]
    part = em.items[index]["content"][0]
    part["text"] += event.text
    logprobs, em.logprobs = em.logprobs, []
    part["logprobs"] += logprobs
    item_id = em.items[index]["id"]
    out.append(
        em.event(
            "response.output_text.delta",
            item_id=item_id,
            output_index=index,
            content_index=0,
            delta=event.text,
            logprobs=logprobs,
        )
    )
    return out


def _tool_events(em: _Emitter, event: ToolDelta) -> list[str]:
    out: list[str] = []
    key = f"call{event.call}"
    if event.id is not None:
        out += em.close("reasoning") + em.close("message")
        for other in [k for k in em.open if k.startswith("call")]:
            out += em.close(other)
        call = ParsedToolCall(name=event.name or "", arguments="", id=event.id)
        out += em.add(key, _call_item(_id("fc"), call, "in_progress"))
    index = em.open[key]
    em.items[index]["arguments"] += event.arguments
    if event.arguments:
        item_id = em.items[index]["id"]
        out.append(
            em.event(
                "response.function_call_arguments.delta", item_id=item_id, output_index=index, delta=event.arguments
            )
        )
    return out
