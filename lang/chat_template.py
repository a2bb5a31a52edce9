"""Role markers of the served model, read off its own chat template.

A program writes roles (``system``/``user``/``assistant``), never a model's markers. The backend renders a few
probe conversations through the model's chat template and ``derive_markers`` splits the renderings around the
probe contents, giving for each role the text before and after a message's content. A state then writes
``prefix + content + suffix`` per turn, so the text it sends is what the template renders for the same messages
(exactly, for templates that render each turn independently of the others: ChatML, Llama 3, Qwen, SmolLM, ...).

Invariants of a ``RoleMarkers`` (checked when derived, else ``ChatTemplateError``):
  * ``start + prefix["user"] + c + suffix["user"]`` is the rendering of a lone user message with content ``c``;
  * ``prefix["system"] + s + suffix["system"] + <user turn>`` is the rendering of a system then a user message;
  * a later user or assistant turn adds exactly ``prefix[role] + content + suffix[role]``;
  * ``prefix["assistant"]`` is the generation prompt (what the template appends to ask for an answer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixserve.lang.errors import ChatTemplateError

Render = Callable[[list[dict[str, Any]], bool], str]  # (messages, add_generation_prompt) -> prompt text

# Probe contents: plain words that no template rewrites (no surrounding whitespace for ``| trim`` to eat).
_SYS, _U1, _A1, _U2, _A2 = "SysProbeQ7", "UserProbeK2", "AsstProbeZ5", "UserProbeM8", "AsstProbeW3"


@dataclass(frozen=True)
class RoleMarkers:
    prefix: dict[str, str]
    suffix: dict[str, str]
    start: str  # written before the first turn when it is not a system turn (e.g. a default system prompt)
    has_system: bool

    def begin(self, role: str, first: bool) -> str:
        """Text that opens a ``role`` turn; ``first`` when no turn was written before it in this state."""
        if role == "system" and not self.has_system:
            raise ChatTemplateError("this model's chat template has no separate system turn; put it in a user turn")
        return (self.start if first and role != "system" else "") + self.prefix[role]

    def end(self, role: str) -> str:
        return self.suffix[role]


def _msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def _split(segment: str, content: str, what: str) -> tuple[str, str]:
    at = segment.find(content)
    if at < 0:
        raise ChatTemplateError(f"the chat template does not render the {what} content verbatim: {segment!r}")
    return segment[:at], segment[at + len(content) :]


def _tail(longer: str, shorter: str, what: str) -> str:
    if not longer.startswith(shorter):
        raise ChatTemplateError(
            f"the chat template re-renders earlier turns when a {what} turn is added, so turns cannot be written "
            "one after another"
        )
    return longer[len(shorter) :]


def derive_markers(render: Render) -> RoleMarkers:
    """Role markers from ``render``; see the module docstring for what is guaranteed."""
    u1, a1, u2, a2 = _msg("user", _U1), _msg("assistant", _A1), _msg("user", _U2), _msg("assistant", _A2)
    base = render([u1, a1], False)
    with_user = render([u1, a1, u2], False)
    user_pre, user_suf = _split(_tail(with_user, base, "user"), _U2, "user")
    with_answer = render([u1, a1, u2, a2], False)
    _, asst_suf = _split(_tail(with_answer, with_user, "assistant"), _A2, "assistant")
    gen_prompt = _tail(render([u1, a1, u2], True), with_user, "generation prompt")
    first_turn = user_pre + _U1 + user_suf
    lone = render([u1], False)
    if not lone.endswith(first_turn):
        raise ChatTemplateError(f"the chat template renders a first user turn unlike later ones: {lone!r}")
    prefix = {"user": user_pre, "assistant": gen_prompt}
    suffix = {"user": user_suf, "assistant": asst_suf}
    has_system = True
    try:
        with_system = render([_msg("system", _SYS), u1], False)
    except Exception:  # noqa: BLE001 - templates that refuse a system role raise their own exception type
        has_system = False
    if has_system and with_system.endswith(first_turn):
        prefix["system"], suffix["system"] = _split(with_system[: -len(first_turn)], _SYS, "system")
    else:
        has_system = False
    return RoleMarkers(prefix, suffix, lone[: -len(first_turn)], has_system)
