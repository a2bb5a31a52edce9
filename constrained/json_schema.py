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

import json
import re
from collections.abc import Callable
from typing import Any

from constrained import schema_refs as refs
from constrained.schema_logic import (
    TYPE_NAMES,
    CannotRewrite,
    Schema,
    SchemaAlgebra,
    _all_of,
    _any_of,
    complement_regex,
    declared_atoms,
    json_equal,
)
from constrained.spec import GrammarError, canonical_json, pointer_join

ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly"}
    | {"contentMediaType", "contentEncoding", "contentSchema", "$dynamicAnchor", "$recursiveAnchor"}
)
_SCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas")
_SCHEMA_ONE = ("additionalProperties", "additionalItems", "propertyNames", "not", "if", "then", "else", "contains")
_SCHEMA_ONE += ("unevaluatedProperties", "unevaluatedItems")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_DEFS = ("$defs", "definitions")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains")
_COUNTS += ("maxContains",)
_NUMBERS = ("minimum", "maximum", "multipleOf")
_IN_PLACE = ("allOf", "anyOf", "oneOf", "not", "if", "$ref", "dependentSchemas", "dependencies")
_MATCH_ALL = frozenset({"", ".*", "^.*", ".*$"})
MAX_OUTPUT_CHARS = 4 << 20
MAX_NEGATED_BRANCHES = 64


class _Rewriter:
    def __init__(self, root: Any, known_formats: frozenset[str]) -> None:
        self.root = root
        self.formats = known_formats
        self.doc_id = refs.root_id(root)
        self.local = not refs.has_embedded_resources(root) and self._all_refs_local(root)
        self.memo: dict[str, Schema] = {}
        self.busy: set[str] = set()
        self.holders: list[dict[str, Any]] = []  # rewritten nodes that carry a $ref, in creation order
        self.conditionals: dict[int, tuple[Schema, Schema, Schema]] = {}  # id(pure if/then/else node) -> parts
        self.algebra = SchemaAlgebra(self._resolve)

    def _all_refs_local(self, node: Any) -> bool:
        return all(refs.parse_local_ref(d["$ref"], self.doc_id) is not None for d in refs.iter_refs(node))

    # ------------------------------------------------------------------ walking
    def at(self, ptr: str) -> Schema:
        """The rewritten subschema at ``ptr`` of the user's document (memoized, so shared by identity)."""
        if ptr in self.memo:
            return self.memo[ptr]
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

    def _resolve(self, ref: str) -> Schema | None:
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
            if key in _SCHEMA_MAPS:
                out[key] = {k: self.at(pointer_join(kp, k)) for k in value}
            elif key in _SCHEMA_ONE:
                out[key] = self.at(kp)
            elif key in _SCHEMA_LISTS or (key == "items" and isinstance(value, list)):
                out[key] = [self.at(pointer_join(kp, i)) for i in range(len(value))]
            elif key == "items":
                out[key] = self.at(kp)
            elif key in _DEFS:
                out[key] = {} if self.local else {k: self.at(pointer_join(kp, k)) for k in value}
            elif key == "dependencies":
                out[key] = {k: v if isinstance(v, list) else self.at(pointer_join(kp, k)) for k, v in value.items()}
            elif key in ("$dynamicRef", "$recursiveRef"):
                raise GrammarError.unsupported(key, ptr, "dynamic references are not supported; use $ref")
            elif key == "format" and value not in self.formats:
                continue  # an annotation: JSON Schema does not require validators to check unknown formats
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
            rest = out.pop("items", True)
            out["items"] = prefix
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
        extra.append(_any_of([_all_of([cond, then]), _all_of([neg, other])]))

    def _one_of(self, out: dict[str, Any], ptr: str, extra: list[Schema]) -> None:
        if "oneOf" not in out:
            return
        kp = pointer_join(ptr, "oneOf")
        branches = out.pop("oneOf")
        n = len(branches)
        # Overlap only matters among values that also satisfy this node's other keywords.
        within = [_all_of([dict(out), b]) for b in branches] if out else branches
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
            terms.append(_all_of([branches[i], *negs]))
        extra.append(_any_of(terms))

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
                extra.append({"anyOf": [absent, _all_of([{"required": [trigger]}, then])]})

    def _arrays(self, out: dict[str, Any], ptr: str, extra: list[Schema]) -> None:
        if out.pop("uniqueItems", False) and out.get("maxItems", 2) > 1:
            raise GrammarError.unsupported("uniqueItems", ptr, "a grammar cannot enforce distinct array items")
        if "contains" in out:
            raise GrammarError.unsupported("contains", ptr, "a grammar cannot enforce 'some item matches'")
        out.pop("minContains", None)
        out.pop("maxContains", None)
        rest = out.pop("unevaluatedItems", True)
        if rest not in (True, {}) and not isinstance(out.get("items"), dict | bool):
            if any(k in out for k in _IN_PLACE):
                raise GrammarError.unsupported("unevaluatedItems", ptr, "only supported without in-place applicators")
            if isinstance(out.get("items"), list):
                out.setdefault("additionalItems", rest)
            else:
                out["items"] = rest

    def _objects(self, out: dict[str, Any], ptr: str, extra: list[Schema]) -> None:
        rest = out.pop("unevaluatedProperties", True)
        if rest not in (True, {}) and "additionalProperties" not in out:
            if any(k in out for k in _IN_PLACE):
                why = "only supported without in-place applicators"
                raise GrammarError.unsupported("unevaluatedProperties", ptr, why)
            out["additionalProperties"] = rest
        if "propertyNames" in out:
            _property_names(self, out, ptr)
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


