"""The router's routing policies, its prefix tree and routing text, and its configuration: pure Python, no HTTP."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.runtime.config import from_args
from radixserve.server.cli import build_parser
from radixserve.server.router.config import RouterConfig, RoutingConfig
from radixserve.server.router.policy import CacheAwarePolicy, LeastLoadPolicy, RoundRobinPolicy, make_policy
from radixserve.server.router.replicas import ReplicaPool
from radixserve.server.router.text import routing_text
from radixserve.server.router.tree import PrefixTree, common_prefix_len

PREFIXES = [f"system prompt {i}: " + f"rule {i} says be brief and exact. " * 20 for i in range(4)]


def _brute_match(texts: list[str], text: str) -> int:
    return max((common_prefix_len(t, text, 0) for t in texts), default=0)


# --- prefix tree ---------------------------------------------------------------------------------------------


def test_tree_match_insert_split() -> None:
    tree = PrefixTree()
    assert tree.match("hello") == 0
    tree.insert("hello world")
    assert tree.chars == len("hello world")
    assert tree.match("hello world") == 11
    assert tree.match("hello there") == 6
    assert tree.match("help") == 3
    tree.insert("hello there")  # splits the edge after "hello "
    assert tree.chars == len("hello world") + len("there")
    assert tree.match("hello there, you") == 11
    tree.insert("")
    tree.check()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(alphabet="abc", min_size=0, max_size=12), max_size=25), st.text(alphabet="abc", max_size=12))
def test_tree_matches_like_brute_force(texts: list[str], probe: str) -> None:
    tree = PrefixTree()
    for t in texts:
        tree.insert(t)
        tree.check()
    assert tree.match(probe) == _brute_match(texts, probe)
    for t in texts:
        assert tree.match(t) == len(t)


def test_tree_prune_drops_least_recently_used_first() -> None:
    tree = PrefixTree()
    texts = [f"{i}-" + "x" * 98 for i in range(10)]  # 100 chars each, no shared head but the first char
    for t in texts:
        tree.insert(t)
    tree.insert(texts[0])  # texts[0] becomes the most recently used
    removed = tree.prune(550)
    tree.check()
    assert tree.chars <= 550 and removed == 1000 - tree.chars
    assert tree.match(texts[0]) == 100  # recently used: kept
    assert tree.match(texts[9]) == 100  # newest insert: kept
    assert tree.match(texts[1]) < 100  # oldest: gone
    assert tree.prune(10**6) == 0


def test_tree_prune_keeps_shared_heads_of_survivors() -> None:
    tree = PrefixTree()
    head = "shared head " * 10
    tree.insert(head + "old tail " * 10)
    tree.insert(head + "new tail " * 10)
    tree.prune(len(head) + 100)
    tree.check()
    assert tree.match(head + "new tail " * 10) == len(head) + 90
    assert tree.match(head + "old tail") == len(head)


# --- policies ------------------------------------------------------------------------------------------------


def test_cache_aware_prefix_affinity() -> None:
    policy = CacheAwarePolicy(cache_threshold=0.5)
    loads = {"a": 0, "b": 0}
    rng = random.Random(0)
    seen: dict[int, set[str]] = {i: set() for i in range(4)}
    order = [i for i in range(4) for _ in range(5)]
    rng.shuffle(order)
    for n, i in enumerate(order):
        decision = policy.select(PREFIXES[i] + f"question {n}?", loads)
        seen[i].add(decision.replica)
    assert all(len(replicas) == 1 for replicas in seen.values()), seen  # each prefix stays on one replica
    per_replica = [sum(1 for r in seen.values() if r == {x}) for x in ("a", "b")]
    assert per_replica == [2, 2]  # and the prefixes are spread: the smallest tree takes a new one
    stats = policy.stats.as_dict()
    assert stats["decisions"]["prefix"] == len(order) - 4
    assert stats["decisions"]["smallest_tree"] == 4
    assert stats["estimated_hit_rate"] > 0.7


def test_cache_aware_below_threshold_goes_to_smallest_tree() -> None:
    policy = CacheAwarePolicy(cache_threshold=0.5)
    loads = {"a": 0, "b": 0}
    assert policy.select("x" * 1000, loads).replica == "a"
    decision = policy.select("x" * 300 + "y" * 700, loads)  # 30% matched on a: below the threshold
    assert decision.replica == "b" and decision.reason == "smallest_tree"
    decision = policy.select("x" * 700 + "z" * 300, loads)  # 70% matched on a
    assert decision.replica == "a" and decision.reason == "prefix" and decision.matched_chars == 700


def test_cache_aware_load_imbalance_overrides_affinity() -> None:
    policy = CacheAwarePolicy(balance_abs_threshold=8, balance_rel_threshold=1.5)
    text = PREFIXES[0] + "q"
    assert policy.select(text, {"a": 0, "b": 0}).replica == "a"
    # Within the thresholds: affinity wins even though a is busier.
    assert policy.select(text, {"a": 8, "b": 0}).replica == "a"  # abs difference not > 8
    assert policy.select(text, {"a": 30, "b": 21}).replica == "a"  # 30 < 1.5 * 21
    decision = policy.select(text, {"a": 40, "b": 2})
    assert decision.replica == "b" and decision.reason == "balance"
    assert policy.tree("b").match(text) == len(text)  # what b got is recorded for it


def test_cache_aware_prunes_to_budget() -> None:
    policy = make_policy("cache_aware", max_tree_chars=4096)
    texts = [f"{i:04d}" + "w" * 500 for i in range(40)]
    for t in texts:
        policy.select(t, {"a": 0})
        assert policy.tree("a").chars <= 4096
    policy.tree("a").check()
    assert policy.tree("a").match(texts[-1]) == len(texts[-1])
    assert policy.tree("a").match(texts[0]) < 10


def test_round_robin_and_least_load() -> None:
    rr = RoundRobinPolicy()
    assert [rr.select("t", {"a": 5, "b": 0}).replica for _ in range(4)] == ["a", "b", "a", "b"]
    ll = LeastLoadPolicy()
    assert ll.select("t", {"a": 5, "b": 1, "c": 3}).replica == "b"
    ties = LeastLoadPolicy()
    assert [ties.select("t", {"a": 0, "b": 0}).replica for _ in range(4)] == ["a", "b", "a", "b"]  # in turns
    with pytest.raises(ValueError):
        ll.select("t", {})
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")


@pytest.mark.parametrize("name", ["cache_aware", "round_robin", "least_load"])
def test_dead_replica_is_never_chosen(name: str) -> None:
    pool = ReplicaPool(["a", "b", "c"], make_policy(name))
    text = PREFIXES[1] + "q"
    for _ in range(3):
        decision = pool.choose(text, set())
        assert decision is not None
    pool.mark_dead("b", "connection refused")
    chosen = set()
    for i in range(12):
        decision = pool.choose(PREFIXES[i % 4] + str(i), set())
        assert decision is not None
        chosen.add(decision.replica)
    assert "b" not in chosen and chosen <= {"a", "c"}
    assert pool.choose(text, {"a", "c"}) is None  # only the dead one left: nothing to choose
    assert pool.least_loaded({"a", "c"}) is None
    pool.mark_alive("b")
    assert pool.choose(text, {"a", "c"}).replica == "b"  # type: ignore[union-attr]


def test_death_clears_the_replicas_tree() -> None:
    policy = CacheAwarePolicy()
    pool = ReplicaPool(["a", "b"], policy)
    pool.mark_dead("a", "loading")  # before any passed health check (still loading): taken out, not counted
    assert pool.info()["replicas"][0]["times_marked_unhealthy"] == 0
    for replica in ("a", "b"):
        pool.mark_alive(replica)  # health checks passed
    text = PREFIXES[2] + "q"
    first = pool.choose(text, set())
    assert first is not None and policy.tree(first.replica).chars > 0
    pool.mark_dead(first.replica, "killed")
    assert policy.tree(first.replica).chars == 0
    info = {r["id"]: r for r in pool.info()["replicas"]}
    assert info[first.replica]["healthy"] is False and info[first.replica]["times_marked_unhealthy"] == 1
    second = pool.choose(text, set())  # only the other replica is a candidate now
    assert second is not None and second.replica != first.replica and second.reason == "smallest_tree"
    pool.mark_alive(first.replica)
    assert first.replica in pool.candidates() and policy.tree(first.replica).chars == 0
    third = pool.choose(text, set())  # affinity now lies with the replica that served it last
    assert third is not None and third.replica == second.replica and third.reason == "prefix"


def test_in_flight_accounting_and_external_load() -> None:
    pool = ReplicaPool(["a", "b"], LeastLoadPolicy())
    pool.acquire("a")
    pool.acquire("a")
    assert pool.candidates() == {"a": 2, "b": 0}
    pool.set_engine_load("b", 5)  # five requests from other clients
    assert pool.candidates() == {"a": 2, "b": 5}
    pool.set_engine_load("a", 2)  # only ours
    assert pool.candidates()["a"] == 2
    pool.release("a")
    pool.release("a")
    with pytest.raises(AssertionError):
        pool.release("a")


# --- routing text --------------------------------------------------------------------------------------------


def test_routing_text_prefix_property() -> None:
    sys_msg = {"role": "system", "content": PREFIXES[0]}
    short = routing_text("/v1/chat/completions", {"messages": [sys_msg, {"role": "user", "content": "hi"}]})
    longer = routing_text(
        "/v1/chat/completions",
        {"messages": [sys_msg, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    )
    assert longer.startswith(short) and PREFIXES[0] in short
    parts = routing_text(
        "/v1/chat/completions",
        {"messages": [{"role": "system", "content": [{"type": "text", "text": PREFIXES[0]}]}]},
    )
    assert short.startswith(parts)  # content parts read as the same text
    ids = routing_text("/generate", {"input_ids": [1, 2, 3]})
    assert ids == "1,2,3," and routing_text("/generate", {"input_ids": [1, 2, 3, 4]}).startswith(ids)
    assert routing_text("/generate", {"text": "abc"}) == "abc"
    # The DSL's select scores token ids and names the text they continue: routed with the program's requests.
    program = routing_text("/generate", {"text": "Review: great. Sentiment:"})
    select_ = routing_text("/generate", {"input_ids": [[7, 8, 9]], "routing_text": "Review: great. Sentiment:"})
    assert select_ == program
    assert routing_text("/v1/completions", {"prompt": "abc"}) == "abc"
    assert routing_text("/v1/embeddings", {"input": ["Instruct: x\nQuery: a", "b"]}).startswith("Instruct: x\nQuery:")
    # vLLM's chat form of a pooling request routes by its (first) conversation, whichever field carries it.
    chat = routing_text("/v1/chat/completions", {"messages": [sys_msg]})
    assert routing_text("/v1/embeddings", {"messages": [sys_msg]}) == chat
    assert routing_text("/v1/classify", {"messages": [[sys_msg], [{"role": "user", "content": "b"}]]}) == chat
    assert routing_text("/v1/embeddings", {"input": [sys_msg]}) == chat
    assert routing_text("/v1/completions", {"prompt": [5, 6]}) == "5,6,"
    assert routing_text("/v1/completions", {"prompt": ["ab", "cd"]}) == "ab\x1ecd"
    tools = routing_text("/v1/chat/completions", {"messages": [sys_msg], "tools": [{"type": "function"}]})
    assert tools.startswith("tools") and tools.endswith(routing_text("/v1/chat/completions", {"messages": [sys_msg]}))
    for bad in (None, [], "x", {"messages": "nope"}, {"prompt": {"a": 1}}, {"messages": [1, None]}):
        assert isinstance(routing_text("/v1/chat/completions", bad), str)
        assert isinstance(routing_text("/v1/completions", bad), str)


# --- configuration -------------------------------------------------------------------------------------------


def test_router_cli_flags() -> None:
    args = build_parser().parse_args(
        ["router", "--worker-urls", "http://a:1/", "http://b:2", "--policy", "round_robin", "--port", "9"]
    )
    config, routing = from_args(RouterConfig, args), from_args(RoutingConfig, args)
    assert config.worker_urls == ("http://a:1", "http://b:2") and config.port == 9
    assert routing.policy == "round_robin" and isinstance(routing.make_policy(), RoundRobinPolicy)


def test_router_config_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXSERVE_WORKER_URLS", "http://a:1, http://b:2")
    monkeypatch.setenv("RADIXSERVE_POLICY", "least_load")
    args = build_parser().parse_args(["router"])
    assert from_args(RouterConfig, args).worker_urls == ("http://a:1", "http://b:2")
    assert from_args(RoutingConfig, args).policy == "least_load"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"worker_urls": ()}, "at least one"),
        ({"worker_urls": ("a:1",)}, "http://"),
        ({"worker_urls": ("http://a", "http://a/")}, "twice"),
        ({"worker_urls": ("http://a",), "connect_timeout": 0}, "connect-timeout"),
        ({"worker_urls": ("http://a",), "port": 70000}, "port"),
    ],
)
def test_router_config_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RouterConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"policy": "random"}, "policy"),
        ({"cache_threshold": 1.5}, "cache-threshold"),
        ({"balance_rel_threshold": 0.5}, "balance-rel"),
        ({"router_max_tree_chars": 10}, "tree-chars"),
        ({"health_check_interval": 0}, "health-check"),
    ],
)
def test_routing_config_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RoutingConfig(**kwargs)
