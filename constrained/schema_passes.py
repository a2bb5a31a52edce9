"""Whole-document passes after rewriting: place referenced definitions, shape references so the backend can
follow recursive definitions (it cannot intersect a schema with a reference that is still being defined), and fit
numeric bounds to what the backend can hold.

Every pass but ``fit_number_bounds`` keeps the accepted instance set; that one only removes values (huge numbers
next to a bound), never adds any. ``as_draft_2020`` respells a result for standard validators.
"""

from __future__ import annotations

import copy
import math
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from radixserve.constrained import schema_refs as refs
from radixserve.constrained.schema_types import (
    DEFS,
    INTERACTING,
    META,
    SCHEMA_LISTS,
    SCHEMA_MAPS,
    SCHEMA_ONE,
    Schema,
    declared_atoms,
    is_number,
)
from radixserve.constrained.spec import GrammarError, canonical_json, pointer_join

if TYPE_CHECKING:
    from radixserve.constrained.json_schema import Rewriter


def place_refs(rw: Rewriter, out: Schema) -> None:
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


def _place(rw: Rewriter, out: dict[str, Any], ptr: str, target: Schema) -> bool:
    """Put ``target`` at ``ptr`` in the output when the path survives; True when it is (now) there."""
    node: Any = out
    tokens = refs.split_pointer(ptr)
    for depth, tok in enumerate(tokens):
        if isinstance(node, dict):
            if tok not in node:
                parent = tokens[:depth]
                if not parent or parent[-1] not in DEFS:
                    return False
                if refs.lookup(rw.root, pointer_join("", *tokens[: depth + 1])) is refs.MISSING:
                    return False
                node[tok] = rw.at(pointer_join("", *tokens[: depth + 1]))
            node = node[tok]
        elif isinstance(node, list) and tok.isdigit() and int(tok) < len(node):
            node = node[int(tok)]
        else:
            return False
    return node is target


def drop_implied_types(rw: Rewriter, out: Schema) -> None:
    """Remove a ``type`` that the rest of its schema (``$ref`` target, ``anyOf`` branches, ``enum``) implies.

    Exact (R within type => R and type = R), and it leaves bare references and unions, which the backend can
    follow through recursive definitions (a reference with siblings must be intersected, which recursion forbids).
    """
    for node in schema_nodes(out):
        if "type" in node and any(k in node for k in ("$ref", "anyOf", "allOf", "enum")):
            rest = {k: v for k, v in node.items() if k != "type"}
            if rw.algebra.types(rest) <= declared_atoms(node["type"]):
                del node["type"]


def inline_referenced_siblings(rw: Rewriter, out: Schema) -> None:
    """Replace ``{"$ref": X, k: v}`` by ``{**X, k: v}`` when the keywords do not interact.

    Both forms mean X and {k: v}; the merged one needs no intersection with a reference, which the backend
    cannot do inside a recursive definition. Merging is exact when the two keyword sets are disjoint and no
    interacting group (properties / patternProperties / additionalProperties, items / additionalItems) is split.
    """
    stash: dict[str, Schema] = {}
    merged_defs: dict[tuple[str, str], str] = {}
    for node in schema_nodes(out):
        _inline_members(rw, node)
        if "$ref" not in node or not set(node) - META - {"$ref"}:
            continue
        target = rw.resolve(node["$ref"])
        if not isinstance(target, dict):
            continue
        mine, theirs = set(node) - META - {"$ref"}, set(target) - META
        if mine & theirs or any(g & mine and g & theirs for g in INTERACTING):
            continue
        merged = {k: v for k, v in target.items() if k not in META}
        merged.update((k, v) for k, v in node.items() if k not in META and k != "$ref")
        if any(n is node for n in schema_nodes(target)):
            # Recursive: the merged schema becomes a definition of its own, so the node stays a bare reference.
            key = (node["$ref"], canonical_json({k: v for k, v in node.items() if k != "$ref"}))
            if key not in merged_defs:
                name = f"{_STASH_PREFIX}merged_{len(merged_defs)}"
                stash[name] = merged
                merged_defs[key] = f"#/$defs/{name}"
            meta = {k: v for k, v in node.items() if k in META}
            node.clear()
            node.update(meta, **{"$ref": merged_defs[key]})
        else:
            meta = {k: v for k, v in node.items() if k in META}
            node.clear()
            node.update(meta, **merged)
    if stash and isinstance(out, dict):
        out.setdefault("$defs", {}).update(stash)


def _inline_members(rw: Rewriter, node: dict[str, Any]) -> None:
    """In an ``allOf`` / ``anyOf`` that gets intersected with other conjuncts, use targets of bare ``$ref`` members.

    A bare reference and its target mean the same; the target needs no reference resolution while intersecting.
    Skipped when the target contains ``node`` (the result would contain itself).
    """
    conjuncts = len(set(node) - META - {"allOf", "anyOf"}) + len(node.get("allOf", [])) + ("anyOf" in node)
    if conjuncts < 2:
        return
    for key in ("allOf", "anyOf"):
        members = node.get(key, [])
        for i, member in enumerate(members):
            if isinstance(member, dict) and set(member) == {"$ref"}:
                target = rw.resolve(member["$ref"])
                if isinstance(target, dict) and not any(n is node for n in schema_nodes(target)):
                    members[i] = target


