"""The grammar of a ``tool_or_answer`` constraint: an answer in JSON, or tool calls wrapped in tags.

Agents send tools and a typed final output together on every turn (``tool_choice`` "auto" plus a
``response_format``). Constraining the whole output to the answer's schema would take the tools away; leaving it
free would give up the answer's schema. The union keeps both: the output is either the answer's JSON or one (with
``parallel``, one or more) ``<open>{call}<close>`` blocks whose JSON is a call object.

Invariants: both schemas go through the same rewrite as a plain ``json_schema`` constraint, so nothing is weakened
that a ``json_schema`` request would refuse; an error inside one is reported under its pointer prefix (``/call``
or ``/answer``, see ``tool_or_answer_parts``). JSON text cannot start with ``<``, so the two alternatives differ
from the first byte and the grammar is unambiguous.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from radixserve.constrained.spec import GrammarError, tool_or_answer_parts

Rewrite = Callable[[Any], Any]


def under(exc: GrammarError, prefix: str) -> GrammarError:
    """``exc`` re-pointed from inside one part's schema to the whole value (pointer and message)."""
    if exc.pointer is None:  # somewhere in that part: the part itself is the place to report
        return GrammarError(str(exc), kind=exc.kind, keyword=exc.keyword, pointer=prefix)
    pointer = prefix + exc.pointer
    message = str(exc).replace(f" at {exc.pointer or '/'}", f" at {pointer}", 1)
    return GrammarError(message, kind=exc.kind, keyword=exc.keyword, pointer=pointer)


def _embedded(schema: Any, options: dict[str, Any], prefix: str) -> str:
    """``%json`` body: the rewritten schema with the backend's JSON options (separators, whitespace)."""
    if schema is False:
        raise GrammarError.invalid_schema(prefix, "the schema is false, so no output could satisfy it")
    body = {} if schema is True else dict(schema)
    body["x-guidance"] = options
    return json.dumps(body, ensure_ascii=False)


def tool_or_answer_lark(value: dict[str, Any], rewrite: Rewrite, options: dict[str, Any]) -> str:
    """The Lark text (llguidance dialect) for a ``tool_or_answer`` value; raises ``GrammarError``."""
    prepared: dict[str, Any] = {"/answer": {"type": "object"}}
    for prefix, schema in tool_or_answer_parts(value):
        try:
            prepared[prefix] = rewrite(schema)
        except GrammarError as exc:
            raise under(exc, prefix) from None
    repeat = ' ("\\n" call_block)*' if value["parallel"] else ""
    return "\n".join(
        [
            "start: answer | calls",
            f"calls: call_block{repeat}",
            f"call_block: {json.dumps(value['open'])} call {json.dumps(value['close']) if value['close'] else ''}",
            f"call: %json {_embedded(prepared['/call'], options, '/call')}",
            f"answer: %json {_embedded(prepared['/answer'], options, '/answer')}",
            "",
        ]
    )
