"""Per-node rewrites that need a whole node at once: ``propertyNames``, fused conditionals, no-op removal.

Each step takes the rewriter, the node being built (``out``), its pointer and the list of extra conjuncts, and
keeps the node's accepted instance set unchanged (or raises ``GrammarError``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixserve.constrained.schema_regex import complement_regex, name_matches
from radixserve.constrained.schema_types import (
    MATCH_ALL,
    NEUTRAL,
    CannotRewrite,
    Schema,
    all_of,
    any_of,
    json_equal,
)
from radixserve.constrained.spec import GrammarError, canonical_json, pointer_join

if TYPE_CHECKING:
    from radixserve.constrained.json_schema import Rewriter


def property_names(rw: Rewriter, out: dict[str, Any], ptr: str) -> None:
    """``propertyNames`` as explicit ``properties`` (finite names) or one ``patternProperties`` entry."""
    kp = pointer_join(ptr, "propertyNames")
    names = out.pop("propertyNames")
    for _ in range(8):  # follow a chain of bare references (a cycle ends in "unsupported" below)
        if not (isinstance(names, dict) and set(names) == {"$ref"}):
            break
        names = rw.resolve(names["$ref"])
    if names is True or names == {} or names in ({"type": "string"}, {"type": ["string"]}):
        return  # every property name is a string
    patterns = out.get("patternProperties", {})
    if any(p not in MATCH_ALL for p in patterns) or not isinstance(names, dict):
        raise GrammarError.unsupported("propertyNames", kp, "only supported beside match-all patternProperties")
    every = [patterns[p] for p in patterns]
    props = out.get("properties", {})
    rest = out.get("additionalProperties", True)
    allowed = set(names) - {"type", "enum", "pattern"}
    if allowed or names.get("type", "string") not in ("string", ["string"]):
        raise GrammarError.unsupported("propertyNames", kp, "only 'enum' or 'pattern' name constraints are supported")
    if "enum" in names:
        keys = [k for k in names["enum"] if isinstance(k, str)]
        if "pattern" in names:  # a name must be listed and match: keep the listed names that match
            hits = {k: name_matches(names["pattern"], k) for k in keys}
            if None in hits.values():
                why = "cannot decide which names of its 'enum' its 'pattern' allows"
                raise GrammarError.unsupported("propertyNames", kp, why)
            keys = [k for k in keys if hits[k]]
        undeclared = True if every else rest  # match-all patterns leave additionalProperties nothing to apply to
        out["properties"] = {k: all_of([props.get(k, undeclared), *every]) for k in keys}
        out.pop("patternProperties", None)  # folded into the listed names
    else:
        hits = {k: name_matches(names["pattern"], k) for k in props}
        if None in hits.values():
            raise GrammarError.unsupported(
                "propertyNames", kp, "cannot decide which listed properties the pattern allows"
            )
        if not every and rest not in (True, {}) and any(hits.values()):
            why = "a listed property matching the name pattern would also get additionalProperties"
            raise GrammarError.unsupported("propertyNames", kp, why)
        out["properties"] = {k: (v if hits[k] else False) for k, v in props.items()}
        out["patternProperties"] = {names["pattern"]: all_of(every) if every else rest}
    out["additionalProperties"] = False


def fuse_conditionals(rw: Rewriter, out: dict[str, Any], ptr: str, extra: list[Schema]) -> None:
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
            all_of([non_object, *(t for _, _, _, t, _ in items if not _object_only(t))]),
            all_of([{"type": "object", "properties": {prop: False}}, *(e if req else t for _, _, req, t, e in items)]),
            all_of([{**present, "properties": {prop: elsewhere}}, *(e for *_, e in items)]),
        ]
        for k, (_, vals, _, then, _) in enumerate(items):
            others = (e for i, (*_, e) in enumerate(items) if i != k)
            cases.append(all_of([{**present, "properties": {prop: {"enum": vals}}}, then, *others]))
        context = {k: v for k, v in out.items() if k != "allOf"}
        cases = [c for c in cases if not rw.algebra.disjoint(c, context)]  # e.g. "P absent" when P is required
        fused = {id(item[0]) for item in raw}
        out["allOf"] = [m for m in out["allOf"] if id(m) not in fused] + [any_of(cases)]


_OBJECT_KEYWORDS = frozenset(
    {"properties", "required", "additionalProperties", "patternProperties", "minProperties", "maxProperties"}
)


def _object_only(s: Schema) -> bool:
    """True when ``s`` only constrains objects (every non-object satisfies it)."""
    return isinstance(s, dict) and all(k in _OBJECT_KEYWORDS or k in NEUTRAL for k in s)


def _merge_same_condition(
    items: list[tuple[Schema, list[Any], bool, Schema, Schema]],
) -> list[tuple[Schema, list[Any], bool, Schema, Schema]]:
    """Conditionals with the same condition become one: (if C then T1 else E1) and (if C then T2 else E2)."""
    merged: dict[tuple[str, bool], tuple[Schema, list[Any], bool, Schema, Schema]] = {}
    for node, values, req, then, other in items:
        key = (canonical_json(values), req)
        if key in merged:
            first = merged[key]
            merged[key] = (first[0], values, req, all_of([first[3], then]), all_of([first[4], other]))
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


def drop_no_ops(rw: Rewriter, out: dict[str, Any], ptr: str, extra: list[Schema]) -> None:
    """Remove what changes nothing; the backend must intersect overlapping schemas, which recursion forbids.

    Keywords that accept everything go, and so does a property whose schema equals that of a match-all
    ``patternProperties`` entry (the name gets both, which is the same schema once).
    """
    if rw.reshape:
        _split_overlaps(rw, out)
    patterns = out.get("patternProperties", {})
    props = out.get("properties", {})
    texts: dict[str, str] = {}
    for name in list(props) if patterns else ():
        hits = [name_matches(p, name) for p in patterns]
        if None in hits or not any(hits):
            continue
        mine = canonical_json(props[name])
        for p, hit in zip(patterns, hits):
            if hit and p not in texts:
                texts[p] = canonical_json(patterns[p])
        if all(texts[p] == mine for p, hit in zip(patterns, hits) if hit):
            del props[name]
    for key, value in list(out.items()):
        if value in _NO_OP.get(key, ()) and not (key == "items" and "additionalItems" in out):
            del out[key]


def _split_overlaps(rw: Rewriter, out: dict[str, Any]) -> None:
    """Give a listed property that a match-all pattern also covers the computed conjunction of both schemas.

    The backend would intersect the two itself, which fails when a reference inside is recursive. With the
    conjunction precomputed, the pattern becomes "every name except those properties": same instances.
    """
    patterns, props = out.get("patternProperties", {}), out.get("properties", {})
    match_all = [p for p in patterns if p in MATCH_ALL]
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
