"""The KV cache manager: the single owner of the slot allocator and the radix tree.

Every slot is in exactly one of three places, which ``check`` verifies:
  * the allocator's free list;
  * the radix tree (shared prefixes; locked while a running request uses them, otherwise evictable);
  * a request's private tail ``req.slots[req.prefix_len:]``.
So ``free + tree + private == total``. Only the scheduler thread calls this class.

With a KV tier (``runtime.kv_tier``, ``--enable-hierarchical-cache``) KV that eviction frees is first saved to the
tier, a request's admission extends its radix match with chunks the tier holds (loaded into newly allocated slots,
which then join the tree like any computed prefix), and ``persist`` saves what the tree holds (periodically and at
shutdown, for a warm restart). The tier holds no slots, so the accounting above is unchanged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

from radixserve.radix import RadixTree, TreeNode
from radixserve.runtime.kv_pool import SlotAllocator
from radixserve.runtime.kv_tier import KVTier
from radixserve.runtime.request import SALTED_IDS, FinishReason, Req

logger = logging.getLogger("radixserve.engine")


class KVCacheManager:
    def __init__(self, num_slots: int, enable_radix: bool, strict: bool = False, tier: KVTier | None = None) -> None:
        if tier is not None and not enable_radix:
            raise ValueError("the KV tier extends the radix cache: it needs the radix cache on")
        self.num_slots = num_slots
        self.allocator = SlotAllocator(num_slots, strict=strict)
        self.tree: RadixTree | None = RadixTree() if enable_radix else None
        self.tier = tier
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

    def prefetch(self, req: Req) -> None:
        """Have the tier read ahead the chunks of a new request's prompt that lie past the tree's match."""
        if self.tier is None or self.tree is None or req.cache_namespace is not None:
            return
        head = req.all_ids[: req.total - 1]  # admission always leaves the last token to compute
        first, last = self.tree.cached_prefix_len(head) // self.tier.chunk_tokens, len(head) // self.tier.chunk_tokens
        if first < last:
            self.tier.prefetch(self._chunk_keys(req, last)[first:], head, first)

    def _chunk_keys(self, req: Req, end: int) -> list[str]:
        """The tier's keys of the request's chunks ``0 .. end - 1``, hashed once per request (``Req.tier_keys``)."""
        assert self.tier is not None
        have = req.tier_keys
        if len(have) < end:
            have.extend(self.tier.keys(req.all_ids, len(have), end, have[-1] if have else None))
        return have[:end]

    def admit(self, req: Req) -> int:
        """Attach the longest cached prefix of the request's tokens and lock it; returns its length.

        At least one token is always left to compute (its logits give the next token), and so are the prompt
        positions whose log-probabilities are still to be reported (``Req.next_logprob_pos`` on), and the whole
        prompt of an embedding pooled over every token.
        """
        if req.slots or req.prefix_handle is not None:
            raise RuntimeError(f"{req.rid} admitted while still holding KV")
        if self.tree is None:
            return 0
        limit = req.total - 1
        if req.scoring_prompt:
            limit = min(limit, req.next_logprob_pos)
        if req.params.pooling is not None and req.params.pooling.needs_whole_prompt:
            limit = 0  # its embedding reads every prompt token's hidden state (``runtime.pooling``)
        if limit <= 0:
            return 0
        match = self.tree.match_prefix(req.cache_ids[:limit])
        self.tree.lock(match.node)
        req.prefix_handle = match.node
        req.slots = list(match.slots)
        req.prefix_len = req.num_computed = len(match.slots)
        salted = req.cache_namespace is not None  # the tier keys chunks by tokens alone: kept out of it
        if self.tier is not None and not salted and limit - req.prefix_len >= self.tier.chunk_tokens:
            self._load_from_tier(req, limit)
        return req.prefix_len

    def _load_from_tier(self, req: Req, limit: int) -> None:
        """Extend the request's cached prefix with the chunks the tier holds right after it (up to ``limit``)."""
        assert self.tier is not None
        tier, c, start = self.tier, self.tier.chunk_tokens, req.prefix_len
        first, last = start // c, limit // c
        keys = self._chunk_keys(req, last)[first:]
        found = 0
        while found < len(keys) and tier.has(keys[found]):
            found += 1
        if not found:
            return
        end = (first + found) * c
        slots = self.alloc(end - start)  # may evict (and save) others' prefixes; this request's is locked
        if slots is None:
            return
        loaded = tier.load(keys[:found], req.all_ids, first, start, slots)
        self.allocator.free(slots[loaded - start :])
        if loaded > start:
            req.slots.extend(slots[: loaded - start])
            req.num_computed = loaded
            self.cache_prefix(req)  # the loaded KV joins the tree, locked for this request

    def alloc(self, n: int) -> list[int] | None:
        """``n`` slots, evicting unlocked cached prefixes when the free list is short; ``None`` if impossible."""
        short = n - self.allocator.num_free
        if short > 0:
            if self.tree is None or self.tree.evictable_size < short:
                return None
            freed = self.tree.evict(short, self._save_evicted if self.tier is not None else None)
            self.evicted_tokens += len(freed)
            self.allocator.free(freed)
        return self.allocator.alloc(n)

    def _save_evicted(self, leaf: TreeNode) -> None:
        """Save to the tier every chunk that ends inside ``leaf`` (see ``runtime.kv_tier``)."""
        assert self.tier is not None and self.tree is not None
        c = self.tier.chunk_tokens
        tokens, slots = self.tree.path(leaf)
        if tokens[0] >= SALTED_IDS:
            return  # a salted request's KV (see ``admit``)
        first, last = (len(tokens) - len(leaf.tokens)) // c, len(tokens) // c
        if first < last:
            for k, key in enumerate(self.tier.keys(tokens, first, last), start=first):
                self.tier.save(key, k, tokens, slots)

    def persist(self, budget_s: float) -> bool:
        """Queue to the tier the chunks of the tree it does not hold yet (for a warm restart), for up to
        ``budget_s`` seconds of copying and while its write queue has room; returns whether all were covered."""
        if self.tier is None or self.tree is None:
            return True
        tier, c = self.tier, self.tier.chunk_tokens
        deadline = time.monotonic() + budget_s
        tokens: list[int] = []
        slots: list[int] = []
        keys: list[str] = []  # keys of the complete chunks of ``tokens``
        # Depth-first with an explicit stack: when a node is popped, the first ``depth`` entries of the running
        # lists are its parent's path (every sibling's subtree popped since shares that much).
        stack = [(child, 0) for child in self.tree.root.children.values() if child.tokens[0] < SALTED_IDS]
        while stack:
            node, depth = stack.pop()
            del tokens[depth:], slots[depth:], keys[depth // c :]
            tokens.extend(node.tokens)
            slots.extend(node.slots)
            if len(tokens) // c > len(keys):
                new = tier.keys(tokens, len(keys), len(tokens) // c, keys[-1] if keys else None)
                for k, key in enumerate(new, start=len(keys)):
                    if not tier.has(key):
                        if not tier.has_room() or time.monotonic() > deadline:
                            return False  # the writer is behind: the rest waits for the next call
                        tier.save(key, k, tokens, slots)
                keys.extend(new)
            stack.extend((child, len(tokens)) for child in node.children.values())
        return True

    def save_at_exit(self, budget_s: float, save: bool = True) -> None:
        """On a graceful stop (``save``), write the radix cache to the tier for a warm restart, within ``budget_s``
        seconds; then close the tier (after a fault: only close it)."""
        assert self.tier is not None
        tier, deadline = self.tier, time.monotonic() + budget_s
        done = False
        if save:
            try:
                while not done and time.monotonic() < deadline:
                    done = self.persist(deadline - time.monotonic())
                    if not done:
                        tier.drain(min(0.5, max(0.0, deadline - time.monotonic())))
            except Exception:  # noqa: BLE001 - a failed save must not keep the process from stopping
                logger.exception("saving the radix cache to the KV tier failed")
        tier.close(max(0.0, deadline - time.monotonic()))
        if save:
            info = tier.info()
            logger.info(
                "KV tier: %s; %d chunks (%.1f MiB) kept for the next start",
                "radix cache saved" if done else "radix cache partly saved (out of time)",
                info["stored_chunks"], info["stored_bytes"] / 2**20,
            )  # fmt: skip

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
        tokens = req.cache_ids[: req.num_computed]
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
            tokens = req.cache_ids[: req.num_computed]
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
        if self.tier is not None:
            self.tier.check()
