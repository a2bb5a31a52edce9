"""Chat messages -> prompt text, through the model's (or the operator's) Jinja chat template.

Roles served: system, developer (rendered as system, which every template knows), user, assistant, tool.
Content is a string or a list of ``{"type": "text"}`` parts (joined with newlines). Tools are handed to the
template as ``tools=``; a template that ignores them (no ``tools`` in its source) gets them described in a
system message instead, in the ``<tool_call>`` format that ``server.tool_parser`` reads back.
"""

from __future__ import annotations

import json
from typing import Any

from radixserve.server.errors import bad_request
from radixserve.server.protocol import ChatCompletionRequest, ChatMessage

ROLES = ("system", "developer", "user", "assistant", "tool")
TEXT_PART_TYPES = ("text", "input_text")
# Keys the server passes to the template itself; chat_template_kwargs must not override them.
RESERVED_TEMPLATE_KWARGS = {
    "conversation",
    "messages",
    "tools",
    "tokenize",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
}

TOOLS_SYSTEM_PROMPT = (
    "You may call one or more of the functions below to help with the user's request. To call a function, "
    'reply with <tool_call>{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}</tool_call> '
    "(one block per call) and nothing else. If no function is needed, answer normally.\n\n"
    "Functions:\n{functions}"
)


def content_text(msg: ChatMessage, i: int) -> str | None:
    if msg.content is None or isinstance(msg.content, str):
        return msg.content
    texts = []
    for j, part in enumerate(msg.content):
        if part.type not in TEXT_PART_TYPES:
            raise bad_request(
                f"content part type {part.type!r} is not supported: this server serves text-only models; "
                "send {'type': 'text', 'text': ...} parts",
                f"messages[{i}].content[{j}].type",
            )
        if part.text is None:
            raise bad_request("a text content part needs 'text'", f"messages[{i}].content[{j}].text")
        texts.append(part.text)
    return "\n".join(texts)


def _arguments(raw: str | dict[str, Any]) -> Any:
    """Templates (Qwen, Hermes, Llama) serialize ``arguments`` themselves, so they expect a dict."""
    if isinstance(raw, dict):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def normalize_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Validate the conversation and turn it into the plain dicts chat templates read."""
    if not messages:
        raise bad_request("messages must contain at least one message", "messages")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if msg.role not in ROLES:
            raise bad_request(
                f"unknown role {msg.role!r} in messages[{i}]; expected one of {', '.join(ROLES)}",
                f"messages[{i}].role",
            )
        content = content_text(msg, i)
        if content is None and msg.role != "assistant":
            raise bad_request(f"messages[{i}] (role {msg.role}) needs content", f"messages[{i}].content")
        if msg.role == "tool" and not msg.tool_call_id:
            raise bad_request(
                f"messages[{i}] has role 'tool' but no tool_call_id; give the id of the call it answers",
                f"messages[{i}].tool_call_id",
            )
        entry: dict[str, Any] = {"role": "system" if msg.role == "developer" else msg.role, "content": content or ""}
        if msg.name:
            entry["name"] = msg.name
        if msg.role == "tool":
            entry["tool_call_id"] = msg.tool_call_id
        if msg.role == "assistant" and msg.tool_calls:
            entry["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)},
                }
                for call in msg.tool_calls
            ]
        out.append(entry)
    return out


def _template_source(tokenizer: Any, override: str | None) -> str:
    if override:
        return override
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates; HF picks "tool_use" when tools are given
        template = template.get("tool_use") or template.get("default") or ""
    return template or ""


def _inline_tool_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation for a template that cannot render tool calls (it never reads ``tool_calls``): each tool
    result names the call it answers (``get_weather({"city": "Paris"}) returned: ...``), so the model sees what was
    called. (Writing the calls into the assistant turns instead, as ``<tool_call>`` blocks, made a small model
    repeat the call in a loop rather than answer: tests/test_agent_frameworks.py.)"""
    calls = {
        c.get("id"): c["function"] for m in messages if m["role"] == "assistant" for c in m.get("tool_calls") or []
    }
    out: list[dict[str, Any]] = []
    for msg in messages:
        call = calls.get(msg.get("tool_call_id")) if msg["role"] == "tool" else None
        if call is not None:
            arguments = json.dumps(call["arguments"], ensure_ascii=False)
            msg = dict(msg, content=f"{call['name']}({arguments}) returned:\n{msg['content']}")
        out.append(msg)
    return out


def _with_tools_system_message(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    functions = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    instructions = TOOLS_SYSTEM_PROMPT.format(functions=functions)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{instructions}")
        return [first, *messages[1:]]
    return [{"role": "system", "content": instructions}, *messages]


def _check_continuation(req: ChatCompletionRequest, messages: list[dict[str, Any]]) -> None:
    """A prefill to continue (``continue_final_message``) is the last message, the assistant's, and the prompt
    then ends inside that turn: no assistant header after it (vLLM's rule)."""
    if not req.continue_final_message:
        return
    if req.add_generation_prompt:
        raise bad_request(
            "continue_final_message continues the last message: send add_generation_prompt false with it",
            "add_generation_prompt",
        )
    if messages[-1]["role"] != "assistant" or not messages[-1]["content"]:
        raise bad_request(
            "continue_final_message needs the last message to be an assistant message with content to continue",
            "messages",
        )


def render_chat(tokenizer: Any, req: ChatCompletionRequest, template_override: str | None) -> tuple[str, bool]:
    """The prompt text for ``req`` and whether tool calls should be parsed from the answer.

    Tools are offered to the model unless ``tool_choice`` is "none" (the model is then to answer in prose).
    """
    messages = normalize_messages(req.messages)
    choice = req.tool_choice
    offer_tools = bool(req.tools) and choice != "none"
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if offer_tools and req.tools else None
    kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k not in RESERVED_TEMPLATE_KWARGS}
    source = _template_source(tokenizer, template_override)
    if "tool_calls" not in source:
        messages = _inline_tool_turns(messages)
    if tools and "tools" not in source:
        messages, tools = _with_tools_system_message(messages, tools), None
    _check_continuation(req, messages)

    def render(msgs: list[dict[str, Any]]) -> str:
        return tokenizer.apply_chat_template(
            msgs,
            tools=tools,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            tokenize=False,
            chat_template=template_override or None,
            **kwargs,
        )

    try:
        text = render(messages)
    except Exception as exc:  # noqa: BLE001 - Jinja errors (incl. a template's raise_exception) are the client's
        if not source:
            raise bad_request(
                "this model has no chat template; use /v1/completions or start the server with --chat-template",
                "messages",
            ) from None
        folded = _system_folded_into_user(messages)
        try:  # templates without a system role (Gemma 2) refuse it: its text goes to the first user turn instead
            text = render(folded) if folded is not None else None
        except Exception:  # noqa: BLE001 - the first error is the one to report
            text = None
        if text is None:
            raise bad_request(f"the chat template could not render these messages: {exc}", "messages") from None
    return text, offer_tools


def _system_folded_into_user(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The leading system messages' text put before the first user message's (what Gemma's own templates do where
    they take a system prompt at all), or None when there is no leading system message or no user message after."""
    n = 0
    while n < len(messages) and messages[n]["role"] == "system":
        n += 1
    if n == 0 or n == len(messages) or messages[n]["role"] != "user":
        return None
    system = "\n\n".join(m["content"] for m in messages[:n] if m["content"])
    first = dict(messages[n], content=f"{system}\n\n{messages[n]['content']}" if system else messages[n]["content"])
    return [first, *messages[n + 1 :]]