_SAFE_PATTERN = re.compile(r"(?:[^\\]|\\[.\-dw/\\^$*+?()\[\]{}|])*")


def name_matches(pattern: str, name: str) -> bool | None:
    """Whether ECMAScript ``pattern`` finds a match in the property name ``name``; None when unsure.

    Decided with Python's ``re`` only where both engines agree: ASCII names without line breaks, and patterns
    without lookaround, back-references, flags or escapes other than ``\\d``, ``\\w`` and escaped punctuation.
    """
    if not name.isascii() or "\n" in name or "\r" in name or "(?" in pattern:
        return None
    if not _SAFE_PATTERN.fullmatch(pattern) or not pattern.isascii():
        return None
    try:
        return re.search(pattern, name, re.ASCII) is not None
    except re.error:
        return None


def _property_names(rw: _Rewriter, out: dict[str, Any], ptr: str) -> None:
    """``propertyNames`` as explicit ``properties`` (finite names) or one ``patternProperties`` entry."""
    kp = pointer_join(ptr, "propertyNames")
    names = out.pop("propertyNames")
    while isinstance(names, dict) and set(names) == {"$ref"}:
        names = rw._resolve(names["$ref"])
    if names is True or names == {}:
        return
    patterns = out.get("patternProperties", {})
    if any(p not in _MATCH_ALL for p in patterns) or not isinstance(names, dict):
        raise GrammarError.unsupported("propertyNames", kp, "only supported beside match-all patternProperties")
    every = [patterns[p] for p in patterns]
    props = out.get("properties", {})
    rest = out.get("additionalProperties", True)
    allowed = set(names) - {"type", "enum", "pattern"}
    if allowed or names.get("type", "string") not in ("string", ["string"]):
        raise GrammarError.unsupported("propertyNames", kp, "only 'enum' or 'pattern' name constraints are supported")
    if "enum" in names and "pattern" not in names:
        keys = [k for k in names["enum"] if isinstance(k, str)]
        undeclared = True if every else rest  # match-all patterns leave additionalProperties nothing to apply to
        out["properties"] = {k: _all_of([props.get(k, undeclared), *every]) for k in keys}
        out.pop("patternProperties", None)  # folded into the listed names
    elif "pattern" in names and "enum" not in names:
        hits = {k: name_matches(names["pattern"], k) for k in props}
        if None in hits.values():
            raise GrammarError.unsupported(
                "propertyNames", kp, "cannot decide which listed properties the pattern allows"
            )
        if not every and rest not in (True, {}) and any(hits.values()):
            why = "a listed property matching the name pattern would also get additionalProperties"
            raise GrammarError.unsupported("propertyNames", kp, why)
        out["properties"] = {k: (v if hits[k] else False) for k, v in props.items()}
        out["patternProperties"] = {names["pattern"]: _all_of(every) if every else rest}
    else:
        raise GrammarError.unsupported("propertyNames", kp, "'enum' together with 'pattern' is not supported")
    out["additionalProperties"] = False


