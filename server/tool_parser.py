"""Find tool calls in a model's answer: ``<tool_call>{json}</tool_call>`` blocks (Qwen, Hermes), an answer that is
just a JSON object ``{"name": ..., "arguments": ...}`` or a list of them (Llama 3.x, Mistral), or an answer that is
a Python list of calls ``[get_weather(city="Paris"), add(a=1, b=2)]`` (the pythonic form of Llama 3.2 and Llama 4,
vLLM's ``pythonic`` parser: keyword arguments whose values are Python literals, read without evaluating anything).

A call counts only if it names one of the tools offered and its JSON parses; anything else stays content, so a
model that merely talks about a function (or writes JSON for another reason) is never turned into a call.
"""

from __future__ import annotations

import ast
import json
import math
import uuid
from dataclasses import dataclass
from typing import Any

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object as text, as OpenAI sends it
    id: str

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            call = {"index": index, **call}
        return call


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _as_call(obj: Any, names: set[str]) -> ParsedToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = _load(args)
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False), id=new_call_id())


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text} is out of range")
    return value


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite)


def _load(text: str) -> Any:
    """Strict JSON (no NaN / Infinity, no number that overflows to inf), so a call's arguments re-serialize as
    JSON every client parses; None when ``text`` is not such JSON."""
    try:
        return _DECODER.decode(text)
    except (ValueError, RecursionError):
        return None


def _blocks(text: str, tool_names: set[str]) -> tuple[str, list[ParsedToolCall]] | None:
    """``(text outside the blocks, calls)`` for ``<tool_call>`` blocks, or None when a block is not a valid call.

    A block's extent is its JSON value's, not the next close tag: an argument may contain ``</tool_call>`` (the
    union grammar allows any string there). After the JSON come optional whitespace and the close tag, or the end
    of the text (an unterminated last block still counts).
    """
    outside, calls, pos = [], [], 0
    while (start := text.find(OPEN_TAG, pos)) >= 0:
        outside.append(text[pos:start])
        body = start + len(OPEN_TAG)
        body += len(text[body:]) - len(text[body:].lstrip())
        try:
            obj, end = _DECODER.raw_decode(text, body)
        except (ValueError, RecursionError):
            return None
        call = _as_call(obj, tool_names)
        if call is None:
            return None
        calls.append(call)
        end += len(text[end:]) - len(text[end:].lstrip())
        if text.startswith(CLOSE_TAG, end):
            end += len(CLOSE_TAG)
        elif end < len(text):
            return None
        pos = end
    outside.append(text[pos:])
    return "".join(outside), calls


def _pythonic(text: str, names: set[str]) -> list[ParsedToolCall] | None:
    """The calls of a pythonic answer (the module's docstring), or None where ``text`` is not a non-empty list of
    calls to offered tools with literal keyword arguments that JSON can carry (no NaN, sets or bytes)."""
    try:
        node = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(node, ast.List) or not node.elts:
        return None
    calls = []
    for call in node.elts:
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in names):
            return None
        if call.args or any(kw.arg is None for kw in call.keywords):  # positional or **kwargs: not a pythonic call
            return None
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
            text_args = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
        calls.append(ParsedToolCall(name=call.func.id, arguments=text_args, id=new_call_id()))
    return calls


def parse_tool_calls(
    text: str, tool_names: set[str], *, bare_json: bool = True
) -> tuple[str | None, list[ParsedToolCall]]:
    """Split ``text`` into (content, tool calls). Content is None when the answer was only tool calls.

    With no valid call found, returns ``(text, [])`` unchanged. ``bare_json=False`` reads only ``<tool_call>``
    blocks (no bare JSON, no pythonic list): under the union grammar (tools + a response_format) a bare JSON
    object is the answer, checked against the answer's schema only, so it must not become a call whose arguments
    nothing validated.
    """
    if OPEN_TAG in text:
        found = _blocks(text, tool_names)
        if found is None:
            return text, []  # a malformed block: keep the answer as the model wrote it
        rest, calls = found
        # Leading whitespace stays (a stream cannot know a call will follow when it sends it); trailing goes.
        content = rest.rstrip()
        return (content if content.strip() else None), calls
    stripped = text.strip()
    if bare_json and stripped.startswith(("{", "[")):
        obj = _load(stripped)
        objs = obj if isinstance(obj, list) else [obj]
        calls = [_as_call(o, tool_names) for o in objs]
        if objs and all(c is not None for c in calls):
            return None, [c for c in calls if c is not None]
        pythonic = _pythonic(stripped, tool_names) if obj is None and stripped.startswith("[") else None
        if pythonic:
            return None, pythonic
    return text, []


class ToolCallStream:
    """Streams content while holding back whatever may turn out to be a tool call.

    Invariant: ``feed`` only ever returns text that cannot belong to a call: the answer so far does not start
    (after whitespace) with ``{``/``[`` (with ``bare_json``), and the text returned precedes any ``<tool_call>``
    and any suffix that could still grow into one. ``finish`` parses the whole answer and returns the held content
    and the calls, so streamed content + finish content equals the non-streamed content.
    """

    def __init__(self, tool_names: set[str], *, bare_json: bool = True) -> None:
        self.tool_names = tool_names
        self.bare_json = bare_json
        self.text = ""
        self.sent = 0

    def feed(self, delta: str) -> str:
        self.text += delta
        stripped = self.text.lstrip()
        if not stripped or (self.bare_json and stripped.startswith(("{", "["))):
            return ""
        tag = self.text.find(OPEN_TAG)
        end = tag if tag >= 0 else len(self.text) - _partial_tag_len(self.text)
        # Trailing whitespace waits too: if a call follows, the non-streamed content has it stripped.
        end = len(self.text[:end].rstrip())
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : end], end
        return out

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """The content not yet returned, and the tool calls (empty if the answer had none)."""
        content, calls = parse_tool_calls(self.text, self.tool_names, bare_json=self.bare_json)
        if not calls:
            return self.text[self.sent :], []
        if content is None:  # only calls (tagged blocks, or bare JSON): ``feed`` sent nothing
            return "", calls
        # Nothing before ``sent`` is part of a block, and the content begins with all of it.
        return content[self.sent :], calls


def _partial_tag_len(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``<tool_call>``."""
    for n in range(min(len(OPEN_TAG) - 1, len(text)), 0, -1):
        if text.endswith(OPEN_TAG[:n]):
            return n
    return 0
