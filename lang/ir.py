"""What a program appends to a state: text, ``gen``, ``select`` and role blocks, as plain immutable values.

Expressions compose with ``+`` (``"Q: " + gen("a")`` is a ``Seq``) and are flattened into *atoms* (``str``,
``Gen``, ``Select``, ``RoleBegin``, ``RoleEnd``) that a state executes one by one, in order. Constructing an
expression never talks to a backend; only appending it to a state does.

Sampling parameters are stored under the names the server's ``/generate`` ``sampling_params`` uses
(``max_new_tokens``, ``min_new_tokens``, ...); the user-facing aliases ``max_tokens``/``min_tokens`` are accepted.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

ROLES = ("system", "user", "assistant")
SelectMethod = Literal["normalized", "greedy", "unconditional"]
SELECT_METHODS: tuple[str, ...] = ("normalized", "greedy", "unconditional")

# User-facing sampling keyword -> the server's sampling_params key.
SAMPLING_KEYS: dict[str, str] = {
    "max_tokens": "max_new_tokens",
    "max_new_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "min_new_tokens": "min_new_tokens",
    **{
        k: k
        for k in (
            "stop",
            "stop_token_ids",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
            "seed",
            "ignore_eos",
            "include_stop_str_in_output",
            "allowed_token_ids",
            "cache_salt",
            "priority",
        )
    },
}


def sampling_dict(values: dict[str, Any]) -> dict[str, Any]:
    """Map user keywords to server keys, dropping ``None`` (= "not set here"); unknown keys are a ``TypeError``."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key not in SAMPLING_KEYS:
            raise TypeError(f"unknown sampling parameter {key!r}; known: {', '.join(sorted(SAMPLING_KEYS))}")
        if value is None:
            continue
        if key == "stop" and isinstance(value, str):
            value = [value]
        out[SAMPLING_KEYS[key]] = list(value) if isinstance(value, (list, tuple)) else value
    return out


class _Node:
    """Base of expression nodes: ``a + b`` concatenates (with strings on either side)."""

    def __add__(self, other: Expr) -> Seq:
        return Seq((self, other))  # type: ignore[arg-type]

    def __radd__(self, other: Expr) -> Seq:
        return Seq((other, self))  # type: ignore[arg-type]


@dataclass(frozen=True)
class Gen(_Node):
    """Generate text at the end of the state; stored in the state under ``name`` (if given).

    ``sampling`` holds only the parameters set on this call, under server keys; the run's defaults fill the rest.
    """

    name: str | None
    sampling: dict[str, Any]
    return_logprob: bool = False
    top_logprobs_num: int = 0


@dataclass(frozen=True)
class Select(_Node):
    """Append the choice the model scores highest (see ``lang.scoring``); stored under ``name``."""

    name: str | None
    choices: tuple[str, ...]
    method: str = "normalized"


@dataclass(frozen=True)
class Seq(_Node):
    parts: tuple[Expr, ...]


@dataclass(frozen=True)
class Role(_Node):
    """A whole role turn: the role's opening marker, ``parts``, the closing marker."""

    role: str
    parts: tuple[Expr, ...]


@dataclass(frozen=True)
class RoleBegin:
    role: str


@dataclass(frozen=True)
class RoleEnd:
    role: str


Expr = str | Gen | Select | Seq | Role | RoleBegin | RoleEnd
Atom = str | Gen | Select | RoleBegin | RoleEnd


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    stop: str | Sequence[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    regex: str | None = None,
    json_schema: str | dict[str, Any] | type | None = None,
    choices: Sequence[str] | None = None,
    *,
    choices_method: SelectMethod = "normalized",
    return_logprob: bool = False,
    top_logprobs_num: int = 0,
    **sampling: Any,
) -> Gen | Select:
    """Generate into variable ``name``. With ``choices`` this is ``select(name, choices)``.

    ``regex`` and ``json_schema`` (a JSON-schema dict or string, or a pydantic model class) are passed to the
    server's ``sampling_params`` as is; the server decides whether it can honour them. Other keyword arguments are
    further sampling parameters (``min_tokens``, ``seed``, ``ignore_eos``, ``stop_token_ids``, penalties).
    """
    named = {"max_tokens": max_tokens, "stop": stop, "temperature": temperature, "top_p": top_p, "top_k": top_k}
    params = sampling_dict({**named, "min_p": min_p, **sampling})  # a misspelt name is a TypeError here
    if choices is not None:
        if regex is not None or json_schema is not None:
            raise ValueError("gen: give at most one of choices, regex and json_schema")
        return select(name, choices, method=choices_method)  # (scored: sampling parameters have no effect)
    if regex is not None and json_schema is not None:
        raise ValueError("gen: give at most one of regex and json_schema")
    if regex is not None:
        params["regex"] = regex
    if json_schema is not None:
        params["json_schema"] = _schema_text(json_schema)
    return Gen(name, params, return_logprob, top_logprobs_num)


def _schema_text(schema: str | dict[str, Any] | type) -> str:
    """A JSON schema as the JSON text servers take (SGLang's convention)."""
    if isinstance(schema, str):
        return schema
    if isinstance(schema, dict):
        return json.dumps(schema)
    to_schema = getattr(schema, "model_json_schema", None)
    if to_schema is None:
        raise TypeError(f"json_schema must be a dict, a JSON string or a pydantic model class, got {schema!r}")
    return json.dumps(to_schema())


def select(name: str | None, choices: Sequence[str], method: SelectMethod = "normalized") -> Select:
    """Pick one of ``choices`` by the model's log-probabilities of their tokens after the current text.

    ``method``: ``"normalized"`` (mean log-probability per token, the default), ``"greedy"`` (highest
    first-token log-probability, ties broken by the next tokens) or ``"unconditional"`` (mean log-probability
    minus the mean the choice gets without the prompt's content, which corrects for choices that are likely
    anywhere).
    """
    if isinstance(choices, str):
        raise TypeError("select: choices must be a list of strings, not one string")
    texts = tuple(choices)
    if not texts or any(not isinstance(c, str) or not c for c in texts):
        raise ValueError("select: choices must be a non-empty list of non-empty strings")
    if method not in SELECT_METHODS:
        raise ValueError(f"select: method must be one of {', '.join(SELECT_METHODS)}, got {method!r}")
    return Select(name, texts, method)


def system(*content: Expr) -> Role:
    """A system turn around ``content`` (text and/or expressions)."""
    return Role("system", content)


def user(*content: Expr) -> Role:
    """A user turn around ``content``."""
    return Role("user", content)


def assistant(*content: Expr) -> Role:
    """An assistant turn around ``content``, typically ``assistant(gen("answer"))``."""
    return Role("assistant", content)


def flatten(expr: Expr) -> list[Atom]:
    """The atoms of ``expr`` in execution order."""
    if isinstance(expr, (str, Gen, Select, RoleBegin, RoleEnd)):
        return [expr]
    if isinstance(expr, Seq):
        return [atom for part in expr.parts for atom in flatten(part)]
    if isinstance(expr, Role):
        return [RoleBegin(expr.role), *(a for part in expr.parts for a in flatten(part)), RoleEnd(expr.role)]
    raise TypeError(f"cannot append {type(expr).__name__} to a program state; append str, gen, select or roles")