def _fuse_conditionals(rw: _Rewriter, out: dict[str, Any], ptr: str, extra: list[Schema]) -> None:
    """Fuse ``allOf`` members ``if {properties: {P: enum V_i}} then T_i else E_i`` sharing one property P.

    Rewritten one by one they would intersect into 2^n branches; as cases of P's value they need n + 3:
    not an object (every ``if`` holds vacuously), P absent, P in V_k (only the k-th ``if`` holds), P elsewhere.
    """
    groups: dict[str, list[tuple[Schema, list[Any], bool, Schema, Schema]]] = {}
    for member in out.get("allOf", []):
        parts = rw.conditionals.get(id(member))
        key = _discriminator(parts[0]) if parts else None
        if parts and key:
            groups.setdefault(key[0], []).append((member, key[1], key[2], parts[1], parts[2]))
    for prop, raw in groups.items():
        items = _merge_same_condition(raw)
        values = [v for item in items for v in item[1]]
        if len(items) < 2 or any(json_equal(a, b) for i, a in enumerate(values) for b in values[i + 1 :]):
            continue
        try:
            elsewhere = rw.algebra.negate({"enum": values})
            non_object = rw.algebra.negate({"type": "object"})
        except CannotRewrite:
            continue
        present = {"type": "object", "required": [prop]}
        cases = [
            _all_of([non_object, *(t for _, _, _, t, _ in items)]),
            _all_of([{"type": "object", "properties": {prop: False}}, *(e if req else t for _, _, req, t, e in items)]),
            _all_of([{**present, "properties": {prop: elsewhere}}, *(e for *_, e in items)]),
        ]
        for k, (_, vals, _, then, _) in enumerate(items):
            others = (e for i, (*_, e) in enumerate(items) if i != k)
            cases.append(_all_of([{**present, "properties": {prop: {"enum": vals}}}, then, *others]))
        context = {k: v for k, v in out.items() if k != "allOf"}
        cases = [c for c in cases if not rw.algebra.disjoint(c, context)]  # e.g. "P absent" when P is required
        fused = {id(item[0]) for item in raw}
        out["allOf"] = [m for m in out["allOf"] if id(m) not in fused] + [_any_of(cases)]


def _merge_same_condition(
    items: list[tuple[Schema, list[Any], bool, Schema, Schema]],
) -> list[tuple[Schema, list[Any], bool, Schema, Schema]]:
    """Conditionals with the same condition become one: (if C then T1 else E1) and (if C then T2 else E2)."""
    merged: dict[tuple[str, bool], tuple[Schema, list[Any], bool, Schema, Schema]] = {}
    for node, values, req, then, other in items:
        key = (canonical_json(values), req)
        if key in merged:
            first = merged[key]
            merged[key] = (first[0], values, req, _all_of([first[3], then]), _all_of([first[4], other]))
        else:
            merged[key] = (node, values, req, then, other)
    return list(merged.values())


def _discriminator(cond: Schema) -> tuple[str, list[Any], bool] | None:
    """(P, V, required) for a condition ``{properties: {P: {enum: V}}, [required: [P]]}``, else None."""
    if not isinstance(cond, dict) or not set(cond) <= {"properties", "required"}:
        return None
    props = cond.get("properties")
    if not isinstance(props, dict) or len(props) != 1:
        return None
    (prop, sub), required = next(iter(props.items())), cond.get("required", [])
    if not isinstance(sub, dict) or set(sub) != {"enum"} or required not in ([], [prop]):
        return None
    return prop, list(sub["enum"]), bool(required)


def _drop_no_ops(rw: _Rewriter, out: dict[str, Any], ptr: str, extra: list[Schema]) -> None:
    """Remove what changes nothing; the backend must intersect overlapping schemas, which recursion forbids.

    Keywords that accept everything go, and so does a property whose schema equals that of a match-all
    ``patternProperties`` entry (the name gets both, which is the same schema once).
    """
    _split_overlaps(rw, out)
    patterns = {p: canonical_json(v) for p, v in out.get("patternProperties", {}).items()}
    props = out.get("properties", {})
    for name in list(props) if patterns else ():
        hits = [name_matches(p, name) for p in patterns]
        mine = canonical_json(props[name])
        if None not in hits and any(hits) and all(v == mine for v, hit in zip(patterns.values(), hits) if hit):
            del props[name]
    for key, value in list(out.items()):
        if value in _NO_OP.get(key, ()) and not (key == "items" and "additionalItems" in out):
            del out[key]


def _split_overlaps(rw: _Rewriter, out: dict[str, Any]) -> None:
    """Give a listed property that a match-all pattern also covers the computed conjunction of both schemas.

    The backend would intersect the two itself, which fails when a reference inside is recursive. With the
    conjunction precomputed, the pattern becomes "every name except those properties": same instances.
    """
    patterns, props = out.get("patternProperties", {}), out.get("properties", {})
    match_all = [p for p in patterns if p in _MATCH_ALL]
    if len(match_all) != len(patterns) or not props or len({canonical_json(patterns[p]) for p in match_all}) != 1:
        return
    shared = patterns[match_all[0]]
    merged = {
        k: rw.algebra.intersect(v, shared) for k, v in props.items() if canonical_json(v) != canonical_json(shared)
    }
    if not merged or any(v is None for v in merged.values()):
        return
    try:
        others = complement_regex(props)
    except CannotRewrite:
        return
    props.update(merged)
    out["patternProperties"] = {others: shared}


