"""Tests of the radix prefix tree: unit tests per behaviour, then a stateful property test against a model."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve.radix import MatchResult, RadixTree, TreeNode


def _tree_with(*runs: tuple[list[int], list[int]], page_size: int = 1) -> RadixTree:
    tree = RadixTree(page_size)
    for tokens, slots in runs:
        tree.insert(tokens, slots)
    tree.check_integrity()
    return tree


# ---------------------------------------------------------------------- unit tests


def test_empty_tree_matches_nothing() -> None:
    tree = RadixTree()
    m = tree.match_prefix([1, 2, 3])
    assert isinstance(m, MatchResult)
    assert m.slots == [] and m.length == 0 and m.node is tree.root
    assert tree.total_size == 0 and tree.evict(5) == [] and tree.all_slots() == []
    tree.check_integrity()


def test_insert_then_match_full_and_partial() -> None:
    tree = _tree_with(([1, 2, 3, 4], [10, 11, 12, 13]))
    assert tree.match_prefix([1, 2, 3, 4, 5]).slots == [10, 11, 12, 13]
    assert tree.match_prefix((1, 2, 3)).slots == [10, 11, 12]
    assert tree.match_prefix([2, 1]).slots == []
    assert tree.total_size == 4 and tree.evictable_size == 4 and tree.protected_size == 0
    tree.check_integrity()


def test_match_splits_inside_a_node() -> None:
    tree = _tree_with(([1, 2, 3, 4], [10, 11, 12, 13]))
    tail = tree.match_prefix([1, 2, 3, 4]).node
    m = tree.match_prefix([1, 2, 9])
    assert m.slots == [10, 11]
    assert isinstance(m.node, TreeNode) and m.node.tokens == [1, 2] and m.node.slots == [10, 11]
    # The old handle keeps its identity as the tail, so it still ends at the full prefix.
    assert tail.parent is m.node and tail.tokens == [3, 4]
    assert tree.match_prefix([1, 2, 3, 4]).node is tail
    assert tree.total_size == 4
    tree.check_integrity()


def test_insert_returns_length_already_cached_and_keeps_tree_slots() -> None:
    tree = _tree_with(([1, 2, 3, 4], [10, 11, 12, 13]))
    assert tree.insert([1, 2, 5, 6], [20, 21, 22, 23]) == 2
    assert tree.match_prefix([1, 2, 5, 6]).slots == [10, 11, 22, 23]
    assert tree.insert([1, 2, 3, 4], [30, 31, 32, 33]) == 4
    assert tree.insert([1, 2], [40, 41]) == 2
    assert tree.insert([1, 2, 3, 4, 7], [50, 51, 52, 53, 54]) == 4
    assert tree.match_prefix([1, 2, 3, 4, 7]).slots == [10, 11, 12, 13, 54]
    assert tree.insert([], []) == 0
    assert sorted(tree.all_slots()) == [10, 11, 12, 13, 22, 23, 54]
    assert tree.total_size == 7
    tree.check_integrity()


def test_insert_rejects_length_mismatch() -> None:
    tree = RadixTree()
    with pytest.raises(ValueError, match="one slot per token"):
        tree.insert([1, 2, 3], [1, 2])
    assert tree.total_size == 0


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_page_size_validation(bad: object) -> None:
    with pytest.raises(ValueError, match="page_size"):
        RadixTree(bad)  # type: ignore[arg-type]


def test_lock_protects_node_and_ancestors() -> None:
    tree = _tree_with(([1, 2, 3, 4], [10, 11, 12, 13]), ([1, 2, 5], [20, 21, 22]))
    m = tree.match_prefix([1, 2, 5])
    tree.lock(m.node)
    assert tree.protected_size == 3 and tree.evictable_size == 2
    tree.check_integrity()
    assert sorted(tree.evict(100)) == [12, 13]
    assert tree.evictable_size == 0 and tree.total_size == 3
    assert tree.match_prefix([1, 2, 5]).slots == [10, 11, 22]
    tree.check_integrity()
    tree.unlock(m.node)
    assert tree.protected_size == 0 and tree.evictable_size == 3
    assert sorted(tree.evict(1)) == [22]  # the leaf goes first; the parent only becomes a leaf then
    assert sorted(tree.evict(1)) == [10, 11]
    assert tree.total_size == 0
    tree.check_integrity()


def test_locks_nest_and_unlock_is_checked() -> None:
    tree = _tree_with(([1, 2, 3], [10, 11, 12]))
    node = tree.match_prefix([1, 2, 3]).node
    tree.lock(node)
    tree.lock(node)
    tree.unlock(node)
    assert tree.protected_size == 3 and tree.evict(10) == []
    tree.unlock(node)
    with pytest.raises(ValueError, match="without a matching lock"):
        tree.unlock(node)
    # An ancestor that is locked only through its child was never locked itself.
    tree.lock(node)
    parent = tree.match_prefix([1]).node
    assert parent is node.parent
    with pytest.raises(ValueError, match="without a matching lock"):
        tree.unlock(parent)
    tree.check_integrity()


def test_lock_survives_split_above_the_handle() -> None:
    tree = _tree_with(([1, 2, 3, 4], [10, 11, 12, 13]))
    node = tree.match_prefix([1, 2, 3, 4]).node
    tree.lock(node)
    head = tree.match_prefix([1, 2]).node
    assert head is not node and head.lock_ref == 1 and tree.protected_size == 4
    tree.check_integrity()
    tree.unlock(node)
    assert tree.protected_size == 0 and tree.evictable_size == 4
    tree.check_integrity()


def test_reset_refuses_while_tokens_are_locked() -> None:
    tree = _tree_with(([1, 2], [10, 11]), ([3], [30]))
    node = tree.match_prefix([1, 2]).node
    tree.lock(node)
    with pytest.raises(ValueError, match="unlock"):
        tree.reset()
    tree.unlock(node)
    assert sorted(tree.reset()) == [10, 11, 30]
    assert tree.total_size == 0 and tree.match_prefix([1, 2]).slots == [] and tree.evict(10) == []
    with pytest.raises(ValueError, match="not in this tree"):
        tree.lock(node)
    tree.check_integrity()


def test_root_lock_protects_nothing_and_survives_reset() -> None:
    tree = _tree_with(([1, 2], [10, 11]))
    root = tree.match_prefix([7]).node
    assert root is tree.root
    tree.lock(root)
    assert tree.protected_size == 0 and tree.evictable_size == 2
    assert sorted(tree.reset()) == [10, 11]
    tree.check_integrity()
    tree.unlock(root)
    assert tree.root.lock_ref == 0
    tree.check_integrity()


def test_cached_prefix_len_peeks_without_side_effects() -> None:
    tree = _tree_with(([1, 2, 3, 4], [10, 11, 12, 13]), ([1, 2, 5, 6], [20, 21, 22, 23]), page_size=2)
    clock, nodes = tree.clock, len(tree.root.children[(1, 2)].children)
    assert tree.cached_prefix_len([1, 2, 3, 4, 5]) == 4
    assert tree.cached_prefix_len([1, 2, 3, 9]) == 2
    assert tree.cached_prefix_len([1, 2, 3]) == 2
    assert tree.cached_prefix_len([9]) == 0
    assert tree.cached_prefix_len([1, 2, 1, 2]) == 2  # a partial node match ends the walk
    assert tree.clock == clock and len(tree.root.children[(1, 2)].children) == nodes
    tree.check_integrity()


def test_lock_rejects_evicted_and_foreign_nodes() -> None:
    tree = _tree_with(([1, 2], [10, 11]))
    node = tree.match_prefix([1, 2]).node
    assert tree.evict(1) == [10, 11]
    with pytest.raises(ValueError, match="not in this tree"):
        tree.lock(node)
    other = _tree_with(([1], [5]))
    with pytest.raises(ValueError, match="not in this tree"):
        tree.lock(other.match_prefix([1]).node)
    with pytest.raises(ValueError, match="node handle"):
        tree.lock("node")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-negative"):
        tree.evict(-1)
    tree.check_integrity()


def test_evict_in_lru_order() -> None:
    tree = _tree_with(([1], [10]), ([2], [20]), ([3, 3], [30, 31]))
    tree.match_prefix([1, 5])  # refresh [1]; [2] is now the least recently used
    assert tree.evict(1) == [20]
    tree.insert([3, 3, 4], [32, 33, 34])  # refreshes [3, 3] and adds a leaf under it
    assert tree.evict(1) == [10]
    assert tree.evict(1) == [34]
    assert tree.evict(1) == [30, 31]  # whole nodes go, so more than asked may be freed
    assert tree.total_size == 0
    tree.check_integrity()


def test_split_tail_keeps_its_older_access_time() -> None:
    tree = _tree_with(([1, 2, 3], [10, 11, 12]), ([5], [50]))
    tree.match_prefix([1])  # split: [1] is fresh, [2, 3] keeps its access time, older than [5]
    assert tree.match_prefix([1]).node.last_access == tree.clock
    assert tree.evict(1) == [11, 12]
    assert tree.evict(1) == [50]
    assert tree.evict(1) == [10]
    tree.check_integrity()


def test_evict_frees_at_least_what_was_asked_or_everything() -> None:
    tree = _tree_with(([1, 1, 1], [1, 2, 3]), ([2, 2, 2], [4, 5, 6]))
    assert len(tree.evict(4)) == 6
    tree = _tree_with(([1, 1, 1], [1, 2, 3]))
    assert sorted(tree.evict(100)) == [1, 2, 3]
    assert tree.evict(0) == []


def test_last_access_uses_a_monotonic_counter() -> None:
    tree = _tree_with(([1, 2], [10, 11]))
    before = tree.match_prefix([1, 2]).node.last_access
    node = tree.match_prefix([1, 2]).node
    assert node.last_access == before + 1 == tree.clock
    tree.lock(node)
    assert node.last_access == tree.clock  # locking is not an access


def test_page_size_two_alignment() -> None:
    tree = RadixTree(page_size=2)
    assert tree.insert([1, 2, 3], [10, 11, 12]) == 0  # only [1, 2] is inserted; slot 12 stays with the caller
    assert tree.total_size == 2 and sorted(tree.all_slots()) == [10, 11]
    assert tree.match_prefix([1, 2, 3]).slots == [10, 11]
    assert tree.match_prefix([1]).slots == []
    assert tree.insert([1, 2, 3, 4, 5, 6], [20, 21, 22, 23, 24, 25]) == 2
    # A mismatch inside a page drops the whole page: [1, 2, 3, 9] shares only [1, 2] page-wise.
    m = tree.match_prefix([1, 2, 3, 9])
    assert m.slots == [10, 11] and m.node.tokens == [1, 2]
    m = tree.match_prefix([1, 2, 3, 4, 5, 7])
    assert m.slots == [10, 11, 22, 23] and m.node.tokens == [3, 4]
    assert tree.insert([1, 2, 3, 5], [30, 31, 32, 33]) == 2  # [3, 5] is a sibling page of [3, 4]
    assert set(tree.match_prefix([1, 2]).node.children) == {(3, 4), (3, 5)}
    assert tree.match_prefix([1, 2, 3, 5]).slots == [10, 11, 32, 33]
    tree.check_integrity()


def test_check_integrity_detects_corruption() -> None:
    tree = _tree_with(([1, 2, 3], [10, 11, 12]), ([1, 4], [20, 21]))
    node = tree.match_prefix([1, 4]).node
    node.lock_ref += 1
    with pytest.raises(RuntimeError, match="lock_ref"):
        tree.check_integrity()
    node.lock_ref -= 1
    node.slots[0] = 10
    with pytest.raises(RuntimeError, match="appears twice"):
        tree.check_integrity()
    node.slots[0] = 21
    tree.root.last_access = tree.clock + 5
    with pytest.raises(RuntimeError, match="clock"):
        tree.check_integrity()
    tree.root.last_access = tree.clock
    node.parent.last_access -= 1
    with pytest.raises(RuntimeError, match="accessed after its parent"):
        tree.check_integrity()


# ---------------------------------------------------------------------- property test

POOL = 40  # small enough that allocation regularly has to evict


class RadixMachine(RuleBasedStateMachine):
    """Drives the tree the way the engine does, against a model of cached prefixes and a slot allocator.

    The model maps every cached page-aligned token prefix (a tuple) to the slots of its last page, so it is
    prefix-closed, and ``free`` is a LIFO free list, so freed slots are handed out again at once (which
    exposes any stale slot a match might return). ``time`` holds, per cached page, the model's own clock at
    the last match or insert that reached it: every page of a tree node shares one access time, so evicting
    least-recently-used leaves first means no evicted page is newer than an unlocked leaf page left behind.
    """

    page_size = 1

    def __init__(self) -> None:
        super().__init__()
        self.tree = RadixTree(self.page_size)
        self.free: list[int] = list(range(POOL))
        self.model: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.locks: list[tuple[TreeNode, tuple[int, ...]]] = []
        self.time: dict[tuple[int, ...], int] = {}
        self.clock = 0

    # -- helpers

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    def _model_match_len(self, seq: list[int]) -> int:
        n, page = 0, self.page_size
        while n + page <= len(seq) and tuple(seq[: n + page]) in self.model:
            n += page
        return n

    def _model_slots(self, seq: Sequence[int], n: int) -> list[int]:
        page = self.page_size
        return [slot for end in range(page, n + 1, page) for slot in self.model[tuple(seq[:end])]]

    def _held(self) -> list[int]:
        return [slot for page in self.model.values() for slot in page]

    def _protected(self) -> set[tuple[int, ...]]:
        page = self.page_size
        return {prefix[:end] for _, prefix in self.locks for end in range(page, len(prefix) + 1, page)}

    def _reached(self, seq: Sequence[int], n: int) -> None:
        self.clock += 1
        assert self.tree.clock == self.clock
        for end in range(self.page_size, n + 1, self.page_size):
            self.time[tuple(seq[:end])] = self.clock

    def _match(self, seq: list[int]) -> MatchResult:
        m = self.tree.match_prefix(seq)
        self._reached(seq, m.length)
        self._check_match(seq, m)
        return m

    def _insert(self, seq: list[int], slots: list[int]) -> int:
        k = self.tree.insert(seq, slots)
        self._reached(seq, self._aligned(len(seq)))
        return k

    def _check_match(self, seq: list[int], m: MatchResult) -> None:
        n = self._model_match_len(seq)
        assert m.length == n
        assert m.slots == self._model_slots(seq, n)
        assert not set(m.slots) & set(self.free), "match returned a freed slot"

    def _on_evicted(self, freed: list[int], asked: int, evictable_before: int) -> None:
        owner = {slot: prefix for prefix, page in self.model.items() for slot in page}
        freed_set = set(freed)
        assert len(freed_set) == len(freed)
        assert freed_set <= owner.keys(), "evict returned a slot the tree did not hold"
        protected = self._protected()
        newest = 0
        for prefix in {owner[slot] for slot in freed}:
            assert prefix not in protected, "a locked prefix was evicted"
            assert set(self.model[prefix]) <= freed_set, "evict freed part of a page"
            del self.model[prefix]
            newest = max(newest, self.time.pop(prefix))
        page = self.page_size
        assert all(p[:-page] in self.model for p in self.model if len(p) > page), "eviction left an orphan"
        inner = {p[:-page] for p in self.model}
        leaves = [p for p in self.model if p not in inner and p not in protected]
        assert all(self.time[p] >= newest for p in leaves), "evicted a page newer than a remaining leaf"
        if len(freed) < asked:
            assert len(freed) == evictable_before and self.tree.evictable_size == 0
        self.free.extend(freed)

    def _alloc(self, n: int) -> list[int] | None:
        if len(self.free) < n:
            before = self.tree.evictable_size
            asked = n - len(self.free)
            self._on_evicted(self.tree.evict(asked), asked, before)
        if len(self.free) < n:
            return None
        return [self.free.pop() for _ in range(n)]

    def _adopt(self, seq: list[int], slots: list[int], start: int) -> None:
        """Record that the tree now holds ``slots[start:aligned]``; the unaligned tail goes back."""
        limit, page = self._aligned(len(seq)), self.page_size
        for i in range(start, limit, page):
            self.model[tuple(seq[: i + page])] = tuple(slots[i : i + page])
        self.free.extend(slots[limit:])

    # -- rules

    @rule(seq=st.lists(st.integers(0, 3), max_size=10))
    def match(self, seq: list[int]) -> None:
        peeked = self.tree.cached_prefix_len(seq)
        assert self._match(seq).length == peeked

    @rule(seq=st.lists(st.integers(0, 3), max_size=10))
    def admit_and_insert(self, seq: list[int]) -> None:
        """Admission: match and lock, compute the rest into fresh slots, insert, release."""
        m = self._match(seq)
        self.tree.lock(m.node)
        self.locks.append((m.node, tuple(seq[: m.length])))
        new = self._alloc(len(seq) - m.length)
        if new is not None:
            slots = m.slots + new
            assert self._insert(seq, slots) == m.length
            self._adopt(seq, slots, m.length)
        self.tree.unlock(m.node)
        self.locks.pop()

    @rule(seq=st.lists(st.integers(0, 3), max_size=10))
    def insert_owned_copy(self, seq: list[int]) -> None:
        """The caller owns a slot for every token: whatever the tree already had is a duplicate to free."""
        slots = self._alloc(len(seq))
        if slots is None:
            return
        expected = self._model_match_len(seq)
        k = self._insert(seq, slots)
        assert k == expected
        self.free.extend(slots[:k])
        self._adopt(seq, slots, k)

    @rule(seq=st.lists(st.integers(0, 3), max_size=10))
    def lock(self, seq: list[int]) -> None:
        m = self._match(seq)
        self.tree.lock(m.node)
        self.locks.append((m.node, tuple(seq[: m.length])))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.locks) - 1))
        node, _ = self.locks.pop(i)
        self.tree.unlock(node)

    @precondition(lambda self: self.locks)
    @rule(data=st.data(), ext=st.lists(st.integers(0, 3), max_size=6))
    def extend_locked(self, data: st.DataObject, ext: list[int]) -> None:
        """A running request hands newly computed tokens to the tree and moves its lock to the new prefix."""
        i = data.draw(st.integers(0, len(self.locks) - 1))
        node, prefix = self.locks[i]
        seq = list(prefix) + ext
        new = self._alloc(len(ext))
        if new is None:
            return
        expected = self._model_match_len(seq)
        assert expected >= len(prefix), "a locked prefix is no longer cached"
        slots = self._model_slots(prefix, len(prefix)) + new
        k = self._insert(seq, slots)
        assert k == expected
        self.free.extend(slots[len(prefix) : k])
        self._adopt(seq, slots, k)
        m2 = self._match(seq)
        assert m2.length == self._aligned(len(seq))
        self.tree.lock(m2.node)
        self.tree.unlock(node)
        self.locks[i] = (m2.node, tuple(seq[: m2.length]))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def handle_is_stable(self, data: st.DataObject) -> None:
        """However the tree was split since, a lock handle still ends exactly at its prefix."""
        node, prefix = self.locks[data.draw(st.integers(0, len(self.locks) - 1))]
        m = self._match(list(prefix))
        assert m.node is node and m.length == len(prefix)

    @rule(n=st.integers(0, 12))
    def evict(self, n: int) -> None:
        before = self.tree.evictable_size
        self._on_evicted(self.tree.evict(n), n, before)

    @rule()
    def reset(self) -> None:
        if self._protected():
            with pytest.raises(ValueError):
                self.tree.reset()
            return
        freed = self.tree.reset()
        assert sorted(freed) == sorted(self._held())
        self.free.extend(freed)
        self.model.clear()
        self.time.clear()

    # -- checked after every step

    @invariant()
    def consistent(self) -> None:
        self.tree.check_integrity()
        held = self.tree.all_slots()
        assert sorted(held) == sorted(self._held())
        assert not set(held) & set(self.free), "a slot is both free and in the tree"
        assert sorted(held + self.free) == list(range(POOL)), "a slot leaked or was duplicated"
        assert self.tree.total_size == len(self.model) * self.page_size
        assert self.tree.total_size == self.tree.evictable_size + self.tree.protected_size
        assert self.tree.protected_size == len(self._protected()) * self.page_size
        assert all(prefix in self.model for prefix in self._protected())
        assert self.time.keys() == self.model.keys()


class PagedRadixMachine(RadixMachine):
    page_size = 2


_settings = settings(max_examples=200, stateful_step_count=40, deadline=None, database=None)
TestRadixTreeStateful = RadixMachine.TestCase
TestRadixTreeStateful.settings = _settings
TestPagedRadixTreeStateful = PagedRadixMachine.TestCase
TestPagedRadixTreeStateful.settings = _settings
