"""The routing text of a request: a string whose prefixes follow the prefixes of the prompt the replica will see.

The router does not render chat templates or tokenize (it has no tokenizer); it only needs a string such that
two requests whose prompts share a long head also share a long head here. So:
  * chat (``/v1/chat/completions``): the tools (JSON, keys sorted; templates put them at the start of the
    prompt), then each message as role, a unit separator, its content, a record separator;
  * Messages (``/v1/messages``) and Responses (``/v1/responses``): read as chat, the system prompt or the
    instructions as a first system message;
  * completions (``/v1/completions``): the prompt (a batch: its prompts joined by record separators);
    embeddings (``/v1/embeddings``, ``/v1/classify``): the input, the same way; scores: the query (``/rerank``)
    or the first texts (``text_1``, ``queries``, ``data_1``);
  * native ``/generate``: its ``routing_text`` where the client gives one (token ids whose text it knows: the
    DSL's ``select`` gives the text its choices continue, so that it goes where the program's other requests
    went), else ``text`` the same way, or ``input_ids`` as ``"1,2,3,"`` (each id followed by a comma, so a
    shorter id list is a prefix of a longer one that starts the same).
Anything unexpected (a malformed body the replica will refuse) gives the empty string, which matches nothing.
"""

from __future__ import annotations

import json
from typing import Any

UNIT, RECORD = "\x1f", "\x1e"


def _ids(ids: list[Any]) -> str:
    return "".join(f"{i}," for i in ids)


def _prompt(value: Any) -> str:
    """A prompt as a string: text, token ids, or a batch of either."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        if all(isinstance(v, int) for v in value):
            return _ids(value)
        return RECORD.join(_prompt(v) for v in value)
    return ""


def _content(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):  # content parts: the text parts as they are, anything else as JSON
        return "".join(
            p["text"] if isinstance(p, dict) and isinstance(p.get("text"), str) else json.dumps(p, sort_keys=True)
            for p in content
        )
    return json.dumps(content, sort_keys=True)


def chat_text(body: dict[str, Any]) -> str:
    parts: list[str] = []
    tools = body.get("tools")
    if tools:
        parts.append("tools" + UNIT + json.dumps(tools, sort_keys=True) + RECORD)
    for message in body.get("messages") or []:
        if not isinstance(message, dict):
            continue
        text = _content(message.get("content"))
        if message.get("tool_calls"):
            text += json.dumps(message["tool_calls"], sort_keys=True)
        parts.append(f"{message.get('role', '')}{UNIT}{text}{RECORD}")
    return "".join(parts)


def messages_text(body: dict[str, Any]) -> str:
    """Anthropic Messages: the system prompt as a first message, then the messages as chat's."""
    system = body.get("system")
    head = f"system{UNIT}{_content(system)}{RECORD}" if system else ""
    return head + chat_text(body)


def responses_text(body: dict[str, Any]) -> str:
    """Responses: the instructions as a system message, then the input (text, or items read as messages)."""
    items = body.get("input")
    messages: list[Any] = [{"role": "user", "content": items}] if isinstance(items, str) else list(items or [])
    if body.get("instructions"):
        messages.insert(0, {"role": "system", "content": body["instructions"]})
    return chat_text({"tools": body.get("tools"), "messages": messages})


def routing_text(path: str, body: Any) -> str:
    """The routing text of a request to ``path`` with the parsed JSON ``body`` (see the module docstring)."""
    if not isinstance(body, dict):
        return ""
    try:
        if path.endswith("/chat/completions"):
            return chat_text(body)
        if path.endswith("/messages"):
            return messages_text(body)
        if path.endswith("/responses"):
            return responses_text(body)
        if path.endswith("/completions"):
            return _prompt(body.get("prompt"))
        if path.endswith(("/embeddings", "/classify")):
            chat = body.get("messages")
            if chat is None and isinstance(body.get("input"), list) and body["input"]:
                chat = body["input"] if isinstance(body["input"][0], dict) else None  # a conversation as input
            if isinstance(chat, list) and chat and isinstance(chat[0], list):  # several: routed by the first
                chat = chat[0]
            if isinstance(chat, list) and chat and isinstance(chat[0], dict):
                return chat_text({"messages": chat})
            return _prompt(body.get("input"))
        if path.endswith("/rerank"):
            return _prompt(body.get("query"))
        if path.endswith("/score"):
            first = next((body[k] for k in ("text_1", "queries", "data_1") if body.get(k) is not None), None)
            return _prompt(first)
        if path.endswith("/generate"):
            if isinstance(body.get("routing_text"), str):  # token ids with the text they continue (the DSL's select)
                return body["routing_text"]
            if body.get("text") is not None:
                return _prompt(body["text"])
            return _prompt(body.get("input_ids"))
    except (TypeError, ValueError):  # e.g. a tool definition json cannot encode: route it anywhere
        return ""
    return ""
