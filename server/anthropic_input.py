"""Anthropic's Messages request, and its translation into the internal chat request (``ChatCompletionRequest``).

Content blocks: ``text`` everywhere; ``tool_use`` in assistant turns (the model's calls); ``tool_result`` in user
turns (each becomes a tool message, before the turn's text); ``thinking`` / ``redacted_thinking`` in assistant
turns are dropped (a template renders an earlier answer, not its thinking). Images and documents are a 400: the
server runs text-only models. ``tool_choice``: ``auto``, ``any`` (some call: "required"), ``tool`` (that one),
``none``; a forced call is one call unless ``disable_parallel_tool_use`` is explicitly false. ``thinking``
``{"type": "enabled", "budget_tokens": N}`` caps the think section of a reasoning model; ``disabled`` asks the
template to skip it (``enable_thinking=False``, which Qwen3's template reads). ``output_config.format`` (a JSON
schema) is the response format. Sampling parameters (``temperature``, ``top_p``, ``top_k``) are read when sent
(newer SDKs send them only through ``extra_body``).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field

from radixserve.server.errors import bad_request, invalid_request
from radixserve.server.protocol import ChatCompletionRequest, _NullIsDefault


class MessagesRequest(_NullIsDefault):
    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)  # Anthropic's range
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = None  # an extension, as in the chat request
    cache_salt: str | None = Field(None, min_length=1)  # vLLM's: prefixes cached per salt
    priority: int | None = None  # vLLM's, read by --schedule-policy priority
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None


class CountTokensRequest(_NullIsDefault):
    model: str | None = None
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


def _blocks(content: Any, at: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"{at}: content must be a string or a list of content blocks", at)
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise bad_request(f"{at}.{j}: a content block must be an object with a type", f"{at}.{j}")
    return content


def _text_of(blocks: list[dict[str, Any]], at: str) -> str:
    texts = []
    for j, block in enumerate(blocks):
        if block["type"] != "text" or not isinstance(block.get("text"), str):
            raise bad_request(f"{at}.{j}: only text blocks are allowed here, got {block['type']!r}", f"{at}.{j}")
        texts.append(block["text"])
    return "\n".join(texts)


def _system(system: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    if system is None:
        return []
    text = system if isinstance(system, str) else _text_of(_blocks(system, "system"), "system")
    return [{"role": "system", "content": text}] if text else []


def _text(block: dict[str, Any], at: str) -> str:
    if not isinstance(block.get("text"), str):
        raise bad_request(f"{at}.text: a text block needs a text string", f"{at}.text")
    return block["text"]


def _user(blocks: list[dict[str, Any]], at: str) -> list[dict[str, Any]]:
    if not blocks:
        raise bad_request(f"{at}: a user turn needs at least one content block", at)
    out: list[dict[str, Any]] = []
    texts = []
    for j, block in enumerate(blocks):
        kind = block["type"]
        if kind == "text":
            texts.append(_text(block, f"{at}.{j}"))
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise bad_request(f"{at}.{j}: a tool_result block needs tool_use_id", f"{at}.{j}.tool_use_id")
            result = block.get("content", "")
            text = result if isinstance(result, str) else _text_of(_blocks(result, f"{at}.{j}.content"), at)
            if block.get("is_error"):
                text = f"Error: {text}"
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        else:
            raise bad_request(
                f"{at}.{j}: content block type {kind!r} is not supported in a user turn: this server runs text-only "
                "models (send text and tool_result blocks)",
                f"{at}.{j}.type",
            )
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant(blocks: list[dict[str, Any]], at: str) -> dict[str, Any]:
    texts, calls = [], []
    for j, block in enumerate(blocks):
        kind = block["type"]
        if kind == "text":
            texts.append(_text(block, f"{at}.{j}"))
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise bad_request(f"{at}.{j}: a tool_use block needs id and name", f"{at}.{j}")
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            calls.append(
                {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}}
            )
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise bad_request(
                f"{at}.{j}: content block type {kind!r} is not supported in an assistant turn", f"{at}.{j}.type"
            )
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    return message


def chat_messages(system: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = _system(system)
    if not messages:
        raise bad_request("messages: at least one message is required", "messages")
    for i, message in enumerate(messages):
        at = f"messages.{i}"
        role = message.get("role")
        blocks = _blocks(message.get("content"), f"{at}.content")
        if role == "user":
            out += _user(blocks, f"{at}.content")
        elif role == "assistant":
            out.append(_assistant(blocks, f"{at}.content"))
        else:
            raise bad_request(f"{at}.role: must be 'user' or 'assistant', got {role!r}", f"{at}.role")
    return out


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") not in (None, "custom"):
            raise bad_request(
                f"tools.{i}.type: server tool {tool.get('type')!r} is not supported; define a custom tool with "
                "name, description and input_schema",
                f"tools.{i}.type",
            )
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
            raise bad_request(f"tools.{i}: a tool needs a name and an input_schema object", f"tools.{i}")
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if tool.get("description"):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """``(chat tool_choice, parallel_tool_calls)``."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = choice.get("disable_parallel_tool_use") is False or None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise bad_request("tool_choice.type must be auto, any, tool (with name) or none", "tool_choice")


def _thinking(thinking: dict[str, Any] | None) -> tuple[int | None, dict[str, Any] | None]:
    """``(max thinking tokens, chat_template_kwargs)``."""
    if thinking is None:
        return None, None
    kind = thinking.get("type")
    if kind == "disabled":
        return None, {"enable_thinking": False}
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise bad_request("thinking.budget_tokens must be a positive integer", "thinking.budget_tokens")
        return budget, {"enable_thinking": True}
    if kind == "adaptive":
        return None, {"enable_thinking": True}
    raise bad_request("thinking.type must be enabled, disabled or adaptive", "thinking.type")


def _response_format(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """``output_config.format`` (structured outputs) as the chat request's response_format; ``effort`` has no
    counterpart here and is ignored."""
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad_request(
            'output_config.format must be {"type": "json_schema", "schema": {<a JSON schema>}}', "output_config.format"
        )
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def chat_request(body: MessagesRequest | CountTokensRequest, stream: bool = False) -> ChatCompletionRequest:
    tool_choice, parallel = _tool_choice(body.tool_choice)
    budget, template_kwargs = _thinking(body.thinking)
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": chat_messages(body.system, body.messages),
        "tools": _tools(body.tools),
        "tool_choice": tool_choice,
        "parallel_tool_calls": parallel,
        "chat_template_kwargs": template_kwargs,
        "stream": stream,
    }
    last = fields["messages"][-1]
    if last["role"] == "assistant" and not last.get("tool_calls"):  # a prefill: the answer continues it
        at = f"messages.{len(body.messages) - 1}.content"
        if not last["content"]:  # (Anthropic allows an empty one: an answer from the turn's start)
            fields["messages"] = fields["messages"][:-1]
        elif last["content"] != last["content"].rstrip():
            raise bad_request(f"{at}: final assistant content cannot end with trailing whitespace", at)
        else:
            fields |= {"add_generation_prompt": False, "continue_final_message": True}
    if isinstance(body, MessagesRequest):
        fields |= {
            "max_completion_tokens": body.max_tokens,
            "stop": body.stop_sequences,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "seed": body.seed,
            "cache_salt": body.cache_salt,
            "priority": body.priority,
            "response_format": _response_format(body.output_config),
        }
    try:
        req = ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValueError as exc:
        raise invalid_request(exc) from None
    return req.model_copy(update={"max_thinking_tokens": budget}) if budget is not None else req
