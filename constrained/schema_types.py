"""Shared vocabulary of the JSON-schema rewriter: JSON types as atoms, equality, small schema constructors.

Number types are two atoms, ``integer`` and ``fraction`` (non-integer numbers): JSON Schema's ``number`` is both,
``integer`` the first. ``any_of`` / ``all_of`` build unions / intersections and fold ``True`` / ``False``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from radixserve.constrained.spec import canonical_json

Schema = dict[str, Any] | bool

Resolver = Callable[[str], Schema | None]

ATOMS = frozenset({"null", "boolean", "string", "array", "object", "integer", "fraction"})

TYPE_NAMES = ("null", "boolean", "string", "array", "object", "number", "integer")

MAX_DEPTH = 48  # nesting of negations / $ref hops; deeper means a recursive schema

# Keywords with no effect on which instances are valid (plus containers of definitions).
NEUTRAL = frozenset(
    {"$schema", "$id", "id", "$anchor", "$defs", "definitions", "$comment", "title", "description", "default"}
    | {"examples", "deprecated", "readOnly", "writeOnly", "contentMediaType", "contentEncoding", "contentSchema"}
)

VALIDATION_KEYWORDS = frozenset(
    {"type", "enum", "const", "$ref", "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "format"}
    | {"minLength", "maxLength", "pattern", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
    | {"multipleOf", "items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems", "contains"}
    | {"minContains", "maxContains", "properties", "patternProperties", "additionalProperties", "required"}
    | {"minProperties", "maxProperties", "propertyNames", "dependencies", "dependentRequired"}
    | {"dependentSchemas", "unevaluatedItems", "unevaluatedProperties", "$dynamicRef", "$recursiveRef"}
)


class CannotRewrite(Exception):
    """An exact rewrite does not exist (or is not implemented) for this construct; ``str`` says why."""


def type_atoms(name: str) -> frozenset[str]:
    if name == "number":
        return frozenset({"integer", "fraction"})
    return frozenset({name})


def declared_atoms(type_value: Any) -> frozenset[str]:
    names = [type_value] if isinstance(type_value, str) else list(type_value)
    return frozenset().union(*(type_atoms(n) for n in names))


def value_atom(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "integer" if v.is_integer() else "fraction"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


def atoms_to_schema(atoms: Iterable[str], context: frozenset[str] = ATOMS) -> Schema:
    """A schema accepting exactly the values of these atoms, among values whose atoms are in ``context`` (outside
    it, anything: so a context of integers lets "numbers but not integers" be written as False)."""
    atoms = set(atoms) & context
    if not atoms:
        return False
    if atoms | (ATOMS - context) == ATOMS:
        return True
    if "fraction" in atoms and "integer" not in atoms:
        if "integer" in context:
            raise CannotRewrite("the complement contains non-integer numbers but not integers, which has no schema")
        atoms.add("integer")  # no integer is in the context: naming them changes nothing
    names = sorted(a for a in atoms if a not in ("integer", "fraction"))
    if "fraction" in atoms:
        names.append("number")
    elif "integer" in atoms:
        names.append("integer")
    return {"type": names[0] if len(names) == 1 else names}


def json_equal(a: Any, b: Any) -> bool:
    """JSON Schema equality: numbers by value (1 == 1.0), booleans distinct from numbers, deep for containers."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def any_of(parts: list[Schema]) -> Schema:
    parts = [p for p in parts if p is not False]
    if any(p is True for p in parts):
        return True
    if not parts:
        return False
    return parts[0] if len(parts) == 1 else {"anyOf": parts}


def all_of(parts: list[Schema]) -> Schema:
    parts = [p for p in parts if p is not True]
    if any(p is False for p in parts):
        return False
    if not parts:
        return True
    return parts[0] if len(parts) == 1 else {"allOf": parts}


def is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def plain_number(v: float) -> int | float:
    return int(v) if v.is_integer() and abs(v) < 2**53 else v


ARRAY_KEYS = frozenset({"type", "items", "minItems", "maxItems"})

OBJECT_KEYS = frozenset({"type", "properties", "required", "additionalProperties"})


