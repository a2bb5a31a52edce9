"""Nodes of the radix tree and the result of a prefix match.

A node is one edge of the tree: a run of token ids together with the KV-cache slot ids that hold their keys
and values. Outside :class:`radix.tree.RadixTree` a node is an opaque handle (a lock target); its fields are
read-only for everyone but the tree.
"""

from __future__ import annotations

from dataclasses import dataclass

# A child is found by its first token (page_size == 1) or by the tuple of its first page's tokens.
ChildKey = int | tuple[int, ...]
# Position of an evictable leaf in the LRU order; ``uid`` breaks ties so two nodes are never compared.
LruEntry = tuple[int, int, "TreeNode"]


class TreeNode:
    """One run of tokens and the slots that hold them.

    Fields:
      * ``tokens`` / ``slots``: equally long lists; ``slots[i]`` holds the KV of ``tokens[i]``. Empty only for
        the root.
      * ``parent`` / ``children``: ``children`` maps the child key of each child's ``tokens`` to that child.
        ``parent`` is None for the root and for a node that has left the tree (evicted or dropped by reset).
      * ``own_locks``: locks taken on this very node; ``lock_ref``: locks taken on this node or any
        descendant, i.e. ``own_locks + sum(child.lock_ref)``. A node with ``lock_ref > 0`` is protected
        from eviction.
      * ``last_access``: value of the tree's logical clock when a match or insert last reached this node.
      * ``uid``: creation number, unique within the tree; ``lru_entry``: the node's entry in the LRU order
        while it is an unlocked non-root leaf, else None.

    A split keeps this object as the *tail* and gives the head to a new parent, so a handle keeps denoting the
    same end position (the same token prefix) for as long as it stays in the tree.
    """

    __slots__ = (
        "tokens",
        "slots",
        "parent",
        "children",
        "own_locks",
        "lock_ref",
        "last_access",
        "uid",
        "lru_entry",
    )

    def __init__(
        self,
        tokens: list[int],
        slots: list[int],
        parent: TreeNode | None,
        uid: int,
        last_access: int,
    ) -> None:
        self.tokens = tokens
        self.slots = slots
        self.parent = parent
        self.children: dict[ChildKey, TreeNode] = {}
        self.own_locks = 0
        self.lock_ref = 0
        self.last_access = last_access
        self.uid = uid
        self.lru_entry: LruEntry | None = None

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        head = self.tokens[:8]
        more = "..." if len(self.tokens) > 8 else ""
        return (
            f"TreeNode(uid={self.uid}, tokens={head}{more} ({len(self.tokens)}), lock_ref={self.lock_ref}, "
            f"last_access={self.last_access}, children={len(self.children)})"
        )


@dataclass(frozen=True)
class MatchResult:
    """The longest cached prefix of a query.

    ``slots[i]`` holds the KV of the query's token ``i``; ``node`` ends exactly at ``len(slots)`` tokens (the
    root when nothing matched) and is the handle to lock while those slots are in use.
    """

    slots: list[int]
    node: TreeNode

    @property
    def length(self) -> int:
        return len(self.slots)
