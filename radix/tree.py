"""The radix prefix tree: cached token prefixes -> KV-cache slot ids, with locking and LRU eviction."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sortedcontainers import SortedList

from radixserve.radix.node import ChildKey, MatchResult, TreeNode


def _as_list(seq: Sequence[int]) -> list[int]:
    return seq if isinstance(seq, list) else list(seq)


class RadixTree:
    """A radix tree over token ids whose nodes hold the KV-cache slots of cached prefixes.

    The tree never allocates slots: ``insert`` adopts the caller's slots for tokens it did not have, and
    ``evict`` / ``reset`` hand slots back. Every call costs O(tokens in the query + depth of the path), plus
    O(log leaves) per LRU update; nothing scans the whole tree except ``all_slots`` and ``check_integrity``.

    Invariants (verified by :meth:`check_integrity`):
      * every non-root node has non-empty ``tokens``, ``len(tokens) == len(slots)`` and a length that is a
        multiple of ``page_size``; the root has none;
      * ``parent.children[key(child.tokens)] is child`` for every child, with ``key`` the first token
        (page_size == 1) or the tuple of the first page's tokens, and ``child.parent is parent``;
      * ``lock_ref == own_locks + sum(child.lock_ref)`` and ``own_locks >= 0`` on every node, so a locked
        node's ancestors are all locked too;
      * no slot appears twice in the tree;
      * ``evictable_size`` is the token count of nodes with ``lock_ref == 0``, ``protected_size`` that of
        nodes with ``lock_ref > 0``, and ``total_size`` their sum;
      * the LRU order holds exactly the unlocked non-root leaves, each keyed by its current ``last_access``;
      * ``last_access`` never decreases from a child to its parent, and never exceeds the logical clock.

    The clock is a counter bumped once per ``match_prefix`` / ``insert`` (not wall time), so eviction order is
    deterministic. Not thread-safe: the scheduler thread owns the tree.
    """

    def __init__(self, page_size: int = 1) -> None:
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self.page_size = page_size
        self._clock = 0
        self._next_uid = 1
        self._root = TreeNode([], [], None, uid=0, last_access=0)
        # Unlocked leaves by (last_access, uid, node): the first entry is the least recently used.
        self._lru: SortedList = SortedList()
        self._evictable = 0
        self._protected = 0

    # ------------------------------------------------------------------ sizes

    @property
    def root(self) -> TreeNode:
        return self._root

    @property
    def evictable_size(self) -> int:
        """Tokens in nodes that no lock protects."""
        return self._evictable

    @property
    def protected_size(self) -> int:
        """Tokens in nodes protected by at least one lock (on the node or a descendant)."""
        return self._protected

    @property
    def total_size(self) -> int:
        """Tokens (equivalently slots) held by the tree."""
        return self._evictable + self._protected

    @property
    def clock(self) -> int:
        """The logical clock: the ``last_access`` value the latest match or insert stamped."""
        return self._clock

    # ------------------------------------------------------------------ lookups

    def match_prefix(self, tokens: Sequence[int]) -> MatchResult:
        """Longest cached page-aligned prefix of ``tokens``, refreshing LRU time along the path.

        When the match ends inside a node, that node is split so that the returned node ends exactly there.
        """
        toks = _as_list(tokens)
        limit = len(toks) - len(toks) % self.page_size
        tick = self._tick()
        node = self._root
        node.last_access = tick
        slots: list[int] = []
        pos = 0
        while pos < limit:
            child = node.children.get(self._key(toks, pos))
            if child is None:
                break
            n = self._common_len(child.tokens, toks, pos, limit)
            partial = n < len(child.tokens)
            if partial:
                child = self._split(child, n)
            self._touch(child, tick)
            slots.extend(child.slots)
            node = child
            pos += n
            if partial:
                break
        return MatchResult(slots, node)

    def cached_prefix_len(self, tokens: Sequence[int]) -> int:
        """Length of the longest cached page-aligned prefix of ``tokens``, as ``match_prefix`` would report
        it, but without splitting nodes or refreshing LRU time (for peeking, e.g. to order a queue)."""
        toks = _as_list(tokens)
        limit = len(toks) - len(toks) % self.page_size
        node = self._root
        pos = 0
        while pos < limit:
            child = node.children.get(self._key(toks, pos))
            if child is None:
                break
            n = self._common_len(child.tokens, toks, pos, limit)
            pos += n
            if n < len(child.tokens):
                break
            node = child
        return pos

    def insert(self, tokens: Sequence[int], slots: Sequence[int]) -> int:
        """Cache ``tokens[i] -> slots[i]`` for the page-aligned head of ``tokens``.

        Returns how many leading tokens the tree already held: for those it keeps its own slots, so the caller
        must free its duplicates in ``slots[:returned]`` (for whatever part of that range it owns). Slots past
        the returned length and within the page-aligned head now belong to the tree; any unaligned tail stays
        with the caller. New nodes start unlocked and evictable.
        """
        if len(tokens) != len(slots):
            raise ValueError(
                f"insert needs one slot per token, got {len(tokens)} tokens and {len(slots)} slots"
            )
        toks = _as_list(tokens)
        slot_list = _as_list(slots)
        limit = len(toks) - len(toks) % self.page_size
        tick = self._tick()
        node = self._root
        node.last_access = tick
        pos = 0
        while pos < limit:
            child = node.children.get(self._key(toks, pos))
            if child is None:
                self._add_leaf(node, toks[pos:limit], slot_list[pos:limit], tick)
                return pos
            n = self._common_len(child.tokens, toks, pos, limit)
            if n < len(child.tokens):
                # Split even when nothing new follows, so LRU time refreshes exactly the tokens reached.
                child = self._split(child, n)
            self._touch(child, tick)
            node = child
            pos += n
        return pos

    # ------------------------------------------------------------------ locking

    def lock(self, node: TreeNode) -> None:
        """Take one lock on ``node``: it and every ancestor become protected from eviction."""
        path = self._path_to_root(node, "lock")
        node.own_locks += 1
        for n in path:
            if n.lock_ref == 0:
                self._evictable -= len(n.tokens)
                self._protected += len(n.tokens)
                if n.lru_entry is not None:
                    self._lru_remove(n)
            n.lock_ref += 1

    def unlock(self, node: TreeNode) -> None:
        """Release one lock taken on ``node`` by :meth:`lock`; ValueError if it holds none."""
        path = self._path_to_root(node, "unlock")
        if node.own_locks == 0:
            raise ValueError(
                f"unlock of {node!r} without a matching lock(); unlock the exact node that was locked"
            )
        node.own_locks -= 1
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._evictable += len(n.tokens)
                self._protected -= len(n.tokens)
                if not n.children and n is not self._root:
                    self._lru_add(n)

    # ------------------------------------------------------------------ freeing

    def evict(self, num_tokens: int, on_evict: Callable[[TreeNode], None] | None = None) -> list[int]:
        """Free at least ``num_tokens`` tokens (all evictable ones if fewer), least recently used leaf first.

        Whole leaves go, so more than ``num_tokens`` may be freed. A parent whose last child goes becomes a
        candidate leaf itself. Locked nodes are never evicted. Returns the freed slots, which the caller gives
        back to its allocator. ``on_evict(leaf)`` is called for each leaf just before it leaves the tree, while it
        and every ancestor still hold their slots (the KV tier saves their contents then).
        """
        if num_tokens < 0:
            raise ValueError(f"evict needs a non-negative token count, got {num_tokens}")
        freed: list[int] = []
        while len(freed) < num_tokens and self._lru:
            _, _, leaf = self._lru.pop(0)
            leaf.lru_entry = None
            if on_evict is not None:
                on_evict(leaf)
            parent = leaf.parent
            assert parent is not None  # the LRU only holds attached non-root leaves
            del parent.children[self._key(leaf.tokens, 0)]
            leaf.parent = None
            freed.extend(leaf.slots)
            self._evictable -= len(leaf.tokens)
            if not parent.children and parent.lock_ref == 0 and parent is not self._root:
                self._lru_add(parent)
        return freed

    def reset(self) -> list[int]:
        """Drop every cached prefix and return all slots; ValueError while a lock protects any cached token.

        Locks on the root itself (taken after a match of nothing) protect no token, so they survive.
        """
        if self._protected > 0:
            raise ValueError(
                f"reset while locks protect {self._protected} cached tokens; "
                "unlock every request's prefix first"
            )
        freed = self.all_slots()
        # Detached top-level nodes make every dropped node unreachable from the root, so lock() rejects them.
        for child in self._root.children.values():
            child.parent = None
        self._root.children = {}
        self._lru = SortedList()
        self._evictable = 0
        self._protected = 0
        return freed

    def path(self, node: TreeNode) -> tuple[list[int], list[int]]:
        """The tokens and slots from the root to the end of ``node`` (its whole cached prefix); O(its length)."""
        nodes = self._path_to_root(node, "path")
        tokens: list[int] = []
        slots: list[int] = []
        for n in reversed(nodes):
            tokens.extend(n.tokens)
            slots.extend(n.slots)
        return tokens, slots

    def all_slots(self) -> list[int]:
        """Every slot held by the tree, in depth-first order (for accounting checks; O(tree))."""
        out: list[int] = []
        stack = [self._root]
        while stack:
            node = stack.pop()
            out.extend(node.slots)
            stack.extend(node.children.values())
        return out

    # ------------------------------------------------------------------ checking

    def check_integrity(self) -> None:
        """Walk the whole tree; raise RuntimeError naming the first broken invariant (see the class doc)."""
        root = self._root
        if root.tokens or root.slots or root.parent is not None:
            raise RuntimeError("root must have no tokens, no slots and no parent")
        seen_slots: set[int] = set()
        seen_nodes: set[int] = set()
        evictable = protected = 0
        lru_leaves: set[int] = set()
        order: list[TreeNode] = []
        stack = [root]
        while stack:
            node = stack.pop()
            if id(node) in seen_nodes:
                raise RuntimeError(f"node {node!r} is reachable twice (cycle or shared child)")
            seen_nodes.add(id(node))
            order.append(node)
            if node.last_access > self._clock:
                raise RuntimeError(f"last_access of {node!r} is ahead of the clock {self._clock}")
            if node is not root:
                self._check_node_shape(node)
                if node.lock_ref == 0:
                    evictable += len(node.tokens)
                    if not node.children:
                        lru_leaves.add(id(node))
                else:
                    protected += len(node.tokens)
            for slot in node.slots:
                if slot in seen_slots:
                    raise RuntimeError(f"slot {slot} appears twice in the tree")
                seen_slots.add(slot)
            if node.own_locks < 0:
                raise RuntimeError(f"negative own_locks on {node!r}")
            child_refs = 0
            for key, child in node.children.items():
                if child.parent is not node:
                    raise RuntimeError(f"child {child!r} does not point back to its parent {node!r}")
                if not child.tokens or key != self._key(child.tokens, 0):
                    raise RuntimeError(f"child key {key!r} does not match the first page of {child!r}")
                if child.last_access > node.last_access:
                    raise RuntimeError(f"child {child!r} was accessed after its parent {node!r}")
                child_refs += child.lock_ref
                stack.append(child)
            if node.lock_ref != node.own_locks + child_refs:
                raise RuntimeError(
                    f"lock_ref of {node!r} is not own_locks ({node.own_locks}) + children's ({child_refs})"
                )
        if (evictable, protected) != (self._evictable, self._protected):
            raise RuntimeError(
                f"sizes do not add up: counted evictable={evictable} protected={protected}, "
                f"tracked evictable={self._evictable} protected={self._protected}"
            )
        self._check_lru(lru_leaves, order)

    def _check_node_shape(self, node: TreeNode) -> None:
        if not node.tokens:
            raise RuntimeError(f"empty non-root node {node!r}")
        if len(node.tokens) != len(node.slots):
            raise RuntimeError(f"{node!r} has {len(node.slots)} slots for {len(node.tokens)} tokens")
        if len(node.tokens) % self.page_size:
            raise RuntimeError(f"{node!r} length is not a multiple of page_size={self.page_size}")

    def _check_lru(self, lru_leaves: set[int], nodes: list[TreeNode]) -> None:
        in_lru = {id(entry[2]) for entry in self._lru}
        if len(in_lru) != len(self._lru):
            raise RuntimeError("a node appears twice in the LRU order")
        if in_lru != lru_leaves:
            raise RuntimeError(
                f"LRU order holds {len(in_lru)} nodes but the tree has {len(lru_leaves)} unlocked leaves, "
                "or they differ"
            )
        for node in nodes:
            expected = (node.last_access, node.uid, node) if id(node) in lru_leaves else None
            if node.lru_entry != expected:
                raise RuntimeError(f"stale LRU entry {node.lru_entry!r} for {node!r}")

    # ------------------------------------------------------------------ internals

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _key(self, toks: list[int], pos: int) -> ChildKey:
        if self.page_size == 1:
            return toks[pos]
        return tuple(toks[pos : pos + self.page_size])

    def _common_len(self, key: list[int], toks: list[int], pos: int, limit: int) -> int:
        """Page-aligned length of the common prefix of ``key`` and ``toks[pos:limit]``.

        The caller found ``key`` through its child key, so the first page is known to match.
        """
        n = min(len(key), limit - pos)
        # Whole-run comparison runs in C and is the common case (a full-node hit).
        if key[:n] == toks[pos : pos + n]:
            i = n
        else:
            i = self.page_size
            while key[i] == toks[pos + i]:
                i += 1
        return i - i % self.page_size

    def _split(self, node: TreeNode, n: int) -> TreeNode:
        """Split ``node`` after ``n`` tokens; the new head becomes its parent and is returned.

        The head inherits the lock count and the access time of the whole run: every lock on ``node`` still
        covers the head, and nothing about the head's access history changed.
        """
        parent = node.parent
        assert parent is not None  # only attached non-root nodes are split
        head = TreeNode(node.tokens[:n], node.slots[:n], parent, self._new_uid(), node.last_access)
        head.lock_ref = node.lock_ref
        node.tokens = node.tokens[n:]
        node.slots = node.slots[n:]
        node.parent = head
        head.children[self._key(node.tokens, 0)] = node
        parent.children[self._key(head.tokens, 0)] = head
        return head

    def _add_leaf(self, parent: TreeNode, toks: list[int], slots: list[int], tick: int) -> None:
        leaf = TreeNode(toks, slots, parent, self._new_uid(), tick)
        if parent.lru_entry is not None:
            self._lru_remove(parent)
        parent.children[self._key(toks, 0)] = leaf
        self._evictable += len(toks)
        self._lru_add(leaf)

    def _touch(self, node: TreeNode, tick: int) -> None:
        if node.lru_entry is not None:
            self._lru_remove(node)
            node.last_access = tick
            self._lru_add(node)
        else:
            node.last_access = tick

    def _lru_add(self, node: TreeNode) -> None:
        entry = (node.last_access, node.uid, node)
        node.lru_entry = entry
        self._lru.add(entry)

    def _lru_remove(self, node: TreeNode) -> None:
        self._lru.remove(node.lru_entry)
        node.lru_entry = None

    def _new_uid(self) -> int:
        uid = self._next_uid
        self._next_uid += 1
        return uid

    def _path_to_root(self, node: TreeNode, op: str) -> list[TreeNode]:
        """``node`` and its ancestors up to the root; ValueError when ``node`` is not in this tree."""
        if not isinstance(node, TreeNode):
            raise ValueError(f"{op} needs a node handle from match_prefix, got {type(node).__name__}")
        path = [node]
        while (parent := path[-1].parent) is not None:
            path.append(parent)
        if path[-1] is not self._root:
            raise ValueError(
                f"{op} of {node!r}, which is not in this tree (evicted, dropped by reset, or from another "
                "tree); lock the node of a fresh match_prefix instead"
            )
        return path
