"""The Responses API's output items and its stream of events, built from the chat turn's events.

An ``Emitter`` numbers the events (``sequence_number`` from 0, one per event: a background response's stream is
resumed by it) and keeps the output items as they grow, so that at any moment ``items`` is the response's output
so far: what a streamed ``response.completed``, a polled background response and a cancelled one carry.

Invariants: an item's id is fixed when it is added; the deltas of an item joined equal its final text or
arguments; an item is open (``in_progress``) from ``output_item.added`` to ``output_item.done``.
"""

from __future__ import annotations

import uuid
from typing import Any

from radixserve.server.chat_core import ChatChoice, TextDelta, ToolDelta
from radixserve.server.errors import APIError, internal_error
from radixserve.server.streaming import sse_event
from radixserve.server.tool_parser import ParsedToolCall


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(item_id: str, text: str, status: str = "completed", logprobs: list | None = None) -> dict[str, Any]:
    content = [text_part(text, logprobs)] if status != "in_progress" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def call_item(item_id: str, call: ParsedToolCall, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if status != "in_progress" else "",
        "status": status,
    }


def output_items(choice: ChatChoice, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A finished choice's output: its reasoning, its answer (always, unless it is only tool calls), its calls."""
    items = []
    if choice.reasoning:
        items.append(reasoning_item(new_id("rs"), choice.reasoning))
    status = "incomplete" if choice.finish_reason == "length" else "completed"
    if choice.content or not choice.tool_calls:
        items.append(message_item(new_id("msg"), choice.content or "", status, logprobs))
    items += [call_item(new_id("fc"), call) for call in choice.tool_calls]
    if choice.tool_calls:
        items[-1]["status"] = status  # a call cut by max_output_tokens is the last one
    return items


def error_event(exc: BaseException, seq: int) -> str:
    err = exc if isinstance(exc, APIError) else internal_error(exc)
    payload = {"type": "error", "code": str(err.code or err.status), "message": err.message, "param": err.param}
    return sse_event("error", {**payload, "sequence_number": seq})


class Emitter:
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

    def error(self, exc: BaseException) -> str:
        line = error_event(exc, self.seq)
        self.seq += 1
        return line

    def add(self, key: str, item: dict[str, Any]) -> list[str]:
        """Open an output item (sent with no content yet); a message gets its one output_text part."""
        self.open[key] = len(self.items)
        self.items.append(item)
        added = dict(item, content=[]) if "content" in item else dict(item)
        out = [self.event("response.output_item.added", output_index=self.open[key], item=added)]
        if item["type"] == "message":
            item["content"] = [text_part("")]
            out.append(self._part("response.content_part.added", self.open[key], text_part("")))
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

    def close_all(self, status: str) -> list[str]:
        """Close every open item, the last one with ``status`` (the item max_output_tokens or a cancel cut)."""
        out: list[str] = []
        for key in list(self.open):
            out += self.close(key, status if self.open[key] == len(self.items) - 1 else "completed")
        return out

    def text(self, event: TextDelta) -> list[str]:
        out: list[str] = []
        if event.kind == "reasoning":
            if "reasoning" not in self.open:
                out += self.add("reasoning", reasoning_item(new_id("rs"), "", "in_progress"))
            index = self.open["reasoning"]
            self.items[index]["content"][0]["text"] += event.text
            where = {"item_id": self.items[index]["id"], "output_index": index, "content_index": 0}
            out.append(self.event("response.reasoning_text.delta", **where, delta=event.text))
            return out
        out += self.close("reasoning")
        if "message" not in self.open:
            out += self.add("message", message_item(new_id("msg"), "", "in_progress"))
        index = self.open["message"]
        part = self.items[index]["content"][0]
        part["text"] += event.text
        logprobs, self.logprobs = self.logprobs, []
        part["logprobs"] += logprobs
        where = {"item_id": self.items[index]["id"], "output_index": index, "content_index": 0}
        out.append(self.event("response.output_text.delta", **where, delta=event.text, logprobs=logprobs))
        return out

    def tool(self, event: ToolDelta) -> list[str]:
        out: list[str] = []
        key = f"call{event.call}"
        if event.id is not None:
            out += self.close("reasoning") + self.close("message")
            for other in [k for k in self.open if k.startswith("call")]:
                out += self.close(other)
            call = ParsedToolCall(name=event.name or "", arguments="", id=event.id)
            out += self.add(key, call_item(new_id("fc"), call, "in_progress"))
        index = self.open[key]
        self.items[index]["arguments"] += event.arguments
        if event.arguments:
            item_id = self.items[index]["id"]
            out.append(
                self.event(
                    "response.function_call_arguments.delta", item_id=item_id, output_index=index, delta=event.arguments
                )
            )
        return out