def merge_objects(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any] | None:
    """The object constraints of ``a`` and ``b`` (properties / required / additionalProperties) as one schema,
    without ``type``; None when no object satisfies both. Equal per-name constraints are kept once, and names
    keep the order the backend would give them (``a``'s first)."""
    ra, rb = a.get("additionalProperties", True), b.get("additionalProperties", True)
    pa, pb = a.get("properties", {}), b.get("properties", {})
    props = {k: _conjoin(pa.get(k, ra), pb.get(k, rb)) for k in [*pa, *(k for k in pb if k not in pa)]}
    out: dict[str, Any] = {"properties": props} if props else {}
    required = [*a.get("required", []), *(k for k in b.get("required", []) if k not in a.get("required", []))]
    if any(props.get(k) is False for k in required):
        return None
    if required:
        out["required"] = required
    rest = _conjoin(ra, rb)
    if rest is not True:
        out["additionalProperties"] = rest
    return out


def _conjoin(x: Schema, y: Schema) -> Schema:
    if x is y or (isinstance(x, dict) and isinstance(y, dict) and canonical_json(x) == canonical_json(y)):
        return x
    return all_of([x, y])


class ObjectView:
    """What an object must satisfy per property name, from several conjoined schemas (sound, not complete)."""

    def __init__(self) -> None:
        self.required: set[str] = set()
        self.holders: list[dict[str, Any]] = []

    def schemas(self, key: str) -> list[Schema]:
        """Schemas a value under ``key`` must satisfy; holders with patternProperties are skipped (unknown)."""
        out: list[Schema] = []
        for h in self.holders:
            props = h.get("properties", {})
            if key in props:
                out.append(props[key])
            elif "additionalProperties" in h and not h.get("patternProperties"):
                out.append(h["additionalProperties"])
        return out


Range = tuple[float, bool, float, bool]  # low, low exclusive, high, high exclusive


def num_range(s: dict[str, Any]) -> Range:
    lo, lo_x, hi, hi_x = -math.inf, False, math.inf, False
    emin, emax = s.get("exclusiveMinimum"), s.get("exclusiveMaximum")
    if is_number(s.get("minimum")):
        lo, lo_x = s["minimum"], emin is True
    if is_number(s.get("maximum")):
        hi, hi_x = s["maximum"], emax is True
    if is_number(emin) and emin >= lo:
        lo, lo_x = emin, True
    if is_number(emax) and emax <= hi:
        hi, hi_x = emax, True
    return lo, lo_x, hi, hi_x


def len_range(s: dict[str, Any], what: str) -> Range:
    lo, hi = s.get(f"min{what}", 0), s.get(f"max{what}", math.inf)
    return (lo if is_number(lo) else 0), False, (hi if is_number(hi) else math.inf), False


def ranges_disjoint(a: Range, b: Range) -> bool:
    def before(x: Range, y: Range) -> bool:  # everything in x lies below everything in y
        return x[2] < y[0] or (x[2] == y[0] and (x[3] or y[1]))

    return before(a, b) or before(b, a)


def in_range(v: float, r: Range) -> bool:
    lo, lo_x, hi, hi_x = r
    return (v > lo if lo_x else v >= lo) and (v < hi if hi_x else v <= hi)


SCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas")

SCHEMA_ONE = ("additionalProperties", "additionalItems", "propertyNames", "not", "if", "then", "else", "contains")
SCHEMA_ONE += ("unevaluatedProperties", "unevaluatedItems")

SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")

DEFS = ("$defs", "definitions")

MATCH_ALL = frozenset({"", ".*", "^.*", ".*$"})

IN_PLACE = ("allOf", "anyOf", "oneOf", "not", "if", "$ref", "dependentSchemas", "dependencies")

META = frozenset({"$schema", "$id", "id", "$anchor", *DEFS})

INTERACTING = (
    frozenset({"properties", "patternProperties", "additionalProperties"}),
    frozenset({"items", "additionalItems"}),
    frozenset({"minimum", "exclusiveMinimum"}),
    frozenset({"maximum", "exclusiveMaximum"}),
)
