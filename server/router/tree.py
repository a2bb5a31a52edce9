"""An approximate radix tree over request *text*: what a router has sent to one replica, for prefix affinity.

The router cannot see a replica's real KV cache (that is a tree of token ids inside the engine), so it keeps its
own record of the texts it routed there, and assumes the replica still caches what was sent to it recently.
"Approximate" because the record is of characters, not tokens, and because the replica evicts on its own.

Invariants (``check()`` verifies them):
  * every edge label (``_Node.key``) is non-empty, except the root's, and a node's children are keyed by the first
    character of their label, so at most one child can continue a given text;
  * ``chars`` is the sum of all edge label lengths: the memory the tree stands for, which ``prune`` bounds;
  * a node's ``last_access`` is >= each of its children's: ``insert`` touches the whole path it walks, with a
    logical clock that only grows, so the least recently used node is always a leaf and pruning leaves in LRU
    order keeps every surviving path intact.

Not thread-safe: one owner (the routing policy, under its lock) calls it.
"""

from __future__ import annotations

import heapq
import itertools


class _Node:
    __slots__ = ("children", "key", "last_access", "parent")

    def __init__(self, key: str, parent: _Node | None, last_access: int) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[str, _Node] = {}
        self.last_access = last_access


def common_prefix_len(label: str, text: str, start: int) -> int:
    """Length of the common prefix of ``label`` and ``text[start:]`` (string compares run in C)."""
    if text.startswith(label, start):
        return len(label)
    lo, hi = 0, min(len(label), len(text) - start)
    while lo < hi:  # binary search for the longest equal slice
        mid = (lo + hi + 1) // 2
        if label[:mid] == text[start : start + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixTree:
    """A character radix tree with LRU pruning. ``match`` reads, ``insert`` records, ``prune`` forgets."""

    def __init__(self) -> None:
        self._clock = itertools.count(1)
        self._root = _Node("", None, 0)
        self._chars = 0

    @property
    def chars(self) -> int:
        """Characters stored (the sum of edge label lengths)."""
        return self._chars

    def clear(self) -> None:
        self._root = _Node("", None, 0)
        self._chars = 0

    def match(self, text: str) -> int:
        """How many leading characters of ``text`` the tree holds. Does not count as a use (no LRU update)."""
        node, pos = self._root, 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                break
            n = common_prefix_len(child.key, text, pos)
            pos += n
            if n < len(child.key):
                break
            node = child
        return pos

    def insert(self, text: str) -> None:
        """Record ``text``: its path becomes the most recently used, new characters are added as one leaf."""
        now = next(self._clock)
        node, pos = self._root, 0
        node.last_access = now
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                leaf = _Node(text[pos:], node, now)
                node.children[text[pos]] = leaf
                self._chars += len(leaf.key)
                return
            n = common_prefix_len(child.key, text, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node, pos = child, pos + n

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut ``child``'s label after ``n`` chars (0 < n < len): a new middle node takes the head. Total chars
        are unchanged; the middle node inherits ``child``'s access time, so the LRU order still holds."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        mid = _Node(child.key[:n], parent, child.last_access)
        parent.children[mid.key[0]] = mid
        child.key = child.key[n:]
        child.parent = mid
        mid.children[child.key[0]] = child
        return mid

    def prune(self, budget: int) -> int:
        """Remove least recently used leaves until at most ``budget`` chars remain; return the chars removed.

        A whole leaf goes at a time (so the result may undershoot the budget by up to one leaf's label); a parent
        left childless becomes a leaf and a candidate in turn. Inner nodes left with one child are not merged:
        that costs a node, never correctness.
        """
        if self._chars <= budget:
            return 0
        tie = itertools.count()
        heap: list[tuple[int, int, _Node]] = []
        stack = [self._root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self._root:
                heap.append((node.last_access, next(tie), node))
        heapq.heapify(heap)
        removed = 0
        while self._chars > budget and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            self._chars -= len(leaf.key)
            removed += len(leaf.key)
            if parent is not self._root and not parent.children:
                heapq.heappush(heap, (parent.last_access, next(tie), parent))
        return removed

    def check(self) -> None:
        """Raise ``AssertionError`` if an invariant of the module docstring does not hold."""
        total = 0
        stack = [self._root]
        while stack:
            node = stack.pop()
            for first, child in node.children.items():
                assert child.key and child.key[0] == first, (first, child.key)
                assert child.parent is node
                assert child.last_access <= node.last_access, "a child is more recent than its parent"
                total += len(child.key)
                stack.append(child)
        assert total == self._chars, (total, self._chars)
