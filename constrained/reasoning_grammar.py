"""The grammar of a ``reasoning`` constraint: a think section of free text, then the answer's own grammar.

A reasoning model (Qwen3, the DeepSeek-R1 distills) writes ``<think>...</think>`` before its answer. A schema
applied from the first token would forbid the section (or make the model write JSON where it meant to think), so
the constraint starts only once the section closes. Shape of the grammar (llguidance's Lark dialect):

    start: OPEN think CLOSE SEP? answer      # ("OPEN" left out when the prompt already opened the section;
    think[stop=CLOSE, max_tokens=N]: /.*/    #  optional, with what follows it, when the model may skip it)
    answer: @answer                          # the inner constraint's grammar, as a named sub-grammar

Invariants: the think text never contains the close tag (``stop`` ends the lexeme at it, and the rule after it
writes it once); at ``max_tokens`` tokens the lexeme ends and the close tag is forced, so a cap always closes the
section rather than cutting into the answer; the inner grammar is the one a request without reasoning gets, so
nothing about the answer is weakened. Inner errors keep the inner constraint's pointers (``answer_spec``).
"""

from __future__ import annotations

import json
from typing import Any

from radixserve.constrained.spec import ConstraintSpec

# Whitespace models write between the close tag and a structured answer ("</think>\n\n{...}").
_SEPARATOR = r"/[ \t\r\n]{1,4}/"


def answer_spec(spec: ConstraintSpec) -> ConstraintSpec:
    """The constraint that decides the answer: ``spec`` itself, or the inner one of a ``reasoning`` spec."""
    if spec.kind == "reasoning" and spec.value["inner"] is not None:
        return spec.value["inner"]
    return spec


def _literal(text: str) -> str:
    """``text`` as a regex matching it literally (llguidance's dialect, inside ``/.../``)."""
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}/-" else c for c in text)


def _not_starting_with(tag: str) -> str:
    """A regex (llguidance's dialect, inside ``/.../``) of the texts that, after any leading whitespace, do not
    begin with ``tag``: nothing more, a proper prefix of it, or its first ``i`` characters and then another."""
    alts = [""] + [_literal(tag[:i]) for i in range(1, len(tag))]
    for i, ch in enumerate(tag):
        other = ("\\" + ch if ch in r"\]^-/[" else ch) + ("\\s" if i == 0 else "")
        alts.append(f"{_literal(tag[:i])}[^{other}](?s:.*)")
    return "\\s*(?:" + "|".join(alts) + ")"


def reasoning_grammar(value: dict[str, Any], answer: str | None, close_is_one_token: bool = True) -> str:
    """The llguidance grammar (TopLevelGrammar JSON text) of a ``reasoning`` value whose inner constraint compiled
    to ``answer`` (llguidance grammar JSON), or None for a free-text answer.

    ``close_is_one_token``: whether the vocabulary spells the close tag as one token, as reasoning models' do. A
    ``stop`` lexeme hides its stop text, which a matcher fed token by token accepts only when that text is one
    token: a close tag of several tokens would be refused at its last one, and the section never closed. Without
    a cap such a tag ends a lazy lexeme that includes it instead (the section ends at the first close tag). With a
    cap the ``stop`` form stays, as only it can force the tag at the cap: the section then ends at the cap."""
    open_tag, close_tag = json.dumps(value["open"]), json.dumps(value["close"])
    options = [f"stop={close_tag}"]
    if value["max_tokens"] is not None:
        options.append(f"max_tokens={value['max_tokens']}")
    section = f"think {close_tag}" if value["opened"] else f"{open_tag} think {close_tag}"
    think = f"think[{', '.join(options)}]: /(?s:.*)/"
    if not close_is_one_token and value["max_tokens"] is None:
        section = "think" if value["opened"] else f"{open_tag} think"
        think = f"think[lazy]: /(?s:.*){_literal(value['close'])}/"
    if answer is None:
        body, rest = "ANSWER", ["ANSWER: /(?s:.*)/"]
        sub: list[dict[str, Any]] = []
    else:
        body, rest = "SEP? answer", [f"SEP: {_SEPARATOR}", "answer: @answer"]
        sub = json.loads(answer)["grammars"]
        sub[0] = {**sub[0], "name": "answer"}
    start = f"start: {section} {body}" if value["opened"] else f"start: ({section})? {body}"
    if answer is None and not value["opened"] and value["max_tokens"] is not None:
        # A free answer would also match a section the model opens itself, and outlive the cap: the answer
        # without a section is text that does not start with the open tag.
        start = f"start: {section} {body} | PLAIN"
        rest.append(f"PLAIN: /{_not_starting_with(value['open'])}/")
    lark = "\n".join([start, think, *rest, ""])
    return json.dumps({"grammars": [{"lark_grammar": lark}, *sub]})
