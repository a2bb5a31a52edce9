"""Rewrite a user's JSON schema into an equivalent one that the grammar backend enforces completely.

Every rewrite keeps the set of accepted instances identical; a keyword with no exact rewrite raises
``GrammarError`` naming it and its JSON pointer. Nothing is ever dropped silently except annotations (and
``format`` values the backend does not know, which JSON Schema itself defines as annotations).

Keywords are read in the union of drafts 4 to 2020-12, whatever ``$schema`` says, so a keyword the user wrote is
never ignored because of the declared draft. Rewrites (see docs/constrained.md for the full list):
  * ``const`` -> ``enum``; ``prefixItems`` -> tuple ``items`` + ``additionalItems``;
  * ``dependencies`` / ``dependentRequired`` / ``dependentSchemas`` -> ``anyOf`` (absent, or present with ...);
  * ``not`` -> its exact complement; ``if/then/else`` -> ``anyOf[if & then, not(if) & else]``;
  * ``oneOf`` -> ``anyOf`` when the branches are provably disjoint, else ``anyOf_i(A_i & not A_j ...)``;
  * ``propertyNames`` -> ``properties`` / ``patternProperties`` + ``additionalProperties: false``;
  * trivially true ``uniqueItems`` / ``minProperties`` / ``maxProperties`` / ``unevaluated*`` are dropped.
Only ``$defs`` / ``definitions`` entries reachable through ``$ref`` are rewritten (unused ones cannot fail).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radixserve.constrained import schema_refs as refs
from radixserve.constrained.schema_logic import SchemaAlgebra
from radixserve.constrained.schema_passes import (
    EXACT_INTEGERS,
    as_draft_2020,
    drop_implied_types,
    fit_number_bounds,
    inline_referenced_siblings,
    materialize_all_of,
    place_refs,
)
from radixserve.constrained.schema_regex import drop_lookahead
from radixserve.constrained.schema_steps import drop_no_ops, fuse_conditionals, property_names
from radixserve.constrained.schema_types import (
    DEFS,
    IN_PLACE,
    SCHEMA_LISTS,
    SCHEMA_MAPS,
    SCHEMA_ONE,
    TYPE_NAMES,
    CannotRewrite,
    Schema,
    all_of,
    any_of,
    json_equal,
)
from radixserve.constrained.spec import GrammarError, pointer_join

__all__ = ["as_draft_2020", "rewrite_schema"]


ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly"}
    | {"contentMediaType", "contentEncoding", "contentSchema", "$dynamicAnchor", "$recursiveAnchor"}
)

_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains")
_COUNTS += ("maxContains",)

_NUMBERS = ("minimum", "maximum", "multipleOf")

MAX_NEGATED_BRANCHES = 64


class Rewriter:
    """One rewrite of one user schema.

    Invariants: ``at(ptr)`` is computed once per pointer of the user's document and shared by identity, so
    references, negations and the passes all see the same rewritten node; ``busy`` holds the pointers being
    rewritten (a reference back into one of them is not followed, which ends recursion); ``holders`` lists every
    rewritten node with a ``$ref``, so the passes can re-point references without walking data (enum values).
    """

    def __init__(self, root: Any, known_formats: frozenset[str], *, reshape: bool = False) -> None:
        self.root = root
        self.reshape = reshape
        self.formats = known_formats
        self.doc_id = refs.root_id(root)
        self.local = not refs.has_embedded_resources(root) and self._all_refs_local(root)
        self.memo: dict[str, Schema] = {}
        self.busy: set[str] = set()
        self.holders: list[dict[str, Any]] = []  # rewritten nodes that carry a $ref, in creation order
        self.conditionals: dict[int, tuple[Schema, Schema, Schema]] = {}  # id(pure if/then/else node) -> parts
        self.algebra = SchemaAlgebra(self.resolve)

    def _all_refs_local(self, node: Any) -> bool:
        return all(refs.parse_local_ref(d["$ref"], self.doc_id) is not None for d in refs.iter_refs(node))

    # ------------------------------------------------------------------ walking
    def at(self, ptr: str, node: Any = refs.MISSING) -> Schema:
        """The rewritten subschema at ``ptr`` of the user's document (memoized, so shared by identity).

        ``node`` is the value at ``ptr`` when the caller already holds it (saves the lookup from the root).
        """
        if ptr in self.memo:
            return self.memo[ptr]
        if node is refs.MISSING:
            node = refs.lookup(self.root, ptr)
        if node is refs.MISSING:
            raise GrammarError.invalid_schema(ptr, "$ref points to a location that does not exist", "$ref")
        self.busy.add(ptr)
        try:
            out = self._rewrite(node, ptr)
        finally:
            self.busy.discard(ptr)
        self.memo[ptr] = out
        return out

    def resolve(self, ref: str) -> Schema | None:
        ptr = refs.parse_local_ref(ref, self.doc_id) if self.local else None
        if ptr is None or ptr in self.busy or refs.lookup(self.root, ptr) is refs.MISSING:
            return None
        return self.at(ptr)

    def _rewrite(self, node: Any, ptr: str) -> Schema:
        if isinstance(node, bool):
            return node
        if not isinstance(node, dict):
            raise GrammarError.invalid_schema(ptr, f"a schema must be an object or a boolean, not {_kind(node)}")
        out: dict[str, Any] = {}
        extra: list[Schema] = []
        for key, value in node.items():
            if key in ANNOTATIONS:
                continue
            kp = pointer_join(ptr, key)
            _check_value(key, value, kp)
            if key in ("enum", "const") and (inexact := _inexact_integer(value)) is not None:
                why = f"the integer {inexact} cannot be written exactly (the grammar backend holds numbers as doubles)"
                raise GrammarError.unsupported(key, kp, why)
            if key == "patternProperties":
                out[key] = {_pattern(k): self.at(pointer_join(kp, k), v) for k, v in value.items()}
            elif key in SCHEMA_MAPS:
                out[key] = {k: self.at(pointer_join(kp, k), v) for k, v in value.items()}
            elif key in SCHEMA_ONE:
                out[key] = self.at(kp, value)
            elif key in SCHEMA_LISTS or (key == "items" and isinstance(value, list)):
                out[key] = [self.at(pointer_join(kp, i), v) for i, v in enumerate(value)]
            elif key == "items":
                out[key] = self.at(kp, value)
            elif key in DEFS:
                out[key] = {} if self.local else {k: self.at(pointer_join(kp, k), v) for k, v in value.items()}
            elif key == "dependencies":
                out[key] = {k: v if isinstance(v, list) else self.at(pointer_join(kp, k), v) for k, v in value.items()}
            elif key in ("$dynamicRef", "$recursiveRef"):
                raise GrammarError.unsupported(key, ptr, "dynamic references are not supported; use $ref")
            elif key == "format" and value not in self.formats:
                continue  # an annotation: JSON Schema does not require validators to check unknown formats
            elif key == "pattern":
                out[key] = _pattern(value)
            else:
                out[key] = value
        for step in _STEPS:
            step(self, out, ptr, extra)
        if extra:
            out["allOf"] = [*out.get("allOf", []), *extra]
        if "$ref" in out:
            self.holders.append(out)
        return out

    def negate(self, s: Schema, keyword: str, ptr: str, within: Schema = True) -> Schema:
        try:
            return self.algebra.negate(s, within=within)
        except CannotRewrite as exc:
            raise GrammarError.unsupported(keyword, ptr, f"its negation has no exact equivalent ({exc})") from None

    # --------------------------------------------------------- per-node rewrites
    def _const(self, out: dict[str, Any], ptr: str, extra: list[Schema]) -> None:
        if "const" in out:
            const = out.pop("const")
            enum = out.get("enum", [const])
            out["enum"] = [e for e in enum if json_equal(e, const)][:1]

    def _tuple(self, out: dict[str, Any], ptr: str, extra: list[Schema]) -> None:
        if "prefixItems" in out:
            if isinstance(out.get("items"), list):
                raise GrammarError.invalid_schema(ptr, "prefixItems and array-form items together", "prefixItems")
            prefix = out.pop("prefixItems")
            rest = out.pop("items", None)
            out["items"] = prefix
            if rest is not None:
                out["additionalItems"] = rest
        elif not isinstance(out.get("items"), list):
            out.pop("additionalItems", None)  # only meaningful after tuple-form items

    def _not(self, out: dict[str, Any], ptr: str, extra: list[Schema]) -> None:
        if "not" in out:
            extra.append(self.negate(out.pop("not"), "not", pointer_join(ptr, "not")))

    def _if(self, out: dict[str, Any], ptr: str, extra: list[Schema]) -> None:
        cond, then, other = out.pop("if", None), out.pop("then", True), out.pop("else", True)
        if cond is None or (then is True and other is True):
            return
        if not out:  # nothing but the conditional: a parent allOf may fuse it with its siblings
            self.conditionals[id(out)] = (cond, then, other)
        neg = self.negate(cond, "if", pointer_join(ptr, "if"))
        extra.append(any_of([all_of([cond, then]), all_of([neg, other])]))

    def _one_of(self, out: dict[str, Any], ptr: str, extra: list[Schema]) -> None:
        if "oneOf" not in out:
            return
        kp = pointer_join(ptr, "oneOf")
        branches = out.pop("oneOf")
        n = len(branches)
        # Overlap only matters among values that also satisfy this node's other keywords.
        within = [all_of([dict(out), b]) for b in branches] if out else branches
        overlap: dict[int, list[int]] = {i: [] for i in range(n)}
        for i in range(n):
            for j in range(i + 1, n):
                if not self.algebra.disjoint(within[i], within[j]):
                    overlap[i].append(j)
                    overlap[j].append(i)
        if sum(len(v) for v in overlap.values()) > MAX_NEGATED_BRANCHES:
            raise GrammarError.unsupported("oneOf", kp, "too many branches may overlap to express 'exactly one'")
        terms = []
        for i in range(n):
            negs = [self.negate(branches[j], "oneOf", pointer_join(kp, j), within[i]) for j in overlap[i]]
            terms.append(all_of([branches[i], *negs]))
        extra.append(any_of(terms))

    def _dependencies(self, out: dict[str, Any], ptr: str, extra: list[Schema]) -> None:
        deps: dict[str, Any] = {}
        for key in ("dependencies", "dependentRequired", "dependentSchemas"):
            deps.update(out.pop(key, {}))
        required = set(out.get("required", []))
        for trigger, need in deps.items():
            if out.get("properties", {}).get(trigger) is False:
                continue
            then = {"required": list(need)} if isinstance(need, list) else need
            if then is True or then == {"required": []}:
                continue
            if trigger in required:
                extra.append(then)
            else:
                absent = {"properties": {trigger: False}}
                extra.append({"anyOf": [absent, all_of([{"required": [trigger]}, then])]})

    def _arrays(self, out: dict[str, Any], ptr: str, extra: list[Schema]) -> None:
        if out.pop("uniqueItems", False) and out.get("maxItems", 2) > 1:
            raise GrammarError.unsupported("uniqueItems", ptr, "a grammar cannot enforce distinct array items")
        if "contains" in out:
            raise GrammarError.unsupported("contains", ptr, "a grammar cannot enforce 'some item matches'")
        out.pop("minContains", None)
        out.pop("maxContains", None)
        rest = out.pop("unevaluatedItems", True)
        if rest not in (True, {}) and not isinstance(out.get("items"), dict | bool):
            if any(k in out for k in IN_PLACE):
                raise GrammarError.unsupported("unevaluatedItems", ptr, "only supported without in-place applicators")
            if not isinstance(out.get("items"), list):
                out["items"] = rest
            elif "additionalItems" not in out:  # when present, it already evaluates every further item
                out["additionalItems"] = rest

    def _objects(self, out: dict[str, Any], ptr: str, extra: list[Schema]) -> None:
        rest = out.pop("unevaluatedProperties", True)
        if rest not in (True, {}) and "additionalProperties" not in out:
            if any(k in out for k in IN_PLACE):
                why = "only supported without in-place applicators"
                raise GrammarError.unsupported("unevaluatedProperties", ptr, why)
            out["additionalProperties"] = rest
        if "propertyNames" in out:
            property_names(self, out, ptr)
        props, required = out.get("properties", {}), set(out.get("required", []))
        closed = out.get("additionalProperties") is False and not out.get("patternProperties")
        if out.get("minProperties", 1) <= len(required):
            out.pop("minProperties", None)
        if closed and out.get("maxProperties", 0) >= len(props):
            out.pop("maxProperties", None)
        for key in ("minProperties", "maxProperties"):
            if key in out and not closed and not set(props) <= required:
                why = "only enforceable when additionalProperties is false or every listed property is required"
                raise GrammarError.unsupported(key, ptr, why)


_STEPS: tuple[Callable[[Rewriter, dict[str, Any], str, list[Schema]], None], ...] = (
    fuse_conditionals,
    Rewriter._const,
    Rewriter._tuple,
    Rewriter._arrays,
    Rewriter._objects,
    Rewriter._dependencies,
    Rewriter._not,
    Rewriter._if,
    Rewriter._one_of,
    drop_no_ops,
)


def _pattern(pattern: str) -> str:
    """The pattern in a form the backend reads: a leading ``(?!literal)`` before a one-class string is expanded."""
    return (drop_lookahead(pattern) if "(?!" in pattern else None) or pattern


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}.get(type(value), "a number")


def _inexact_integer(value: Any) -> int | None:
    """The first integer inside the JSON value ``value`` that llguidance would write as another number: past 2**53
    and not a double (it writes the nearest double), or past 2**63 (it cannot hold it at all)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, int) and not isinstance(v, bool):
            if abs(v) > EXACT_INTEGERS and not (abs(v) < 2**63 and float(v) == v):
                return v
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
    return None


