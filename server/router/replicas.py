"""The router's view of its replicas: health, load, counters; and the policy that chooses among them.

Invariants:
  * a replica is a *candidate* for a request only while it is healthy; the policy only ever sees candidates;
  * ``in_flight`` counts the router's requests that hold the replica (``acquire`` .. ``release``, exactly once
    each, however the request ends), so it is >= 0 and returns to 0 when the router is idle;
  * when a replica is marked dead its cache is assumed gone: the policy ``forget``s it, so prefix affinity starts
    afresh when it comes back (only a successful health check brings it back).
Single-threaded: only the router's event loop touches a pool.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from radixserve.server.router.policy import Decision, Policy

logger = logging.getLogger("radixserve.router")


@dataclass
class Replica:
    """One replica as the router sees it. ``external_load``: requests the replica reported running or waiting
    beyond the router's own at the last /server_info refresh (other clients' load; 0 unless refreshed)."""

    id: str
    healthy: bool = True
    in_flight: int = 0
    routed: int = 0
    failed: int = 0
    retried_elsewhere: int = 0
    deaths: int = 0  # times taken out of rotation after it had served (a replica still loading does not count)
    served: bool = False  # it has passed a health check
    external_load: int = 0
    last_error: str = ""
    since: float = 0.0

    @property
    def load(self) -> int:
        return self.in_flight + self.external_load


class ReplicaPool:
    """The replicas (in their configured order) and the routing policy over them."""

    def __init__(self, ids: list[str], policy: Policy) -> None:
        if not ids:
            raise ValueError("a router needs at least one replica")
        now = time.monotonic()
        self.replicas = {rid: Replica(rid, since=now) for rid in ids}
        self.policy = policy
        self.no_replica = 0  # requests refused because no replica was healthy
        self.all_refused = 0  # requests refused because every healthy replica refused them (429)

    def candidates(self, exclude: set[str] | frozenset[str] = frozenset()) -> dict[str, int]:
        """Healthy replicas not in ``exclude``, with their loads, in the configured order."""
        return {r.id: r.load for r in self.replicas.values() if r.healthy and r.id not in exclude}

    def any_healthy(self) -> bool:
        return any(r.healthy for r in self.replicas.values())

    def choose(self, text: str, exclude: set[str]) -> Decision | None:
        """The policy's choice among the candidates, or None if there is none."""
        loads = self.candidates(exclude)
        return self.policy.select(text, loads) if loads else None

    def least_loaded(self, exclude: set[str] | frozenset[str] = frozenset()) -> str | None:
        """For requests with no prompt (e.g. /v1/models): the least loaded candidate, first in order on ties."""
        loads = self.candidates(exclude)
        return min(loads, key=loads.__getitem__) if loads else None

    def acquire(self, rid: str) -> None:
        replica = self.replicas[rid]
        replica.in_flight += 1
        replica.routed += 1

    def release(self, rid: str) -> None:
        replica = self.replicas[rid]
        assert replica.in_flight > 0, f"release without acquire on {rid}"
        replica.in_flight -= 1

    def mark_dead(self, rid: str, why: str) -> None:
        replica = self.replicas[rid]
        replica.last_error = why
        if replica.healthy:
            logger.warning("replica %s is unhealthy, taking it out of rotation: %s", rid, why)
            replica.healthy = False
            replica.deaths += replica.served
            replica.external_load = 0
            replica.since = time.monotonic()
            self.policy.forget(rid)

    def mark_alive(self, rid: str) -> None:
        replica = self.replicas[rid]
        replica.served = True
        if not replica.healthy:
            logger.info("replica %s is healthy again, back in rotation", rid)
            replica.healthy = True
            replica.since = time.monotonic()

    def set_engine_load(self, rid: str, engine_requests: int) -> None:
        """Record a replica's reported running + waiting requests; what exceeds the router's own is external."""
        replica = self.replicas[rid]
        replica.external_load = max(0, engine_requests - replica.in_flight)

    def info(self) -> dict[str, Any]:
        now = time.monotonic()
        replicas = []
        for r in self.replicas.values():
            replicas.append(
                {
                    "id": r.id,
                    "healthy": r.healthy,
                    "in_flight": r.in_flight,
                    "external_load": r.external_load,
                    "requests_routed": r.routed,
                    "requests_failed": r.failed,
                    "retried_elsewhere": r.retried_elsewhere,
                    "times_marked_unhealthy": r.deaths,
                    "last_error": r.last_error,
                    "seconds_in_state": round(now - r.since, 3),
                    **self.policy.replica_info(r.id),
                }
            )
        return {
            "policy": self.policy.name,
            "replicas": replicas,
            "routing": self.policy.stats.as_dict(),
            "requests_refused_no_replica": self.no_replica,
            "requests_refused_by_every_replica": self.all_refused,
        }
