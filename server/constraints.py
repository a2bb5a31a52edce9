"""Grammar constraints of a request: the field that asked for one, the ``ConstraintSpec`` it means, and its
compilation before the request is submitted, so that a bad schema, regex or grammar is a 400 naming that field.

Fields (OpenAI chat and completions bodies, and /generate ``sampling_params``):
  * ``json_schema`` (a schema object or its JSON text), ``regex`` (matched against the whole output), ``ebnf`` or
    ``grammar`` (Lark or GBNF/EBNF text), ``choices`` (a list of strings: the output is exactly one of them);
  * chat ``response_format``: ``{"type": "json_object"}`` is any JSON object; ``{"type": "json_schema",
    "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`` is that schema, enforced whatever ``strict``
    says (a grammar either enforces a schema or refuses it, never half of it);
  * a forced tool call (chat ``tool_choice`` "required" or a named function, see ``server.tool_calls``);
  * vLLM's spellings: ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``, and
    ``structured_outputs`` with ``json``, ``regex``, ``choice``, ``grammar`` or ``json_object``.

Invariants:
  * a request carries at most one constraint; two are a 400 naming both fields;
  * ``compile_constraints`` returns only once every grammar is compiled and in the engine's compile cache, so the
    engine's own compile at submit is an instant hit; every failure is an ``APIError`` (400, or 500 for a fault
    of the compiler itself) whose ``param`` is the field the constraint came from, or the part of it at fault.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from radixserve.constrained import ConstraintSpec, GrammarError
from radixserve.constrained.spec import ConstraintKind
from radixserve.server.errors import APIError, bad_request, grammar_error
from radixserve.server.metrics import Metrics
from radixserve.server.protocol import ResponseFormat

# Request field -> constraint kind, in the order conflicts are reported.
CONSTRAINT_FIELDS: dict[str, ConstraintKind] = {
    "json_schema": "json_schema",
    "regex": "regex",
    "ebnf": "grammar",
    "grammar": "grammar",
    "choices": "choice",
}
NATIVE_PREFIX = "sampling_params."
# vLLM's names for the same constraints.
GUIDED_FIELDS: dict[str, ConstraintKind] = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
STRUCTURED_OUTPUT_KEYS: dict[str, ConstraintKind] = {
    "json_": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}
# structured_outputs options that change what a grammar allows, and what to do instead.
STRUCTURED_OUTPUT_UNSUPPORTED = {
    "structural_tag": "structural tags are not served; use tools with tool_choice, or a json schema",
    "whitespace_pattern": "JSON whitespace follows the grammar engine's rules and cannot be set per request",
    "disable_any_whitespace": "JSON whitespace follows the grammar engine's rules and cannot be set per request",
    "disable_additional_properties": 'set "additionalProperties": false in the schema itself',
}


@dataclass(frozen=True)
class RequestConstraint:
    """A constraint and the request field it came from.

    ``sub_params`` are ``(JSON pointer prefix, field)`` pairs: a schema error whose pointer lies under a prefix
    is reported at that field, with the pointer made relative to it (a forced tool call's schema wraps each
    tool's ``parameters``, and the client should hear about ``tools[1].function.parameters``, not the wrapper).
    """

    spec: ConstraintSpec
    param: str
    sub_params: tuple[tuple[str, str], ...] = ()

    def error(self, exc: GrammarError) -> APIError:
        return _mapped_error(exc, self.param, self.sub_params)


def _mapped_error(exc: GrammarError, param: str, sub_params: tuple[tuple[str, str], ...]) -> APIError:
    pointer = exc.pointer
    if pointer is not None:
        for prefix, sub in sub_params:
            if pointer == prefix or pointer.startswith(prefix + "/"):
                inner = pointer[len(prefix) :]
                message = str(exc).replace(f" at {pointer or '/'}", f" at {inner or '/'}", 1)
                return grammar_error(exc, sub, message)
    return grammar_error(exc, param)


def make_constraint(
    kind: ConstraintKind, value: Any, param: str, sub_params: tuple[tuple[str, str], ...] = ()
) -> RequestConstraint:
    """A checked constraint (its shape only: compiling comes later); a malformed value is a 400 at ``param``, or
    at the field of ``sub_params`` whose part of the value is at fault."""
    try:
        spec = ConstraintSpec(kind, value)
        spec.validate()
    except GrammarError as exc:
        raise _mapped_error(exc, param, sub_params) from None
    return RequestConstraint(spec, param, sub_params)


def at_most_one(found: Sequence[RequestConstraint | None]) -> RequestConstraint | None:
    present = [c for c in found if c is not None]
    if len(present) > 1:
        names = " and ".join(repr(c.param) for c in present)
        raise APIError(
            400,
            f"a request may carry one constraint, but this one has {names}; send only one of them",
            param=present[1].param,
            code="conflicting_constraints",
        )
    return present[0] if present else None


def field_constraints(values: Mapping[str, Any], prefix: str = "") -> list[RequestConstraint]:
    """The constraints given as fields of ``values`` (a request body or a ``sampling_params`` dict)."""
    return [
        make_constraint(kind, values[name], prefix + name)
        for name, kind in CONSTRAINT_FIELDS.items()
        if values.get(name) is not None
    ]


def body_constraints(body: Any) -> list[RequestConstraint]:
    """The constraints of an OpenAI request model: its constraint fields and vLLM's spellings of them."""
    found = field_constraints({name: getattr(body, name, None) for name in CONSTRAINT_FIELDS})
    found += [
        make_constraint(kind, getattr(body, name), name)
        for name, kind in GUIDED_FIELDS.items()
        if getattr(body, name, None) is not None
    ]
    outputs = getattr(body, "structured_outputs", None)
    if outputs is not None:
        found += _structured_outputs(outputs)
    return found


def _structured_outputs(outputs: Any) -> list[RequestConstraint]:
    for key, why in STRUCTURED_OUTPUT_UNSUPPORTED.items():
        if getattr(outputs, key) not in (None, False):
            raise bad_request(f"structured_outputs.{key} is not supported: {why}", f"structured_outputs.{key}")
    found = [
        make_constraint(kind, getattr(outputs, key), f"structured_outputs.{key.rstrip('_')}")
        for key, kind in STRUCTURED_OUTPUT_KEYS.items()
        if getattr(outputs, key) is not None
    ]
    if outputs.json_object:
        found.append(make_constraint("json_object", None, "structured_outputs.json_object"))
    return found


def native_constraint(raw: Mapping[str, Any]) -> RequestConstraint | None:
    """The constraint of a /generate ``sampling_params`` dict (fields named ``sampling_params.<field>``)."""
    return at_most_one(field_constraints(raw, NATIVE_PREFIX))


def response_format_constraint(fmt: ResponseFormat | None) -> RequestConstraint | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return make_constraint("json_object", None, "response_format")
    spec = fmt.json_schema
    if not isinstance(spec, dict) or spec.get("schema") is None:
        raise bad_request(
            'response_format of type json_schema needs "json_schema": {"name": ..., "schema": {<a JSON schema>}}',
            "response_format",
        )
    return make_constraint("json_schema", spec["schema"], "response_format")


async def compile_constraints(engine: Any, metrics: Metrics, constraints: Sequence[RequestConstraint | None]) -> None:
    """Compile every distinct constraint (concurrently, off the event loop) and map failures to ``APIError``.

    The first failure (in request order) is raised after every compile has settled, so none is left running
    unobserved. A model whose tokenizer cannot be turned into a grammar vocabulary is a 400 too: constrained
    decoding is unavailable for it, and the message says why.
    """
    unique: dict[str, RequestConstraint] = {}
    for c in constraints:
        if c is not None:
            unique.setdefault(c.spec.key, c)
    if not unique:
        return
    results = await asyncio.gather(*(_compile(engine, metrics, c) for c in unique.values()), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result


async def _compile(engine: Any, metrics: Metrics, constraint: RequestConstraint) -> None:
    # A GrammarError is the constraint's fault; another ValueError (constrained.TokenizerError) says this model's
    # vocabulary cannot carry a grammar. The in-process engine raises them at once or on the future, an engine
    # process always on the future.
    try:
        future = engine.compile(constraint.spec)
    except GrammarError as exc:
        raise constraint.error(exc) from None
    except ValueError as exc:
        raise _unavailable(constraint, exc) from None
    metrics.grammar_wait(+1)
    try:
        await asyncio.wrap_future(future)
    except GrammarError as exc:
        raise constraint.error(exc) from None
    except ValueError as exc:
        raise _unavailable(constraint, exc) from None
    finally:
        metrics.grammar_wait(-1)


def _unavailable(constraint: RequestConstraint, exc: ValueError) -> APIError:
    return APIError(
        400,
        f"{constraint.param}: constrained decoding is not available for this model: {exc}",
        param=constraint.param,
        code="unsupported_constraint",
    )
