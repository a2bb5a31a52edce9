"""Routing policies: which replica gets a request. Pure Python, no I/O; the router (HTTP or Ray) calls them.

A policy sees the request's routing text (``server.router.text``) and the *candidates*: the replicas that are
healthy and not yet tried for this request, each with its current load (requests in flight). It returns a
``Decision``. Invariant: the chosen replica is always one of the candidates, so a replica the router marked dead
is never chosen. ``forget(replica)`` is called when a replica dies (its KV cache is gone with it).

* ``round_robin``: the candidates in turn.
* ``least_load``: the candidate with the fewest requests in flight (ties in turn).
* ``cache_aware``: prefix affinity with a load-balance guard, as in SGLang's router:
    1. if the load is imbalanced (``max - min > balance_abs_threshold`` and ``max > balance_rel_threshold * min``),
       the least loaded candidate;
    2. otherwise, the candidate whose tree matches the longest prefix of the text, if that match covers at least
       ``cache_threshold`` of the text;
    3. otherwise, the candidate with the smallest tree (it has the most room), then the least loaded.
  The text is then recorded in the chosen replica's tree, and a tree over ``max_tree_chars`` is pruned (least
  recently used first) down to ``PRUNE_TO`` of that budget, so pruning runs once per few inserts, not on each.

Policies are safe to call from several threads (one lock each); the routers call them from one event loop.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from radixserve.server.router.tree import PrefixTree

POLICIES = ("cache_aware", "round_robin", "least_load")
PRUNE_TO = 0.9  # a tree over its budget is pruned to this share of it


@dataclass(frozen=True)
class Decision:
    """Where a request goes and why (``reason``: prefix, balance, smallest_tree, round_robin, least_load)."""

    replica: str
    reason: str
    matched_chars: int = 0
    text_chars: int = 0


@dataclass
class RoutingStats:
    """Totals over every decision: how many per reason, and how much of the routed text the chosen replica's
    tree already held (the router's estimate of the prefix cache hit rate)."""

    decisions: dict[str, int] = field(default_factory=dict)
    matched_chars: int = 0
    text_chars: int = 0

    def add(self, d: Decision) -> None:
        self.decisions[d.reason] = self.decisions.get(d.reason, 0) + 1
        self.matched_chars += d.matched_chars
        self.text_chars += d.text_chars

    def as_dict(self) -> dict[str, Any]:
        rate = self.matched_chars / self.text_chars if self.text_chars else 0.0
        return {
            "decisions": dict(self.decisions),
            "matched_chars": self.matched_chars,
            "text_chars": self.text_chars,
            "estimated_hit_rate": round(rate, 4),
        }


class Policy(ABC):
    """The interface every routing policy implements."""

    name = ""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.stats = RoutingStats()

    def select(self, text: str, loads: Mapping[str, int]) -> Decision:
        """Choose one of ``loads``' keys (the candidates, in the router's fixed order) for a request."""
        if not loads:
            raise ValueError("no candidate replica")
        with self._lock:
            decision = self._select(text, loads)
            assert decision.replica in loads
            self.stats.add(decision)
            return decision

    @abstractmethod
    def _select(self, text: str, loads: Mapping[str, int]) -> Decision: ...

    def forget(self, replica: str) -> None:
        """The replica died or restarted: whatever it cached is gone. (No state to drop by default.)"""
        return None

    def replica_info(self, replica: str) -> dict[str, Any]:
        """Per-replica figures for /router_info."""
        return {}


class _Turns:
    """A counter that hands out candidates in turn, whatever the candidate list is on each call."""

    def __init__(self) -> None:
        self._n = 0

    def pick(self, candidates: Sequence[str]) -> str:
        choice = candidates[self._n % len(candidates)]
        self._n += 1
        return choice


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        super().__init__()
        self._turns = _Turns()

    def _select(self, text: str, loads: Mapping[str, int]) -> Decision:
        return Decision(self._turns.pick(list(loads)), "round_robin", 0, len(text))


class LeastLoadPolicy(Policy):
    name = "least_load"

    def __init__(self) -> None:
        super().__init__()
        self._turns = _Turns()

    def _select(self, text: str, loads: Mapping[str, int]) -> Decision:
        low = min(loads.values())
        return Decision(self._turns.pick([r for r, n in loads.items() if n == low]), "least_load", 0, len(text))


class CacheAwarePolicy(Policy):
    """Prefix affinity over one ``PrefixTree`` per replica; see the module docstring for the rule."""

    name = "cache_aware"

    def __init__(
        self,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.5,
        max_tree_chars: int = 1 << 22,
    ) -> None:
        super().__init__()
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_chars = max_tree_chars
        self._trees: dict[str, PrefixTree] = {}

    def tree(self, replica: str) -> PrefixTree:
        tree = self._trees.get(replica)
        if tree is None:
            tree = self._trees[replica] = PrefixTree()
        return tree

    def imbalanced(self, loads: Mapping[str, int]) -> bool:
        hi, lo = max(loads.values()), min(loads.values())
        return hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo

    def _select(self, text: str, loads: Mapping[str, int]) -> Decision:
        order = {r: i for i, r in enumerate(loads)}  # last tie-break: the router's order, for determinism
        if self.imbalanced(loads):
            replica = min(loads, key=lambda r: (loads[r], self.tree(r).chars, order[r]))
            decision = Decision(replica, "balance", self.tree(replica).match(text), len(text))
        else:
            matches = {r: self.tree(r).match(text) for r in loads}
            best = max(loads, key=lambda r: (matches[r], -loads[r], -self.tree(r).chars, -order[r]))
            if text and matches[best] >= self.cache_threshold * len(text):
                decision = Decision(best, "prefix", matches[best], len(text))
            else:
                replica = min(loads, key=lambda r: (self.tree(r).chars, loads[r], order[r]))
                decision = Decision(replica, "smallest_tree", matches[replica], len(text))
        tree = self.tree(decision.replica)
        tree.insert(text)
        if tree.chars > self.max_tree_chars:
            tree.prune(int(self.max_tree_chars * PRUNE_TO))
        return decision

    def forget(self, replica: str) -> None:
        with self._lock:
            self._trees.pop(replica, None)

    def replica_info(self, replica: str) -> dict[str, Any]:
        with self._lock:
            return {"tree_chars": self.tree(replica).chars}


def make_policy(
    name: str,
    *,
    cache_threshold: float = 0.5,
    balance_abs_threshold: int = 32,
    balance_rel_threshold: float = 1.5,
    max_tree_chars: int = 1 << 22,
) -> Policy:
    """The policy called ``name`` (one of ``POLICIES``); the keyword arguments tune ``cache_aware`` only."""
    if name == "cache_aware":
        return CacheAwarePolicy(cache_threshold, balance_abs_threshold, balance_rel_threshold, max_tree_chars)
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_load":
        return LeastLoadPolicy()
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
