"""Which engine replicas are alive, and their latest load: fed by each replica's heartbeat.

The KV directory actor owns one, so a replica that stops reporting is dropped from the directory at once; each
ingress's mirror keeps its own, fed by the same heartbeats through the change feed, to plan from.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from actors.replica_api import ReplicaIdentity, ReplicaStats

DEFAULT_DEAD_AFTER_S = 5.0


class ReplicaRegistry:
    """Live replicas by heartbeat age. Not thread-safe (the directory actor's event loop owns it)."""

    def __init__(
        self, dead_after_s: float = DEFAULT_DEAD_AFTER_S, clock: Callable[[], float] = time.monotonic
    ):
        self.dead_after_s = dead_after_s
        self._clock = clock
        self._seen: dict[str, float] = {}
        self._stats: dict[str, ReplicaStats] = {}
        self._identity: dict[str, ReplicaIdentity] = {}

    def heartbeat(self, identity: ReplicaIdentity, stats: ReplicaStats) -> bool:
        """Record a replica's report; True when the replica is new to the registry (mutates)."""
        new = identity.replica_id not in self._seen
        self._seen[identity.replica_id] = self._clock()
        self._stats[identity.replica_id] = stats
        self._identity[identity.replica_id] = identity
        return new

    def remove(self, replica_id: str) -> bool:
        """Forget a replica (mutates); True if it was known."""
        self._stats.pop(replica_id, None)
        self._identity.pop(replica_id, None)
        return self._seen.pop(replica_id, None) is not None

    def sweep(self) -> list[str]:
        """Remove replicas silent for longer than `dead_after_s` and return their ids (mutates)."""
        limit = self._clock() - self.dead_after_s
        dead = [rid for rid, seen in self._seen.items() if seen < limit]
        for rid in dead:
            self.remove(rid)
        return dead

    def live(self) -> list[ReplicaStats]:
        """The latest stats of every replica that reported recently, sorted by id (read only)."""
        return [self._stats[rid] for rid in sorted(self._stats)]

    def report(self, replica_id: str) -> tuple[ReplicaIdentity, ReplicaStats] | None:
        """The identity and latest stats of a registered replica; None if it is not registered (read only)."""
        identity = self._identity.get(replica_id)
        return None if identity is None else (identity, self._stats[replica_id])

    def identities(self) -> list[ReplicaIdentity]:
        return [self._identity[rid] for rid in sorted(self._identity)]