_NO_OP: dict[str, tuple[Any, ...]] = {
    "additionalProperties": (True, {}),
    "items": (True, {}),
    "additionalItems": (True, {}),
    "properties": ({},),
    "patternProperties": ({},),
    "required": ([],),
    "minLength": (0,),
    "minItems": (0,),
    "minProperties": (0,),
}

_STEPS: tuple[Callable[[_Rewriter, dict[str, Any], str, list[Schema]], None], ...] = (
    _fuse_conditionals,
    _Rewriter._const,
    _Rewriter._tuple,
    _Rewriter._arrays,
    _Rewriter._objects,
    _Rewriter._dependencies,
    _Rewriter._not,
    _Rewriter._if,
    _Rewriter._one_of,
    _drop_no_ops,
)


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}.get(type(value), "a number")


def _check_value(key: str, value: Any, ptr: str) -> None:
    """Shape checks for the keywords this module reads; raises GrammarError(invalid) with the pointer."""
    bad: str | None = None
    if key == "type":
        names = [value] if isinstance(value, str) else value
        if not isinstance(names, list) or not names or any(n not in TYPE_NAMES for n in names):
            bad = f"type must be one of {', '.join(TYPE_NAMES)} or a non-empty list of them, got {value!r}"
    elif key in (*_SCHEMA_MAPS, *_DEFS, "dependentRequired") and not isinstance(value, dict):
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
    elif key in ("$ref", "pattern", "format") and not isinstance(value, str):
        bad = f"{key} must be a string"
    elif key == "dependencies" and not isinstance(value, dict):
        bad = "dependencies must be an object"
    if bad:
        raise GrammarError.invalid_schema(ptr, bad, key)


def rewrite_schema(schema: Any, known_formats: frozenset[str]) -> Schema:
    """The backend-ready equivalent of ``schema``; raises ``GrammarError`` when none exists."""
    rw = _Rewriter(schema, known_formats)
    out = rw.at("")
    if rw.local:
        _place_refs(rw, out)
        _drop_implied_types(rw, out)
        _inline_referenced_siblings(rw, out)
    if len(json.dumps(out)) > MAX_OUTPUT_CHARS:
        raise GrammarError("the schema expands past the size limit after rewriting", kind="too_complex")
    return out


def _place_refs(rw: _Rewriter, out: Schema) -> None:
    """Make every local ``$ref`` of the output point at the rewritten form of its original target.

    A target whose path survives in the output (in place, or as a lazily rewritten definition) keeps its
    reference; one that lived under a rewritten keyword (``not``, ``if``, ...) is stashed under ``$defs``.
    """
    if not isinstance(out, dict):
        return
    stash = out.setdefault("$defs", {})
    placed: dict[str, str] = {}
    done = 0
    while done < len(rw.holders):  # placing a target may rewrite more nodes, which append more holders
        holder = rw.holders[done]
        done += 1
        ptr = refs.parse_local_ref(holder["$ref"], rw.doc_id)
        if ptr is None or holder["$ref"] in placed.values():
            continue
        target = rw.at(ptr)
        if ptr in placed:
            holder["$ref"] = placed[ptr]
        elif not _place(rw, out, ptr, target):
            name = f"{_STASH_PREFIX}{len(placed)}"
            if name in stash:
                raise GrammarError.invalid_schema("/$defs", f"the definition name {name!r} is reserved", "$defs")
            stash[name] = target
            placed[ptr] = holder["$ref"] = f"#/$defs/{name}"
    if not stash:
        out.pop("$defs")


_STASH_PREFIX = "__constrained_rewritten_"


def _drop_implied_types(rw: _Rewriter, out: Schema) -> None:
    """Remove a ``type`` that the rest of its schema (``$ref`` target, ``anyOf`` branches, ``enum``) implies.

    Exact (R within type => R and type = R), and it leaves bare references and unions, which the backend can
    follow through recursive definitions (a reference with siblings must be intersected, which recursion forbids).
    """
    for node in _schema_nodes(out):
        if "type" in node and any(k in node for k in ("$ref", "anyOf", "allOf", "enum")):
            rest = {k: v for k, v in node.items() if k != "type"}
            if rw.algebra.types(rest) <= declared_atoms(node["type"]):
                del node["type"]