def materialize_all_of(rw: Rewriter, out: Schema) -> None:
    """Replace an ``allOf`` by the single schema it means, where ``SchemaAlgebra.intersect`` computes one.

    The backend intersects ``allOf`` members itself, but it recurses forever on two recursive schemas that
    repeat the same reference (``additionalProperties: {$ref: X}`` on both sides); the computed form keeps
    such a reference once.
    """
    for _ in range(8):  # a merged node may hold new allOf nodes (per-name conjunctions); revisit until stable
        changed = False
        for node in schema_nodes(out):
            members = node.get("allOf")
            if not members or len(members) + len(set(node) - META - {"allOf"}) < 2:
                continue
            result: Schema | None = {k: v for k, v in node.items() if k not in META and k != "allOf"} or True
            for member in members:
                result = rw.algebra.intersect(result, member) if result is not None else None
            if isinstance(result, dict) and "$ref" not in result:
                meta = {k: v for k, v in node.items() if k in META}
                node.clear()
                node.update(meta, **result)
                changed = True
        if not changed:
            return


# The backend reads numbers as doubles and builds its number lexers on 64-bit integers: an integer bound past 2**53
# is rounded to the nearest double, possibly outward (``maximum: 9007199254740995`` admitted 9007199254740996); an
# exclusive integer bound from 2**53 on admits the bound itself (it moves it by one, which rounds back); and a
# bound past about 9.2e18 (``minimum: -2**63``, the usual int64 range) does not compile at all.
EXACT_INTEGERS = 2**53
BOUND_LIMIT = 9 * 10**18  # a double, and inside what the backend compiles (+-2**63 is not)
_SIDES = (("minimum", "exclusiveMinimum", True), ("maximum", "exclusiveMaximum", False))


def fit_number_bounds(out: Schema) -> None:
    """Move every numeric bound the backend cannot hold exactly inward, to a value close by that it can (a double
    whose shortest text is exact, within +-9e18); exclusive bounds from 2**53 on become inclusive ones just inside.
    Values between the old and the new bound are given up (for an int64 range, the outermost 2.4% on each side);
    no value the user's bound excludes is ever admitted. A lower bound already above 9e18 (or an upper one below
    -9e18) has no inward value the backend holds and is left for it to refuse."""
    for node in schema_nodes(out):
        before = {k: node[k] for k in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum") if k in node}
        for inclusive, exclusive, lower in _SIDES:
            strict = node.get(exclusive)
            if strict is True and is_number(node.get(inclusive)):  # draft 4: the inclusive keyword is the bound
                strict = node.pop(inclusive)
                del node[exclusive]
            elif is_number(strict):
                del node[exclusive]
            else:
                strict = None
            if strict is not None:
                if abs(strict) < EXACT_INTEGERS or _far_side(strict, lower):
                    node[exclusive] = strict  # held exactly, or refused by the backend either way
                else:
                    bound, current = _past(strict, lower), node.get(inclusive)
                    if not is_number(current) or (bound > current if lower else bound < current):
                        node[inclusive] = bound
            value = node.get(inclusive)
            if is_number(value) and abs(value) > EXACT_INTEGERS:
                node[inclusive] = _inward(value, lower)
        low, high = node.get("minimum"), node.get("maximum")
        if is_number(low) and is_number(high) and low > high and before != {"minimum": low, "maximum": high}:
            raise GrammarError(
                f"the range {canonical_json(before)} lies between two neighbouring numbers the grammar engine holds "
                "exactly (past 2**53 it holds only some integers): widen it",
                kind="unsupported",
                keyword="minimum",
            )


def _far_side(value: int | float, lower: bool) -> bool:
    return value > BOUND_LIMIT if lower else value < -BOUND_LIMIT


def _inward(value: int | float, lower: bool) -> int | float:
    """The nearest value the backend holds on the inside of the inclusive bound ``value``."""
    if lower and value < -BOUND_LIMIT:
        return -BOUND_LIMIT
    if not lower and value > BOUND_LIMIT:
        return BOUND_LIMIT
    if abs(value) > BOUND_LIMIT:
        return value  # past the limit on the far side: the backend refuses it clearly
    return _held(int(value), lower)  # past 2**53 every double is an integer


def _past(value: int | float, lower: bool) -> int | float:
    """The nearest value the backend holds strictly inside the exclusive bound ``value`` (not on the far side)."""
    return _inward(math.floor(value) + 1 if lower else math.ceil(value) - 1, lower)


def _held(value: int, lower: bool) -> int:
    """The first multiple of 10**k (k = 0, 1, ...) at or inside ``value`` (up for a lower bound) that the backend
    reads exactly both ways it reads a bound: as a double (integer ranges) and as the decimal its shortest text
    spells (number ranges: ``maximum: 2**60`` became 1152921504606847000 there). Below 9e18 one is found for
    k <= 10 (a multiple of 10**10 is one of 2**10, the spacing of doubles there, and has few digits)."""
    step = 1
    while True:
        held = -(-value // step) * step if lower else value // step * step
        if float(held) == held and Decimal(repr(float(held))) == held:
            return held
        step *= 10


def schema_nodes(root: Schema) -> list[dict[str, Any]]:
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
            if key in (*SCHEMA_MAPS, *DEFS):
                stack.extend(value.values())
            elif key in (*SCHEMA_LISTS, "items") and isinstance(value, list):
                stack.extend(value)
            elif key in (*SCHEMA_ONE, "items"):
                stack.append(value)
    return out


def as_draft_2020(schema: Schema) -> Schema:
    """A rewritten schema spelled in draft 2020-12 (tuple ``items`` -> ``prefixItems``), for standard validators.

    The backend reads both spellings; ``jsonschema``'s 2020-12 validator needs this one to check exactness.
    """
    out = copy.deepcopy(schema)
    for node in schema_nodes(out):
        if node is not out:
            node.pop("$schema", None)  # a nested dialect switch would make the validator read it differently
        if isinstance(node.get("items"), list):
            node["prefixItems"] = node.pop("items")
            if "additionalItems" in node:
                node["items"] = node.pop("additionalItems")
    if isinstance(out, dict):
        out["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return out
