"""JSON pointers and local ``$ref`` resolution inside one schema document.

Only references that name a place in this document by JSON pointer are resolved here (``#``, ``#/a/b``, or the
root ``$id`` followed by such a fragment). Anchors, other documents and references inside an embedded resource
(a nested ``$id``) are left to the backend; ``parse_local_ref`` returns None for them.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

from radixserve.constrained.schema_types import DEFS, SCHEMA_LISTS, SCHEMA_MAPS, SCHEMA_ONE

_MISSING = object()


def split_pointer(pointer: str) -> list[str]:
    """RFC 6901 reference tokens of ``pointer`` (``""`` is the whole document)."""
    if pointer == "":
        return []
    if not pointer.startswith("/"):
        raise ValueError(f"JSON pointer {pointer!r} must start with '/'")
    return [t.replace("~1", "/").replace("~0", "~") for t in pointer[1:].split("/")]


def lookup(doc: Any, pointer: str) -> Any:
    """The value at ``pointer`` in ``doc``, or ``MISSING`` when the path does not exist."""
    node = doc
    for tok in split_pointer(pointer):
        if isinstance(node, dict) and tok in node:
            node = node[tok]
        elif isinstance(node, list) and tok.isdigit() and int(tok) < len(node):
            node = node[int(tok)]
        else:
            return _MISSING
    return node


MISSING = _MISSING


def root_id(doc: Any) -> str | None:
    if isinstance(doc, dict):
        for key in ("$id", "id"):
            if isinstance(doc.get(key), str):
                return doc[key].split("#", 1)[0]
    return None


def parse_local_ref(ref: Any, doc_id: str | None) -> str | None:
    """The JSON pointer a ``$ref`` names in this document, or None when it is not a local pointer reference."""
    if not isinstance(ref, str):
        return None
    if doc_id and ref.startswith(doc_id + "#"):
        ref = ref[len(doc_id) :]
    if ref == "#":
        return ""
    if ref.startswith("#/"):
        return unquote(ref[1:])
    return None


def iter_refs(node: Any) -> Iterator[dict[str, Any]]:
    """Every dict under ``node`` (inclusive) that has a ``$ref`` key, each object once (shared ones included)."""
    seen: set[int] = set()
    stack = [node]
    while stack:
        cur = stack.pop()
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        if isinstance(cur, dict):
            if "$ref" in cur:
                yield cur
            stack.extend(cur.values())
        elif isinstance(cur, list):
            stack.extend(cur)


def has_embedded_resources(doc: Any) -> bool:
    """True when some subschema other than the root carries an ``$id`` / ``id`` that opens a new resource.

    Conservative: any string-valued ``$id`` / ``id`` below the root counts (even where ``id`` is a property name
    inside ``properties``, which only makes the caller more careful).
    """
    stack = list(doc.values()) if isinstance(doc, dict) else []
    while stack:
        cur = stack.pop()
        if isinstance(cur, dict):
            for key in ("$id", "id"):
                value = cur.get(key)
                if isinstance(value, str) and not value.startswith("#"):
                    return True
            stack.extend(cur.values())
        elif isinstance(cur, list):
            stack.extend(cur)
    return False


# Where a raw user schema holds schemas (the rewriter's keyword sets, plus what it refuses or drops, since these
# schemas are not rewritten yet); everything else is data (``enum``, ``const``, ``default``, ...), never touched.
_ONE_SCHEMA = (*SCHEMA_ONE, "items", "unevaluatedProperties", "unevaluatedItems", "contentSchema")
_SCHEMA_MAP = (*SCHEMA_MAPS, *DEFS, "dependencies")
_SCHEMA_LIST = (*SCHEMA_LISTS, "items")


def rebase_refs(schema: Any, prefix: str) -> Any:
    """A copy of ``schema`` for embedding at JSON pointer ``prefix`` of a larger document: every local pointer
    ``$ref`` (``#``, ``#/...``) is re-pointed to the same place there. A schema with its own ``$id`` is a resource of
    its own (its references resolve against it wherever it sits) and is copied unchanged; so are data keywords."""
    if isinstance(schema, dict) and root_id(schema):  # a non-empty base (an id that is only "#frag" is none)
        return copy.deepcopy(schema)

    def walk(node: Any) -> Any:
        if not isinstance(node, dict):
            return copy.deepcopy(node)
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
                out[key] = "#" + prefix + value[1:]
            elif key in _SCHEMA_LIST and isinstance(value, list):
                out[key] = [walk(v) for v in value]
            elif key in _ONE_SCHEMA:
                out[key] = walk(value)
            elif key in _SCHEMA_MAP and isinstance(value, dict):
                out[key] = {k: walk(v) if isinstance(v, dict) else copy.deepcopy(v) for k, v in value.items()}
            else:
                out[key] = copy.deepcopy(value)
        return out

    return walk(schema)
