"""The router's Prometheus metrics: its routing decisions, each replica's health, in-flight requests and
counters. Read from the ``ReplicaPool`` at scrape time (a collector, not a copy to keep in sync)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from radixserve.server.router.replicas import ReplicaPool

PREFIX = "radixserve_router:"


class _PoolCollector(Collector):
    def __init__(self, pool: ReplicaPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        info = self.pool.info()
        healthy = GaugeMetricFamily(
            f"{PREFIX}replica_healthy", "1 while the replica is in rotation.", labels=["replica"]
        )
        in_flight = GaugeMetricFamily(
            f"{PREFIX}replica_in_flight", "Requests the router has in flight on the replica.", labels=["replica"]
        )
        routed = CounterMetricFamily(
            f"{PREFIX}requests_routed",
            "Requests sent to the replica (a request retried elsewhere counts on each replica it was sent to).",
            labels=["replica"],
        )
        retried = CounterMetricFamily(
            f"{PREFIX}requests_retried_elsewhere",
            "Requests the replica did not take (no answer, 503 or 429) that went to another replica.",
            labels=["replica"],
        )
        failed = CounterMetricFamily(
            f"{PREFIX}requests_failed",
            "Requests whose replica failed after it had started to answer (a 502, or an error event in a stream).",
            labels=["replica"],
        )
        deaths = CounterMetricFamily(
            f"{PREFIX}replica_marked_unhealthy",
            "Times the replica was taken out of rotation after it had passed a health check.",
            labels=["replica"],
        )
        for r in info["replicas"]:
            healthy.add_metric([r["id"]], 1.0 if r["healthy"] else 0.0)
            in_flight.add_metric([r["id"]], r["in_flight"])
            routed.add_metric([r["id"]], r["requests_routed"])
            retried.add_metric([r["id"]], r["retried_elsewhere"])
            failed.add_metric([r["id"]], r["requests_failed"])
            deaths.add_metric([r["id"]], r["times_marked_unhealthy"])
        decisions = CounterMetricFamily(
            f"{PREFIX}routing_decisions",
            "Routing decisions by reason (prefix, balance, smallest_tree, round_robin, least_load).",
            labels=["policy", "reason"],
        )
        for reason, count in (info["routing"].get("decisions") or {}).items():
            decisions.add_metric([info["policy"], reason], count)
        refused = CounterMetricFamily(
            f"{PREFIX}requests_refused",
            "Requests the router answered 503 itself: no replica healthy, or every healthy one refused them.",
            labels=["reason"],
        )
        refused.add_metric(["no_healthy_replica"], info["requests_refused_no_replica"])
        refused.add_metric(["every_replica_refused"], info["requests_refused_by_every_replica"])
        yield from (healthy, in_flight, routed, retried, failed, deaths, decisions, refused)


def router_registry(pool: ReplicaPool) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(_PoolCollector(pool))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
