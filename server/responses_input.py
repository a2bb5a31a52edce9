"""The Responses API's request, and its translation into the internal chat request (``ChatCompletionRequest``).

``input`` is text (one user message) or items: messages (``input_text`` / ``output_text`` parts), the model's
earlier ``function_call`` items and the client's ``function_call_output`` items; ``reasoning`` items are dropped
(a template renders an earlier turn's answer, not its thinking, as vLLM does). Tools are flat function
definitions; ``text.format`` is the response format. Fields of the chat request are named as the client sent
them in errors (``renamed_error``): ``input``, ``max_output_tokens``, ``text.format``, ``tools[i].parameters``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import Field

from radixserve.runtime.sampling_params import MAX_TOP_LOGPROBS
from radixserve.server.errors import APIError, bad_request, invalid_request
from radixserve.server.protocol import ChatCompletionRequest, _NullIsDefault

TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
LOGPROBS = "message.output_text.logprobs"  # the ``include`` value that asks for the answer's logprobs
ROLES = ("user", "assistant", "system", "developer")
# Fields refused because they would change what is served, with what to do instead.
UNSUPPORTED = {
    "conversation": "conversation objects are not served; continue with previous_response_id",
    "prompt": "stored prompt templates are not served; send instructions and input",
}


class ResponsesRequest(_NullIsDefault):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    include: list[str] | None = None
    metadata: dict[str, Any] | None = None
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # Extensions shared with the chat request.
    seed: int | None = None
    stop: str | list[str] | None = None
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_thinking_tokens: int | None = Field(None, ge=1)
    cache_salt: str | None = Field(None, min_length=1)  # vLLM's: prefixes cached per salt
    priority: int | None = None  # vLLM's, read by --schedule-policy priority


def _text(content: Any, at: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("content must be a string or a list of content parts", at)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise bad_request(
                f"content part type {kind!r} is not supported: this server serves text-only models; "
                "send input_text parts",
                f"{at}[{j}].type",
            )
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise bad_request(f"a {kind} part needs its text", f"{at}[{j}]")
        texts.append(text)
    return "\n".join(texts)


def _arguments(item: dict[str, Any], at: str) -> str:
    args = item.get("arguments", "{}")
    if isinstance(args, dict):
        return json.dumps(args, ensure_ascii=False)
    if not isinstance(args, str):
        raise bad_request("a function_call's arguments must be a JSON string", f"{at}.arguments")
    return args


def input_messages(raw: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages (plain dicts in ``ChatMessage`` form) of a Responses ``input``."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        at = f"input[{i}]"
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad_request(f"unknown role {role!r}; expected one of {', '.join(ROLES)}", f"{at}.role")
            out.append({"role": role, "content": _text(item.get("content"), f"{at}.content")})
        elif kind == "function_call":
            name, call_id = item.get("name"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(call_id, str):
                raise bad_request("a function_call item needs name and call_id", at)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": _arguments(item, at)}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # calls of one turn belong to its message
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise bad_request("a function_call_output item needs the call_id of its call", f"{at}.call_id")
            output = item.get("output", "")
            content = output if isinstance(output, str) else _text(output, f"{at}.output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": content})
        elif kind == "reasoning":
            continue
        else:
            raise bad_request(
                f"input item type {kind!r} is not supported; send message, function_call or function_call_output items",
                f"{at}.type",
            )
    return out


def _tools(raw: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    tools = []
    for i, tool in enumerate(raw):
        if tool.get("type") != "function":
            raise bad_request(
                f"tool type {tool.get('type')!r} is not supported: this server runs function tools only",
                f"tools[{i}].type",
            )
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(raw: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if raw is None or isinstance(raw, str):
        return raw
    if raw.get("type") == "function" and isinstance(raw.get("name"), str):
        return {"type": "function", "function": {"name": raw["name"]}}
    raise bad_request(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}', "tool_choice"
    )


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request('text.format of type json_schema needs "schema": {<a JSON schema>}', "text.format")
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise bad_request(
        f"text.format type {kind!r} is not supported; use text, json_object or json_schema", "text.format"
    )


def chat_request(body: ResponsesRequest, history: list[dict[str, Any]]) -> tuple[ChatCompletionRequest, list[dict]]:
    """``(the chat request, the conversation without instructions)``: ``history`` (a previous response's
    conversation) then ``input``."""
    for name, why in UNSUPPORTED.items():
        if (body.model_extra or {}).get(name) not in (None, False):
            raise APIError(400, f"{name} is not supported by this server ({why})", param=name, code="unsupported")
    if body.truncation not in (None, "disabled"):
        raise bad_request("only truncation 'disabled' is served: shorten the input instead", "truncation")
    conversation = [*history, *input_messages(body.input)]
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "tools": _tools(body.tools),
        "tool_choice": _tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body.text),
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "seed": body.seed,
        "stop": body.stop,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty,
        "max_thinking_tokens": body.max_thinking_tokens,
        "cache_salt": body.cache_salt,
        "priority": body.priority,
        "logprobs": LOGPROBS in (body.include or []) or bool(body.top_logprobs),
        "top_logprobs": body.top_logprobs,
    }
    try:
        req = ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValueError as exc:
        raise invalid_request(exc) from None
    return req, conversation


_RENAMES = [
    (re.compile(r"^messages\b"), "input"),
    (re.compile(r"^max_completion_tokens\b|^max_tokens\b"), "max_output_tokens"),
    (re.compile(r"^response_format\b"), "text.format"),
    (re.compile(r"^tools\[(\d+)\]\.function\."), r"tools[\1]."),
]


def renamed_error(exc: APIError) -> APIError:
    """``exc`` with the chat request's field names turned into the Responses API's."""
    param = exc.param
    if param is None:
        return exc
    for pattern, repl in _RENAMES:
        new = pattern.sub(repl, param)
        if new != param:
            exc.message = exc.message.replace(param, new)
            exc.param = new
            break
    return exc
