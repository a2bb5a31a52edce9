"""The KV cache manager: the single owner of the slot allocator and the radix tree.

Every slot is in exactly one of three places, which ``check`` verifies:
  * the allocator's free list;
  * the radix tree (shared prefixes; locked while a running request uses them, otherwise evictable);
  * a request's private tail ``req.slots[req.prefix_len:]``.
So ``free + tree + private == total``. Only the scheduler thread calls this class.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from radixserve.radix import RadixTree, TreeNode
from radixserve.runtime.kv_pool import SlotAllocator
from radixserve.runtime.request import FinishReason, Req


class KVCacheManager:
    def __init__(self, num_slots: int, enable_radix: bool, strict: bool = False) -> None:
        self.num_slots = num_slots
        self.allocator = SlotAllocator(num_slots, strict=strict)
        self.tree: RadixTree | None = RadixTree() if enable_radix else None
        self.evicted_tokens = 0

    # --- sizes --------------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def evictable(self) -> int:
        return self.tree.evictable_size if self.tree else 0

    @property
    def cached(self) -> int:
        return self.tree.total_size if self.tree else 0

    def available(self) -> int:
        """Slots that an allocation could get now: free ones plus what eviction could free."""
        return self.allocator.num_free + self.evictable

    # --- requests -----------------------------------------------------------------------------------------
    def peek_prefix_len(self, tokens: Sequence[int]) -> int:
        """Length of the cached prefix of ``tokens`` (no lock taken); used to order the waiting queue."""
        if self.tree is None or len(tokens) < 2:
            return 0
        return self.tree.cached_prefix_len(tokens[: len(tokens) - 1])

    def admit(self, req: Req) -> int:
        """Attach the longest cached prefix of the request's tokens and lock it; returns its length.

        At least one token is always left to compute (its logits give the next token), and so are the prompt
        positions whose log-probabilities are still to be reported (``Req.next_logprob_pos`` on).
        """
        if req.slots or req.prefix_handle is not None:
            raise RuntimeError(f"{req.rid} admitted while still holding KV")
        if self.tree is None:
            return 0
        limit = req.total - 1
        if req.wants_prompt_logprobs:
            limit = min(limit, req.next_logprob_pos)
        if limit <= 0:
            return 0
        match = self.tree.match_prefix(req.all_ids[:limit])
        self.tree.lock(match.node)
        req.prefix_handle = match.node
        req.slots = list(match.slots)
        req.prefix_len = req.num_computed = len(match.slots)
        return req.prefix_len

    def alloc(self, n: int) -> list[int] | None:
        """``n`` slots, evicting unlocked cached prefixes when the free list is short; ``None`` if impossible."""
        short = n - self.allocator.num_free
        if short > 0:
            if self.tree is None or self.tree.evictable_size < short:
                return None
            freed = self.tree.evict(short)
            self.evicted_tokens += len(freed)
            self.allocator.free(freed)
        return self.allocator.alloc(n)

    def trim(self, req: Req) -> None:
        """Free the slots past the request's computed tokens (rejected speculative drafts)."""
        if len(req.slots) > req.num_computed:
            self.allocator.free(req.slots[req.num_computed :])
            del req.slots[req.num_computed :]

    def cache_prefix(self, req: Req) -> None:
        """Hand the request's computed tokens to the tree (so others can share them while it runs) and keep a
        lock on them. Its private tail becomes empty."""
        if self.tree is None or req.num_computed <= req.prefix_len:
            return
        tokens = req.all_ids[: req.num_computed]
        self._insert(req, tokens)
        match = self.tree.match_prefix(tokens)
        if len(match.slots) != len(tokens):
            raise RuntimeError(f"{req.rid}: inserted prefix not found in the radix tree")
        self.tree.lock(match.node)
        if req.prefix_handle is not None:
            self.tree.unlock(req.prefix_handle)
        req.prefix_handle = match.node
        req.slots = list(match.slots)
        req.prefix_len = len(tokens)

    def release(self, req: Req) -> None:
        """Give back everything the request holds: computed tokens go into the tree (when enabled), the rest to
        the free list. Afterwards the request holds no KV (``num_computed == 0``).

        A failed request's own KV is freed, never cached: a fault (non-finite numbers, a kernel error) may have
        left it wrong, and a cached copy would be served to every later request with the same prefix. What it
        shares through the tree was computed and checked before, and stays."""
        if self.tree is None:
            self.allocator.free(req.slots)
        elif req.finish_reason is FinishReason.ERROR:
            if req.prefix_handle is not None:
                self.tree.unlock(req.prefix_handle)
            self.allocator.free(req.slots[req.prefix_len :])
        else:
            tokens = req.all_ids[: req.num_computed]
            if len(tokens) > req.prefix_len:
                self._insert(req, tokens)
            if req.prefix_handle is not None:
                self.tree.unlock(req.prefix_handle)
            # Slots beyond num_computed were allocated for a step that never ran.
            self.allocator.free(req.slots[req.num_computed :])
        req.slots = []
        req.prefix_len = req.num_computed = 0
        req.prefix_handle = None

    def shared_prefixes(self, reqs: Sequence[Req], min_len: int) -> list[tuple[int, int] | None]:
        """For each request, ``(group, length)``: the deepest cached prefix of at least ``min_len`` tokens that it
        shares with another of ``reqs`` (the same tree node, so the same slots), or ``None``.

        Requests share slots only through the tree, and its nodes say which: grouping by node, a request with
        another system prompt that shares only a chat template's first tokens with the rest leaves their group
        intact. ``group`` is the node's id, equal for the requests that share that prefix. Each request is in one
        group at most, so a group may end up with one request only (its partners chose a deeper one)."""
        if self.tree is None or len(reqs) < 2:
            return [None] * len(reqs)
        paths: list[list[tuple[TreeNode, int]]] = []
        count: dict[int, int] = {}
        for req in reqs:
            path: list[tuple[TreeNode, int]] = []  # (node, token depth where it ends), deepest first
            node, depth = req.prefix_handle, req.prefix_len
            while node is not None and node is not self.tree.root and depth >= min_len:
                path.append((node, depth))
                count[node.uid] = count.get(node.uid, 0) + 1
                depth -= len(node.tokens)
                node = node.parent
            paths.append(path)
        out: list[tuple[int, int] | None] = []
        for path in paths:
            pick = next(((node.uid, depth) for node, depth in path if count[node.uid] >= 2), None)
            out.append(pick)
        return out

    def _insert(self, req: Req, tokens: list[int]) -> None:
        assert self.tree is not None
        slots = req.slots[: len(tokens)]
        already = self.tree.insert(tokens, slots)
        # The tree kept its own copies of tokens [prefix_len, already): ours are duplicates.
        if already > req.prefix_len:
            self.allocator.free(slots[req.prefix_len : already])

    def flush(self) -> bool:
        """Drop every cached prefix; refused (``False``) while running requests hold locks."""
        if self.tree is None:
            return True
        if self.tree.protected_size:
            return False
        freed = self.tree.reset()
        self.allocator.free(freed)
        return True

    # --- accounting ---------------------------------------------------------------------------------------
    def check(self, holders: Iterable[Req]) -> None:
        """Raise ``RuntimeError`` unless every slot is in exactly one place (see the module docstring)."""
        seen: dict[int, str] = {}

        def claim(slots: Iterable[int], owner: str) -> None:
            for s in slots:
                if not 0 <= s < self.num_slots:
                    raise RuntimeError(f"{owner} holds out-of-range slot {s}")
                if s in seen:
                    raise RuntimeError(f"slot {s} held by both {seen[s]} and {owner}")
                seen[s] = owner

        claim(self.allocator.free_slots(), "free list")
        if self.tree is not None:
            self.tree.check_integrity()
            claim(self.tree.all_slots(), "radix tree")
        for req in holders:
            claim(req.slots[req.prefix_len :], f"request {req.rid}")
        if len(seen) != self.num_slots:
            raise RuntimeError(f"KV accounting: {self.num_slots - len(seen)} slots leaked")