def _inline_referenced_siblings(rw: _Rewriter, out: Schema) -> None:
    """Replace ``{"$ref": X, k: v}`` by ``{**X, k: v}`` when the keywords do not interact.

    Both forms mean X and {k: v}; the merged one needs no intersection with a reference, which the backend
    cannot do inside a recursive definition. Merging is exact when the two keyword sets are disjoint and no
    interacting group (properties / patternProperties / additionalProperties, items / additionalItems) is split.
    """
    stash: dict[str, Schema] = {}
    merged_defs: dict[tuple[str, str], str] = {}
    for node in _schema_nodes(out):
        _inline_members(rw, node)
        if "$ref" not in node or not set(node) - _META - {"$ref"}:
            continue
        target = rw._resolve(node["$ref"])
        if not isinstance(target, dict):
            continue
        mine, theirs = set(node) - _META - {"$ref"}, set(target) - _META
        if mine & theirs or any(g & mine and g & theirs for g in _INTERACTING):
            continue
        merged = {k: v for k, v in target.items() if k not in _META}
        merged.update((k, v) for k, v in node.items() if k not in _META and k != "$ref")
        if any(n is node for n in _schema_nodes(target)):
            # Recursive: the merged schema becomes a definition of its own, so the node stays a bare reference.
            key = (node["$ref"], canonical_json({k: v for k, v in node.items() if k != "$ref"}))
            if key not in merged_defs:
                name = f"{_STASH_PREFIX}merged_{len(merged_defs)}"
                stash[name] = merged
                merged_defs[key] = f"#/$defs/{name}"
            node.clear()
            node["$ref"] = merged_defs[key]
        else:
            node.clear()
            node.update(merged)
    if stash and isinstance(out, dict):
        out.setdefault("$defs", {}).update(stash)


def _inline_members(rw: _Rewriter, node: dict[str, Any]) -> None:
    """In an ``allOf`` / ``anyOf`` that gets intersected with other conjuncts, use targets of bare ``$ref`` members.

    A bare reference and its target mean the same; the target needs no reference resolution while intersecting.
    Skipped when the target contains ``node`` (the result would contain itself).
    """
    conjuncts = len(set(node) - _META - {"allOf", "anyOf"}) + len(node.get("allOf", [])) + ("anyOf" in node)
    if conjuncts < 2:
        return
    for key in ("allOf", "anyOf"):
        members = node.get(key, [])
        for i, member in enumerate(members):
            if isinstance(member, dict) and set(member) == {"$ref"}:
                target = rw._resolve(member["$ref"])
                if isinstance(target, dict) and not any(n is node for n in _schema_nodes(target)):
                    members[i] = target


_META = frozenset({"$schema", "$id", "id", "$anchor", *_DEFS})
_INTERACTING = (
    frozenset({"properties", "patternProperties", "additionalProperties"}),
    frozenset({"items", "additionalItems"}),
    frozenset({"minimum", "exclusiveMinimum"}),
    frozenset({"maximum", "exclusiveMaximum"}),
)


def _schema_nodes(root: Schema) -> list[dict[str, Any]]:
    """Every subschema object reachable from ``root`` through schema positions, each once."""
    seen: set[int] = set()
    out: list[dict[str, Any]] = []
    stack: list[Any] = [root]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        out.append(node)
        for key, value in node.items():
            if key in (*_SCHEMA_MAPS, *_DEFS):
                stack.extend(value.values())
            elif key in (*_SCHEMA_LISTS, "items") and isinstance(value, list):
                stack.extend(value)
            elif key in (*_SCHEMA_ONE, "items"):
                stack.append(value)
    return out


def _place(rw: _Rewriter, out: dict[str, Any], ptr: str, target: Schema) -> bool:
    """Put ``target`` at ``ptr`` in the output when the path survives; True when it is (now) there."""
    node: Any = out
    tokens = refs.split_pointer(ptr)
    for depth, tok in enumerate(tokens):
        if isinstance(node, dict) and tok not in node:
            parent = tokens[:depth]
            if not parent or parent[-1] not in _DEFS or refs.lookup(rw.root, pointer_join("", *parent)) is refs.MISSING:
                return False
            node[tok] = rw.at(pointer_join("", *tokens[: depth + 1]))
        node = refs.lookup(node, pointer_join("", tok))
        if node is refs.MISSING:
            return False
    return node is target
