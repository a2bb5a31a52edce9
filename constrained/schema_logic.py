"""Exact set algebra on JSON schemas that use only the keywords the grammar backend enforces.

``negate(s)`` returns a schema accepting exactly the JSON values ``s`` rejects; ``disjoint(a, b)`` is True only
when no value satisfies both (False means "not proven", never "they overlap"). Whatever cannot be expressed
exactly raises ``CannotRewrite`` with the reason: the caller then rejects the schema instead of weakening it.

Number types are tracked as two atoms, ``integer`` and ``fraction`` (non-integer numbers): JSON Schema's
``number`` is both, ``integer`` is the first. A complement that would need "fraction only" is not expressible by
the backend and raises.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from radixserve.constrained.schema_regex import complement_regex, literal_pattern, negate_pattern
from radixserve.constrained.schema_types import (
    ARRAY_KEYS,
    ATOMS,
    MAX_DEPTH,
    NEUTRAL,
    OBJECT_KEYS,
    VALIDATION_KEYWORDS,
    CannotRewrite,
    ObjectView,
    Resolver,
    Schema,
    all_of,
    any_of,
    atoms_to_schema,
    declared_atoms,
    in_range,
    is_number,
    json_equal,
    len_range,
    merge_objects,
    num_range,
    plain_number,
    ranges_disjoint,
    value_atom,
)


class SchemaAlgebra:
    """Negation and disjointness over schemas whose ``$ref`` targets ``resolve`` returns (already rewritten)."""

    def __init__(self, resolve: Resolver) -> None:
        self.resolve = resolve
        self.complements: dict[str, frozenset[str]] = {}  # patterns built here -> the strings they exclude

    def _target(self, ref: str) -> Schema:
        target = self.resolve(ref)
        if target is None:
            raise CannotRewrite(f"$ref {ref!r} cannot be followed")
        return target

    # ---------------------------------------------------------------- negation
    def negate(self, s: Schema, depth: int = 0, within: Schema = True) -> Schema:
        """The complement of ``s``; exact among values that satisfy ``within`` (use True for all values)."""
        if isinstance(s, bool):
            return not s
        if depth > MAX_DEPTH:
            raise CannotRewrite("negation of a recursive schema")
        parts: list[Schema] = []
        for keys, handler in _NEGATORS:
            if any(k in s for k in keys):
                parts.extend(handler(self, s, depth, within))
        for key in s:
            if key in VALIDATION_KEYWORDS and key not in _NEGATED:
                raise CannotRewrite(f"negating {key!r}")
        return any_of(parts)

    def _neg_ref(self, s: dict[str, Any], depth: int, within: Schema) -> list[Schema]:
        return [self.negate(self._target(s["$ref"]), depth + 1, within)]

    def _neg_type(self, s: dict[str, Any], depth: int, within: Schema) -> list[Schema]:
        return [atoms_to_schema(ATOMS - declared_atoms(s["type"]), self.types(within))]

    def _neg_enum(self, s: dict[str, Any], depth: int, within: Schema) -> list[Schema]:
        values = list(s["enum"])
        touched = {value_atom(v) for v in values}
        if touched & {"integer", "fraction"}:
            touched |= {"integer", "fraction"}
        if touched & {"array", "object"}:
            raise CannotRewrite("negating an enum that lists arrays or objects")
        parts = [atoms_to_schema(ATOMS - touched, self.types(within))]
        bools = [b for b in (False, True) if not any(v is b for v in values)]
        if "boolean" in touched and bools:
            parts.append({"enum": bools})
        strings = [v for v in values if isinstance(v, str)]
        if strings:
            pattern = complement_regex(strings)
            self.complements[pattern] = frozenset(strings)
            parts.append({"type": "string", "pattern": pattern})
        numbers = sorted({float(v) for v in values if is_number(v)})
        if any(math.isinf(v) for v in numbers):
            raise CannotRewrite("negating an infinite number")
        if numbers:
            bounds = [plain_number(v) for v in numbers]
            parts.append({"type": "number", "exclusiveMaximum": bounds[0]})
            parts.extend(
                {"type": "number", "exclusiveMinimum": lo, "exclusiveMaximum": hi} for lo, hi in zip(bounds, bounds[1:])
            )
            parts.append({"type": "number", "exclusiveMinimum": bounds[-1]})
        return parts

    def _neg_string(self, s: dict[str, Any], depth: int, within: Schema) -> list[Schema]:
        parts: list[Schema] = []
        if s.get("minLength", 0) > 0:
            parts.append({"type": "string", "maxLength": s["minLength"] - 1})
        if "maxLength" in s:
            parts.append({"type": "string", "minLength": s["maxLength"] + 1})
        if "pattern" in s:
            parts.append({"type": "string", "pattern": negate_pattern(s["pattern"])})
        if "format" in s:
            raise CannotRewrite(f"negating format {s['format']!r}")
        return parts

    def _neg_number(self, s: dict[str, Any], depth: int, within: Schema) -> list[Schema]:
        if "multipleOf" in s:
            raise CannotRewrite("negating multipleOf")
        parts: list[Schema] = []
        emin, emax = s.get("exclusiveMinimum"), s.get("exclusiveMaximum")
        if "minimum" in s:
            parts.append({"type": "number", ("maximum" if emin is True else "exclusiveMaximum"): s["minimum"]})
        if "maximum" in s:
            parts.append({"type": "number", ("minimum" if emax is True else "exclusiveMinimum"): s["maximum"]})
        if is_number(emin):
            parts.append({"type": "number", "maximum": emin})
        if is_number(emax):
            parts.append({"type": "number", "minimum": emax})
        return parts

    def _neg_array(self, s: dict[str, Any], depth: int, within: Schema) -> list[Schema]:
        parts: list[Schema] = []
        if s.get("minItems", 0) > 0:
            parts.append({"type": "array", "maxItems": s["minItems"] - 1})
        if "maxItems" in s:
            parts.append({"type": "array", "minItems": s["maxItems"] + 1})
        items = s.get("items", True)
        if isinstance(items, list) or s.get("prefixItems") or s.get("additionalItems", True) not in (True, {}):
            raise CannotRewrite("negating tuple-form array items")
        if items is False or (items not in (True, {}) and self._items_disjoint(items, within)):
            parts.append({"type": "array", "minItems": 1})  # any item at all is a witness
        elif items not in (True, {}):
            raise CannotRewrite("negating items (it would need 'contains')")
        if s.get("uniqueItems"):
            raise CannotRewrite("negating uniqueItems")
        return parts

    def _neg_object(self, s: dict[str, Any], depth: int, within: Schema) -> list[Schema]:
        parts: list[Schema] = []
        closed = self.closed_keys(within)  # names an object in the context can have at all (None: any)
        for name in s.get("required", []):
            if closed is not None and name not in closed:
                return [True]  # no object in the context has it: every one fails ``s``
            parts.append({"type": "object", "properties": {name: False}})
        rest = s.get("additionalProperties", True)
        if s.get("patternProperties") or (rest not in (True, {}) and closed is None):
            raise CannotRewrite("negating additionalProperties / patternProperties")
        if rest not in (True, {}):  # among objects limited to known keys, a witness is one of the extra keys
            for name in sorted((closed or frozenset()) - set(s.get("properties", {}))):
                neg = self.negate(rest, depth + 1)
                if neg is not False:
                    parts.append({"type": "object", "required": [name], "properties": {name: neg}})
        for name, sub in s.get("properties", {}).items():
            if closed is not None and name not in closed:
                continue
            neg = self.negate(sub, depth + 1)
            if neg is not False:
                parts.append({"type": "object", "required": [name], "properties": {name: neg}})
        if s.get("minProperties", 0) > 0:
            parts.append({"type": "object", "maxProperties": s["minProperties"] - 1})
        if "maxProperties" in s:
            parts.append({"type": "object", "minProperties": s["maxProperties"] + 1})
        return parts

    def _neg_all_of(self, s: dict[str, Any], depth: int, within: Schema) -> list[Schema]:
        return [self.negate(m, depth + 1, within) for m in s["allOf"]]

    def _neg_any_of(self, s: dict[str, Any], depth: int, within: Schema) -> list[Schema]:
        return [all_of([self.negate(m, depth + 1, within) for m in s["anyOf"]])]

    def _neg_not(self, s: dict[str, Any], depth: int, within: Schema) -> list[Schema]:
        return [s["not"]]

    # ------------------------------------------------------------ disjointness
    def types(self, s: Schema, depth: int = 0) -> frozenset[str]:
        """A superset of the atoms of the values ``s`` accepts."""
        if s is False:
            return frozenset()
        if s is True or depth > MAX_DEPTH:
            return ATOMS
        out = ATOMS
        if "type" in s:
            out &= declared_atoms(s["type"])
        if "enum" in s:
            out &= frozenset(value_atom(v) for v in s["enum"])
        for m in s.get("allOf", []):
            out &= self.types(m, depth + 1)
        if "anyOf" in s:
            out &= frozenset().union(*(self.types(m, depth + 1) for m in s["anyOf"]))
        if "$ref" in s:
            target = self.resolve(s["$ref"])
            if target is not None:
                out &= self.types(target, depth + 1)
        return out

    def disjoint(self, a: Schema, b: Schema, depth: int = 0) -> bool:
        """True when no JSON value satisfies both ``a`` and ``b`` (a sound, incomplete proof)."""
        if a is False or b is False:
            return True
        if a is True or b is True or depth > MAX_DEPTH:
            return False
        for x, y in ((a, b), (b, a)):
            if "$ref" in x:
                target = self.resolve(x["$ref"])
                if target is not None and self.disjoint(target, y, depth + 1):
                    return True
            if any(self.disjoint(m, y, depth + 1) for m in x.get("allOf", [])):
                return True
            if "anyOf" in x and all(self.disjoint(m, y, depth + 1) for m in x["anyOf"]):
                return True
        common = self.types(a, depth) & self.types(b, depth)
        return all(self._disjoint_on(atom, a, b, depth) for atom in common)

    def _disjoint_on(self, atom: str, a: dict[str, Any], b: dict[str, Any], depth: int) -> bool:
        va, vb = finite_values(a, atom), finite_values(b, atom)
        if va is not None and vb is not None:
            return not any(json_equal(x, y) for x in va for y in vb)
        if va is not None:
            return all(self.excludes(b, v, depth + 1) for v in va)
        if vb is not None:
            return all(self.excludes(a, v, depth + 1) for v in vb)
        if atom == "object":
            return self._objects_disjoint(a, b, depth)
        if atom in ("integer", "fraction"):
            return ranges_disjoint(num_range(a), num_range(b))
        if atom == "string":
            return ranges_disjoint(len_range(a, "Length"), len_range(b, "Length"))
        if atom == "array":
            return ranges_disjoint(len_range(a, "Items"), len_range(b, "Items"))
        return False

    def _objects_disjoint(self, a: dict[str, Any], b: dict[str, Any], depth: int) -> bool:
        va, vb = self._object_view(a), self._object_view(b)
        # A name one side requires must carry a value the other side's constraint on that name rejects.
        return any(
            self.disjoint(all_of(va.schemas(k)), all_of(vb.schemas(k)), depth + 1) for k in va.required | vb.required
        )

    def closed_keys(self, s: Schema) -> frozenset[str] | None:
        """The only property names an object satisfying ``s`` can have, when ``s`` closes the object."""
        keys: frozenset[str] | None = None
        for h in self._object_view(s).holders:
            if h.get("additionalProperties") is False and not h.get("patternProperties"):
                names = frozenset(k for k, v in h.get("properties", {}).items() if v is not False)
                keys = names if keys is None else keys & names
        return keys

    def _items_disjoint(self, items: Schema, within: Schema) -> bool:
        """True when every item of an array satisfying ``within`` lies outside ``items``."""
        for h in self._object_view(within).holders:
            other = h.get("items")
            if isinstance(other, dict | bool) and self.disjoint(items, other):
                return True
        return False

    def _object_view(self, s: Schema) -> ObjectView:
        """Required names and per-name constraints of ``s`` gathered through ``allOf`` and ``$ref``."""
        view = ObjectView()
        stack, seen = [s], 0
        while stack and seen < 256:
            x = stack.pop()
            seen += 1
            if not isinstance(x, dict):
                continue
            view.required |= set(x.get("required", []))
            view.holders.append(x)
            stack.extend(x.get("allOf", []))
            if "$ref" in x:
                target = self.resolve(x["$ref"])
                if target is not None:
                    stack.append(target)
        return view

    # ------------------------------------------------------------ intersection
    def intersect(self, a: Schema, b: Schema, depth: int = 0) -> Schema | None:
        """One schema without a reference at the top that means ``a`` and ``b``; None when not computed.

        Covers bare references, unions (branches provably disjoint from the other side are dropped), arrays and
        plain objects; per-property constraints are combined with ``allOf``. Exact where it answers.
        """
        a, b = self._deref(a), self._deref(b)
        if a is True or b is True:
            return b if a is True else a
        if a is False or b is False or depth > MAX_DEPTH:
            return False if a is False or b is False else None
        if "anyOf" in a:  # (rest & opt_1 | rest & opt_2 ...) & b, names in the backend's order
            rest = {k: v for k, v in a.items() if k != "anyOf"}
            heads = [self.intersect(rest, opt, depth + 1) if rest else opt for opt in a["anyOf"]]
            parts = [self.intersect(h, b, depth + 1) if h is not None else None for h in heads]
            return None if any(p is None for p in parts) else any_of(parts)
        if "anyOf" in b:
            rest = {k: v for k, v in b.items() if k != "anyOf"}
            base = self.intersect(a, rest, depth + 1) if rest else a
            if base is None:
                return None
            parts = [self.intersect(base, opt, depth + 1) for opt in b["anyOf"] if not self.disjoint(opt, base)]
            return None if any(p is None for p in parts) else any_of(parts)
        for x, y in ((a, b), (b, a)):  # object-only constraints hold for every value that is not an object
            if set(x) <= OBJECT_KEYS - {"type"} and "object" not in self.types(y):
                return y
        kinds = {x.get("type") if isinstance(x.get("type"), str | None) else "several" for x in (a, b)}
        if kinds == {"array"} and set(a) | set(b) <= ARRAY_KEYS:
            items = self.intersect(a.get("items", True), b.get("items", True), depth + 1)
            if items is None:
                return None
            out: dict[str, Any] = {"type": "array", "items": items}
            if "minItems" in a or "minItems" in b:
                out["minItems"] = max(a.get("minItems", 0), b.get("minItems", 0))
            if "maxItems" in a or "maxItems" in b:
                out["maxItems"] = min(a.get("maxItems", math.inf), b.get("maxItems", math.inf))
            return out
        if set(a) | set(b) <= OBJECT_KEYS:
            return self._merge_typed_objects(a, b)
        return None

    def _merge_typed_objects(self, a: dict[str, Any], b: dict[str, Any]) -> Schema | None:
        atoms = ATOMS
        for x in (a, b):
            if "type" in x:
                atoms &= declared_atoms(x["type"])
        merged = merge_objects(a, b)
        if merged is None:
            atoms -= {"object"}
        if not atoms:
            return False
        out = dict(merged or {})
        if atoms != ATOMS:
            try:
                typed = atoms_to_schema(atoms)
            except CannotRewrite:
                return None
            out.update(typed if isinstance(typed, dict) else {})
        return out

    def _deref(self, s: Schema) -> Schema:
        for _ in range(8):
            if not (isinstance(s, dict) and set(s) - NEUTRAL == {"$ref"}):
                break
            target = self.resolve(s["$ref"])
            if target is None:
                break
            s = target
        return {k: v for k, v in s.items() if k not in NEUTRAL} if isinstance(s, dict) else s

    def excludes(self, s: Schema, v: Any, depth: int = 0) -> bool:
        """True when ``s`` surely rejects the value ``v``."""
        if isinstance(s, bool) or depth > MAX_DEPTH:
            return s is False
        if value_atom(v) not in self.types(s, depth):
            return True
        if "enum" in s and not any(json_equal(v, e) for e in s["enum"]):
            return True
        if isinstance(v, dict):
            view = self._object_view(s)
            if any(k not in v for k in view.required):
                return True
            if any(self.excludes(all_of(view.schemas(k)), x, depth + 1) for k, x in v.items()):
                return True
        if isinstance(v, str) and not in_range(len(v), len_range(s, "Length")):
            return True
        if isinstance(v, str) and isinstance(s.get("pattern"), str):
            literals = literal_pattern(s["pattern"])
            if (literals is not None and v not in literals) or v in self.complements.get(s["pattern"], ()):
                return True
        if is_number(v) and not in_range(v, num_range(s)):
            return True
        if "$ref" in s:
            target = self.resolve(s["$ref"])
            if target is not None and self.excludes(target, v, depth + 1):
                return True
        if any(self.excludes(m, v, depth + 1) for m in s.get("allOf", [])):
            return True
        return "anyOf" in s and all(self.excludes(m, v, depth + 1) for m in s["anyOf"])


_NEGATORS: tuple[tuple[tuple[str, ...], Callable[[SchemaAlgebra, dict[str, Any], int, Schema], list[Schema]]], ...] = (
    (("$ref",), SchemaAlgebra._neg_ref),
    (("type",), SchemaAlgebra._neg_type),
    (("enum",), SchemaAlgebra._neg_enum),
    (("minLength", "maxLength", "pattern", "format"), SchemaAlgebra._neg_string),
    (("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"), SchemaAlgebra._neg_number),
    (("minItems", "maxItems", "items", "prefixItems", "additionalItems", "uniqueItems"), SchemaAlgebra._neg_array),
    (
        ("required", "properties", "patternProperties", "additionalProperties", "minProperties", "maxProperties"),
        SchemaAlgebra._neg_object,
    ),
    (("allOf",), SchemaAlgebra._neg_all_of),
    (("anyOf",), SchemaAlgebra._neg_any_of),
    (("not",), SchemaAlgebra._neg_not),
)

_NEGATED = frozenset(k for keys, _ in _NEGATORS for k in keys)


def finite_values(s: dict[str, Any], atom: str) -> list[Any] | None:
    """The finite set of ``atom`` values ``s`` allows (from enum, or a literal pattern), None when unbounded."""
    values = [v for v in s["enum"] if value_atom(v) == atom] if "enum" in s else None
    if atom == "string" and isinstance(s.get("pattern"), str):
        literals = literal_pattern(s["pattern"])
        if literals is not None:
            values = literals if values is None else [v for v in values if v in literals]
    return values
