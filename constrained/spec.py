"""What a request asks to be constrained to (``ConstraintSpec``) and the one error type of this package.

Invariants:
  * ``ConstraintSpec.key`` is a pure function of (kind, meaning of value): two specs that differ only in JSON key
    order or in how a JSON schema was spelled as text (dict vs string) have the same key, so the compiled-grammar
    cache hits across them;
  * ``validate()`` only checks the shape of ``value`` (cheap, synchronous); whether a schema, regex or grammar can
    be compiled is found out by the compiler and reported as a ``GrammarError`` on its future.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal, get_args

from radixserve.constrained.regex_check import regex_problem, schema_pattern_problem

ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "tool_or_answer", "reasoning"]
ErrorKind = Literal["invalid", "unsupported", "timeout", "too_complex", "internal"]

CONSTRAINT_KINDS: tuple[str, ...] = get_args(ConstraintKind)
# Upper bound on the text of one constraint, so a request cannot make the compiler parse megabytes.
MAX_SPEC_CHARS = 1 << 20


class GrammarError(ValueError):
    """A constraint that cannot be compiled or enforced; maps to an HTTP 400.

    ``kind`` says why: ``invalid`` (malformed schema / regex / grammar), ``unsupported`` (a JSON-schema keyword
    that cannot be enforced exactly: never silently dropped), ``timeout`` (compilation ran past the limit),
    ``too_complex`` (a backend resource limit), ``internal``. ``keyword`` and ``pointer`` (an RFC 6901 JSON
    pointer into the user's schema, ``""`` for the root) locate a JSON-schema problem when known.
    """

    def __init__(
        self,
        message: str,
        *,
        kind: ErrorKind = "invalid",
        keyword: str | None = None,
        pointer: str | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.keyword = keyword
        self.pointer = pointer

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled (across the engine process's pipe) with its kind and location, not only its message.
        return (_rebuild_grammar_error, (str(self), self.kind, self.keyword, self.pointer))

    @classmethod
    def unsupported(cls, keyword: str, pointer: str, why: str) -> GrammarError:
        where = pointer or "/"
        return cls(
            f"unsupported JSON-schema keyword {keyword!r} at {where}: {why}",
            kind="unsupported",
            keyword=keyword,
            pointer=pointer,
        )

    @classmethod
    def invalid_schema(cls, pointer: str, why: str, keyword: str | None = None) -> GrammarError:
        where = pointer or "/"
        return cls(f"invalid JSON schema at {where}: {why}", kind="invalid", keyword=keyword, pointer=pointer)


def _rebuild_grammar_error(message: str, kind: ErrorKind, keyword: str | None, pointer: str | None) -> GrammarError:
    return GrammarError(message, kind=kind, keyword=keyword, pointer=pointer)


def pointer_join(pointer: str, *tokens: str | int) -> str:
    """``pointer`` extended by reference tokens, escaped per RFC 6901 (``~`` -> ``~0``, ``/`` -> ``~1``)."""
    for tok in tokens:
        pointer += "/" + str(tok).replace("~", "~0").replace("/", "~1")
    return pointer


def canonical_json(value: Any) -> str:
    """Compact JSON with sorted keys: equal JSON values give equal text."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _parse_schema(value: Any) -> dict[str, Any] | bool:
    if isinstance(value, str | bytes):
        try:
            value = json.loads(value, parse_constant=_reject_constant)
        except ValueError as exc:
            raise GrammarError(f"json_schema is not valid JSON: {exc}") from None
    if not isinstance(value, dict | bool):
        raise GrammarError(f"json_schema must be a JSON object or boolean, got {type(value).__name__}")
    return value


# The Hermes / Qwen tool-call format, the default wrapping of a call in ``tool_or_answer``.
TOOL_CALL_TAGS = ("<tool_call>", "</tool_call>")
_TOOL_OR_ANSWER_FIELDS = {"call", "answer", "parallel", "open", "close"}


def _parse_tool_or_answer(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict) or set(value) - _TOOL_OR_ANSWER_FIELDS or "call" not in value:
        raise GrammarError(
            'tool_or_answer must be {"call": <schema>, "answer": <schema or null>, "parallel": <bool>, '
            '"open": <tag>, "close": <tag>}'
        )
    answer = value.get("answer")
    parsed = {
        "call": _parse_schema(value["call"]),
        "answer": None if answer is None else _parse_schema(answer),
        "parallel": bool(value.get("parallel", False)),
        "open": value.get("open", TOOL_CALL_TAGS[0]),
        "close": value.get("close", TOOL_CALL_TAGS[1]),
    }
    if not isinstance(parsed["open"], str) or not parsed["open"] or not isinstance(parsed["close"], str):
        raise GrammarError("tool_or_answer's open tag must be a non-empty string and its close tag a string")
    try:  # rejects values JSON cannot carry, as for json_schema
        canonical_json(parsed)
    except (TypeError, ValueError, RecursionError) as exc:
        raise GrammarError(f"tool_or_answer is not a JSON value: {exc}") from None
    return parsed


# A reasoning model's think section, as Qwen3 and the DeepSeek-R1 distills write it.
THINK_TAGS = ("<think>", "</think>")
_REASONING_FIELDS = {"inner", "open", "close", "opened", "max_tokens"}


def _parse_reasoning(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict) or set(value) - _REASONING_FIELDS:
        raise GrammarError(
            'reasoning must be {"inner": <ConstraintSpec or null>, "open": <tag>, "close": <tag>, '
            '"opened": <bool>, "max_tokens": <int or null>}'
        )
    inner = value.get("inner")
    if inner is not None and (not isinstance(inner, ConstraintSpec) or inner.kind == "reasoning"):
        raise GrammarError("reasoning's inner constraint must be a ConstraintSpec of another kind, or null")
    cap = value.get("max_tokens")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise GrammarError(f"reasoning's max_tokens must be a positive integer or null, got {cap!r}")
    parsed = {
        "inner": inner,
        "open": value.get("open", THINK_TAGS[0]),
        "close": value.get("close", THINK_TAGS[1]),
        "opened": bool(value.get("opened", False)),
        "max_tokens": cap,
    }
    if not all(isinstance(parsed[k], str) and parsed[k] for k in ("open", "close")):
        raise GrammarError("reasoning's open and close tags must be non-empty strings")
    return parsed


def tool_or_answer_parts(value: dict[str, Any]) -> list[tuple[str, dict[str, Any] | bool]]:
    """The schemas of a ``tool_or_answer`` value as ``(JSON pointer prefix, schema)``; errors inside one are
    reported under its prefix (``/call`` or ``/answer``)."""
    parts: list[tuple[str, dict[str, Any] | bool]] = [("/call", value["call"])]
    return parts + [("/answer", value["answer"])] if value["answer"] is not None else parts


@dataclass(frozen=True)
class ConstraintSpec:
    """One constraint: ``kind`` and its ``value``.

    * ``json_schema``: a schema as a dict, bool, or JSON text (parsed here);
    * ``json_object``: any JSON object; ``value`` is ignored (use None);
    * ``regex``: the pattern text (Rust ``regex`` syntax, matched against the whole output);
    * ``choice``: a non-empty sequence of non-empty strings; the output is exactly one of them;
    * ``grammar``: a context-free grammar in Lark syntax (llguidance dialect) or GBNF/EBNF;
    * ``tool_or_answer``: ``{"call": <schema of one call object>, "answer": <schema, or None for any JSON object>,
      "parallel": <bool>, "open": <tag>, "close": <tag>}``; the output is either an answer (compact JSON) or tool
      calls, each written ``<open>{call}<close>`` (one, or with ``parallel`` one or more separated by newlines;
      the tags default to ``TOOL_CALL_TAGS``). It is what a chat request with tools, ``tool_choice`` "auto" and a
      ``response_format`` means: the model may call a tool or answer in the requested format.
    """

    kind: ConstraintKind
    value: Any = field(default=None)

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise GrammarError(f"unknown constraint kind {self.kind!r}; expected one of {', '.join(CONSTRAINT_KINDS)}")
        if self.kind == "json_schema":
            object.__setattr__(self, "value", _parse_schema(self.value))
            try:  # primes ``key`` and rejects values JSON cannot carry (NaN, sets, objects)
                object.__setattr__(self, "key", f"json_schema:{canonical_json(self.value)}")
            except (TypeError, ValueError, RecursionError) as exc:
                raise GrammarError(f"json_schema is not a JSON value: {exc}") from None
        elif self.kind == "choice" and isinstance(self.value, Sequence) and not isinstance(self.value, str):
            object.__setattr__(self, "value", tuple(self.value))
        elif self.kind == "tool_or_answer":
            object.__setattr__(self, "value", _parse_tool_or_answer(self.value))
            object.__setattr__(self, "key", f"tool_or_answer:{canonical_json(self.value)}")
        elif self.kind == "reasoning":
            object.__setattr__(self, "value", _parse_reasoning(self.value))
            inner = self.value["inner"]
            meta = {**self.value, "inner": inner.key if inner is not None else None}
            object.__setattr__(self, "key", f"reasoning:{canonical_json(meta)}")

    def validate(self) -> None:
        """Raise ``GrammarError`` when ``value`` does not have the shape ``kind`` needs (no compilation)."""
        if self.kind == "reasoning":
            if self.value["inner"] is not None:
                self.value["inner"].validate()
            return
        if self.kind in ("regex", "grammar"):
            if not isinstance(self.value, str) or not self.value.strip():
                raise GrammarError(f"{self.kind} must be a non-empty string")
        elif self.kind == "choice":
            if not isinstance(self.value, tuple) or not self.value:
                raise GrammarError("choice must be a non-empty list of strings")
            for i, item in enumerate(self.value):
                if not isinstance(item, str) or not item:
                    raise GrammarError(f"choice[{i}] must be a non-empty string, got {item!r}")
        if len(self.key) > MAX_SPEC_CHARS:
            raise GrammarError(f"{self.kind} is {len(self.key)} characters long; the limit is {MAX_SPEC_CHARS}")
        # Regexes that unroll into huge lexers are refused here, before they cost a compile worker any time.
        found: tuple[str | None, str] | None = None
        if self.kind == "regex":
            problem = regex_problem(self.value)
            found = (None, problem) if problem else None
        elif self.kind == "json_schema":
            found = schema_pattern_problem(self.value)
        elif self.kind == "tool_or_answer":
            parts = tool_or_answer_parts(self.value)
            found = next(filter(None, (schema_pattern_problem(s, at) for at, s in parts)), None)
        if found is not None:
            raise GrammarError(found[1], kind="too_complex", pointer=found[0])

    @cached_property
    def key(self) -> str:
        """Canonical text of this spec, the compiled-grammar cache key."""
        if self.kind in ("json_schema", "tool_or_answer"):
            body = canonical_json(self.value)
        elif self.kind == "json_object":
            body = ""
        elif self.kind == "choice":
            body = json.dumps(list(self.value) if isinstance(self.value, tuple) else self.value, ensure_ascii=False)
        else:
            body = self.value if isinstance(self.value, str) else repr(self.value)
        return f"{self.kind}:{body}"
