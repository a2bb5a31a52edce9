"""Constrained tool calls: chat ``tool_choice`` "required" or ``{"type": "function", "function": {"name": ...}}``.

The output is constrained by a JSON schema to compact JSON: one call object ``{"name": <tool name>, "arguments":
<an instance of that tool's parameters schema>}`` ("required" with several tools: ``anyOf`` over them), so the
arguments always validate against the tool's ``parameters``. With ``parallel_tool_calls: true`` the output is a
non-empty array of such objects instead. Absent (or false) means exactly one call: OpenAI's default is parallel,
but a forced open-ended array lets a small model repeat calls until max_tokens, and one call is what forcing a
tool promises; a client that wants several calls in one turn says so.

Tools with ``tool_choice`` "auto" (or absent) and a JSON ``response_format`` (or ``guided_json``, ``json_schema``,
``structured_outputs.json``), the usual agent turn (tools plus a typed final output), get a ``tool_or_answer``
constraint instead: the output is either the formatted answer or ``<tool_call>{call}</tool_call>`` blocks (one,
or several with ``parallel_tool_calls: true``) whose calls follow the same per-tool schemas; the tool parser reads
the calls back as for unconstrained "auto".

``ToolCallScanner`` reads that JSON as it streams and turns it into OpenAI tool-call deltas: per call, first
``{index, id, type, function: {name, arguments: ""}}``, then ``{index, function: {arguments: <fragment>}}``.
Invariants: the arguments of a call are the exact text of its ``arguments`` value, so the streamed fragments
joined equal the non-streamed ``arguments`` (both come from this scanner); a call is announced once its name is
complete, and no fragment of its arguments is sent before that (the schema lists ``name`` first, and the backend
keeps schema order, so in practice nothing waits).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from radixserve.constrained.schema_refs import rebase_refs
from radixserve.server.constraints import RequestConstraint, make_constraint
from radixserve.server.errors import bad_request
from radixserve.server.protocol import ChatCompletionRequest, NamedToolChoice
from radixserve.server.tool_parser import ParsedToolCall, new_call_id

Subs = tuple[tuple[str, str], ...]
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def _call_schema(name: str, parameters: dict[str, Any] | None, at: str) -> dict[str, Any]:
    """One call object; ``at`` is the JSON pointer of this object in the document compiled, so the parameters'
    local ``$ref``s (``#/$defs/...``, as pydantic writes them) still name their targets once wrapped."""
    arguments = NO_PARAMETERS if parameters is None else rebase_refs(parameters, f"{at}/properties/arguments")
    if arguments.get("type") != "object":  # ``{}`` or a list of types: an object all the same (FunctionDef)
        arguments = {**arguments, "type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _tool_names(req: ChatCompletionRequest) -> list[str]:
    names = [t.function.name for t in req.tools or []]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise bad_request(f"two tools are named {name!r}; tool names must be unique", f"tools[{i}].function.name")
    return names


def _calls_schema(
    req: ChatCompletionRequest, names: list[str], selected: list[int], at: str, errors_at: str = ""
) -> tuple[Any, Subs]:
    """The schema of one call to any of the ``selected`` tools, placed at JSON pointer ``at`` of the document
    compiled, and where each tool's parameters sit (``RequestConstraint.sub_params`` pairs; error pointers of the
    constraint have ``errors_at`` before the document's own)."""
    tools = req.tools or []
    branch = [at + (f"/anyOf/{k}" if len(selected) > 1 else "") for k in range(len(selected))]
    calls = [_call_schema(names[i], tools[i].function.parameters, b) for b, i in zip(branch, selected)]
    subs = tuple(
        (f"{errors_at}{b}/properties/arguments", f"tools[{i}].function.parameters") for b, i in zip(branch, selected)
    )
    return (calls[0] if len(calls) == 1 else {"anyOf": calls}), subs


def tool_or_answer_constraint(req: ChatCompletionRequest, fmt: RequestConstraint | None) -> RequestConstraint | None:
    """With tools, ``tool_choice`` "auto" (or absent) and a JSON format (``fmt``: ``response_format``, or vLLM's
    ``guided_json`` and its kin): the output may be tool calls or the formatted answer (``constrained.tool_grammar``),
    so an agent with tools and a typed output keeps both. An error in the answer's schema is reported at
    ``fmt``'s field. None otherwise (no tools, no format, or a tool_choice that decides it)."""
    if fmt is None or not req.tools or req.tool_choice not in (None, "auto"):
        return None
    names = _tool_names(req)
    call, subs = _calls_schema(req, names, list(range(len(names))), "", errors_at="/call")
    answer = fmt.spec.value if fmt.spec.kind == "json_schema" else None
    value = {"call": call, "answer": answer, "parallel": bool(req.parallel_tool_calls)}
    return make_constraint("tool_or_answer", value, "tools", (*subs, ("/answer", fmt.param)))


def forced_tool_constraint(req: ChatCompletionRequest) -> RequestConstraint | None:
    """The constraint that enforces ``req.tool_choice``, or None when it is absent, "none" or "auto"."""
    choice = req.tool_choice
    if choice is None or choice in ("none", "auto"):
        return None
    if not req.tools:
        raise bad_request("tool_choice needs tools: give the tools the model may call", "tool_choice")
    names = _tool_names(req)
    selected = list(range(len(names)))
    if isinstance(choice, NamedToolChoice):
        name = choice.function.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request("a named tool_choice needs function.name", "tool_choice")
        if name not in names:
            raise bad_request(
                f"tool_choice names the function {name!r}, which is not among the tools ({', '.join(names)})",
                "tool_choice",
            )
        selected = [names.index(name)]
    base = "/items" if req.parallel_tool_calls else ""
    schema, subs = _calls_schema(req, names, selected, base)
    if req.parallel_tool_calls:
        schema = {"type": "array", "items": schema, "minItems": 1}
    return make_constraint("json_schema", schema, "tools", subs)


@dataclass
class _Call:
    id: str
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    announced: bool = False
    args_sent: int = 0  # characters of the arguments already sent


@dataclass
class ToolCallScanner:
    """Incremental reader of forced tool-call JSON (one call object, or an array of them).

    A small JSON tokenizer over the text: it tracks the open containers, strings and, at the level of a call
    object, which key's value is being read, to find each call's name and the span of its arguments.
    """

    text: str = ""
    calls: list[_Call] = field(default_factory=list)
    _pos: int = 0
    _stack: list[str] = field(default_factory=list)
    _call_depth: int = 0  # depth of call objects: 1 for a single object, 2 inside an array; 0 until known
    _in_string: bool = False
    _escape: bool = False
    _expect_key: bool = False
    _key: str | None = None
    _token_start: int | None = None  # start of the key string or the value being read at call level
    _value_kind: str | None = None  # "string", "container" or "literal" while a call-level value is read

    @property
    def complete(self) -> bool:
        """Whether the whole JSON value has been read (every call is closed)."""
        return self._call_depth > 0 and not self._stack and self._pos > 0

    def feed(self, delta: str) -> list[dict[str, Any]]:
        """Read ``delta`` and return the OpenAI tool-call deltas it completes, in order."""
        self.text += delta
        while self._pos < len(self.text):
            self._step(self.text[self._pos], self._pos)
            self._pos += 1
        return self._deltas()

    def finish(self) -> list[ParsedToolCall]:
        """Every call announced so far, with its arguments as far as they were generated."""
        out = []
        for call in self.calls:
            if call.name is not None:
                out.append(ParsedToolCall(name=call.name, arguments=self._args(call), id=call.id))
        return out

    # ------------------------------------------------------------------ reading
    def _at_call_level(self) -> bool:
        return len(self._stack) == self._call_depth and self._stack[-1] == "{"

    def _step(self, ch: str, i: int) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
                if self._at_call_level():
                    self._end_token(i + 1)
            return
        if ch in " \t\r\n":
            return
        if not self._call_depth:
            self._call_depth = 2 if ch == "[" else 1
        if self._at_call_level() and self._value_kind == "literal" and ch in ",}":
            self._end_token(i)
        if ch == '"':
            self._in_string = True
            if self._at_call_level():
                self._start_token(i, "string")
        elif ch in "{[":
            if self._at_call_level():
                self._start_token(i, "container")
            self._stack.append(ch)
            if ch == "{" and len(self._stack) == self._call_depth:
                self.calls.append(_Call(id=new_call_id()))
                self._expect_key, self._key = True, None
        elif ch in "}]":
            if self._stack:
                self._stack.pop()
            if self._value_kind == "container" and self._at_call_level():
                self._end_token(i + 1)
        elif self._at_call_level():
            if ch == ":":
                self._expect_key = False
            elif ch == ",":
                self._expect_key, self._key = True, None
            elif self._value_kind is None:
                self._start_token(i, "literal")

    def _start_token(self, i: int, kind: str) -> None:
        self._token_start = i
        if self._expect_key:
            return
        self._value_kind = kind
        if self._key == "arguments" and self.calls:
            self.calls[-1].args_start = i

    def _end_token(self, end: int) -> None:
        start, self._token_start = self._token_start, None
        if start is None:
            return
        raw = self.text[start:end]
        if self._expect_key and self._value_kind is None:
            self._key = json.loads(raw)
            return
        self._value_kind = None
        call = self.calls[-1] if self.calls else None
        if call is None:
            return
        if self._key == "name" and call.name is None:
            name = json.loads(raw)
            call.name = name if isinstance(name, str) else raw
        elif self._key == "arguments":
            call.args_end = end

    # ------------------------------------------------------------------ output
    def _args(self, call: _Call) -> str:
        if call.args_start is None:
            return ""
        end = call.args_end if call.args_end is not None else len(self.text)
        return self.text[call.args_start : end]

    def _deltas(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for index, call in enumerate(self.calls):
            if call.name is None:
                continue
            if not call.announced:
                call.announced = True
                function = {"name": call.name, "arguments": ""}
                out.append({"index": index, "id": call.id, "type": "function", "function": function})
            args = self._args(call)
            if len(args) > call.args_sent:
                out.append({"index": index, "function": {"arguments": args[call.args_sent :]}})
                call.args_sent = len(args)
        return out