def _check_value(key: str, value: Any, ptr: str) -> None:
    """Shape checks for the keywords this module reads; raises GrammarError(invalid) with the pointer."""
    bad: str | None = None
    if key == "type":
        names = [value] if isinstance(value, str) else value
        if not isinstance(names, list) or not names or any(n not in TYPE_NAMES for n in names):
            bad = f"type must be one of {', '.join(TYPE_NAMES)} or a non-empty list of them, got {value!r}"
    elif key in (*SCHEMA_MAPS, *DEFS, "dependentRequired") and not isinstance(value, dict):
        bad = f"{key} must be an object"
    elif key in ("allOf", "anyOf", "oneOf") and (not isinstance(value, list) or not value):
        bad = f"{key} must be a non-empty array of schemas"
    elif key in ("prefixItems", "enum") and not isinstance(value, list):
        bad = f"{key} must be an array"
    elif key == "required" and (not isinstance(value, list) or any(not isinstance(v, str) for v in value)):
        bad = "required must be an array of property names"
    elif key in _COUNTS and not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        bad = f"{key} must be a non-negative integer, got {value!r}"
    elif key in _NUMBERS and (isinstance(value, bool) or not isinstance(value, int | float)):
        bad = f"{key} must be a number, got {value!r}"
    elif key == "multipleOf" and value <= 0:
        bad = f"multipleOf must be greater than 0, got {value!r}"
    elif key in ("$ref", "pattern", "format") and not isinstance(value, str):
        bad = f"{key} must be a string"
    elif key == "dependencies" and not isinstance(value, dict):
        bad = "dependencies must be an object"
    if bad:
        raise GrammarError.invalid_schema(ptr, bad, key)


def rewrite_schema(schema: Any, known_formats: frozenset[str], *, reshape: bool = False) -> Schema:
    """The backend-ready equivalent of ``schema``; raises ``GrammarError`` when none exists.

    Equivalent except for numbers past +-2**53 next to a bound, which the backend cannot represent: those bounds
    move inward (``fit_number_bounds``), so outputs still satisfy ``schema``.

    ``reshape`` also restructures references and conjunctions (inline targets, precompute intersections) so the
    backend can follow recursive definitions it otherwise refuses; the accepted instances are the same, but the
    order in which the backend emits declared properties may change, so it is the fallback, not the default.
    """
    rw = Rewriter(schema, known_formats, reshape=reshape)
    try:
        out = rw.at("")
        if rw.local:
            place_refs(rw, out)
            if reshape:
                drop_implied_types(rw, out)
                inline_referenced_siblings(rw, out)
                materialize_all_of(rw, out)
        fit_number_bounds(out)
    except RecursionError:
        raise GrammarError("the schema nests too deeply to be compiled", kind="too_complex") from None
    return out
