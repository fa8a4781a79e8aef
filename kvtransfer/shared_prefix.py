"""What caching a shared prompt prefix on a replica is worth to the first turns that come after it.

Conversations of one tenant or application often start with the same prefix (a system prompt, tool definitions),
which a replica's prefix cache keeps once computed. A first turn whose prefix is cached on other replicas but not on
a target computes it there if it runs there: slower for itself, but the next first turns sharing the prefix can then
start on that target without computing it, for as long as its cache keeps the prefix. Priced for the first cost
alone, a tenant's conversations all started on the replicas already caching its long system prompt, the replicas
without it never cached it, and the tenants sorted themselves onto replicas (modelled: `hot_tenant`,
`docs/design.md`).

`SharedPrefixes` learns what values the second effect:
- how often first turns start with each shared prefix (a moving average over about `TAU_S`), and
- how long each replica's prefix cache keeps a block: by Little's law, its resident blocks over the blocks it evicts
  a second, which for an LRU cache is the characteristic time T of Che's approximation (H. Che, Y. Tung, Z. Wang,
  "Hierarchical Web caching systems: modeling, design and experimental results", IEEE JSAC 20(7), 2002): a block
  requested at Poisson rate r is still cached when requested with probability 1 - exp(-r T). A cache that has
  evicted nothing yet has kept its blocks at least as long as it has been watched; that is its T until it evicts.
Spread over the N live replicas, first turns request the prefix on each at rate / N; computing it on a replica spares
the next of them its recompute, and the delay that recompute would impose on others, with that probability
(`reuse_probability`; the planner prices both, `kvtransfer/planner.py`).

Rates count the first turns this ingress plans: with several ingress replicas each sees its share, so the value is
underestimated, never overestimated.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from kvtransfer.prefix_key import HASH_BYTES, BlockHash, PrefixKey
from kvtransfer.types import LookupResult

# (resident blocks, blocks evicted so far) per replica, as the KV directory has them (`KVDirectory.cache_turnover`).
CacheTurnover = Mapping[str, tuple[int, int]]


def shared_prefix(key: PrefixKey, lookup: LookupResult) -> BlockHash | None:
    """The last block of the longest prefix of `key` cached on any replica (None: none is), which names the prefix."""
    cached = max((m.cached_tokens for m in lookup.matches), default=0)
    blocks = min(cached // key.block_size, len(key.hashes) // HASH_BYTES)
    return key.hashes[(blocks - 1) * HASH_BYTES : blocks * HASH_BYTES] if blocks else None


class SharedPrefixes:
    """First turns per second by shared prefix, and each replica's cache lifetime. Not thread-safe."""

    # Time constant (seconds) of both averages: long enough to count a tenant's first turns, short enough to follow
    # a change of traffic within a minute or two.
    TAU_S = 30.0
    # Prefixes whose rates are kept (the least recently seen is forgotten first).
    MAX_PREFIXES = 1024
    # The least time between two readings of the replicas' caches.
    SAMPLE_S = 1.0

    def __init__(self) -> None:
        self._seen: dict[BlockHash, tuple[float, float]] = {}  # prefix -> (first turns, decayed, as of when)
        self._now = 0.0  # the latest first turn seen: the clock rates are read at
        self._caches: dict[str, tuple[float, float, int, float, int]] = {}  # replica -> see `observe_caches`
        self._sampled_at: float | None = None

    def observe_first_turn(self, prefix: BlockHash, now_s: float) -> None:
        """A first turn starting with `prefix` (`shared_prefix`) ran at `now_s` (the caller's clock; mutates)."""
        count, at = self._seen.pop(prefix, (0.0, now_s))
        self._seen[prefix] = (count * math.exp(-max(0.0, now_s - at) / self.TAU_S) + 1.0, now_s)
        self._now = max(self._now, now_s)
        if len(self._seen) > self.MAX_PREFIXES:
            del self._seen[next(iter(self._seen))]

    def rate(self, prefix: BlockHash) -> float:
        """First turns per second starting with `prefix`, lately."""
        count, at = self._seen.get(prefix, (0.0, self._now))
        return count * math.exp(-max(0.0, self._now - at) / self.TAU_S) / self.TAU_S

    def observe_caches(self, turnover: Callable[[], CacheTurnover], now_s: float) -> None:
        """Read every replica's resident and evicted blocks (`turnover()`, called at most every SAMPLE_S) at `now_s`
        and update its eviction rate (mutates)."""
        if self._sampled_at is not None and now_s - self._sampled_at < self.SAMPLE_S:
            return
        self._sampled_at = now_s
        caches = {}
        for replica_id, (resident, evicted) in turnover().items():
            # (watched since, sampled at, evicted then, evictions a second, resident blocks)
            since, at, before, per_s, _ = self._caches.get(replica_id, (now_s, now_s, evicted, 0.0, resident))
            if now_s > at:
                weight = 1.0 - math.exp(-(now_s - at) / self.TAU_S)
                per_s += weight * (max(0, evicted - before) / (now_s - at) - per_s)
            caches[replica_id] = (since, now_s, evicted, per_s, resident)
        self._caches = caches  # replicas gone from the directory are forgotten

    def lifetime_s(self, replica_id: str) -> float:
        """How long the replica's cache keeps a block nobody uses: resident blocks / evictions a second, or how long
        it has been watched while it evicts nothing (0: never read)."""
        since, at, _, per_s, resident = self._caches.get(replica_id, (0.0, 0.0, 0, 0.0, 0))
        return resident / per_s if per_s > 0 else at - since

    def reuse_probability(self, prefix: BlockHash, replica_id: str, replicas: int) -> float:
        """The chance that the next first turn starting with `prefix` on `replica_id`, one of `replicas` sharing
        them, finds it still cached there (Che's approximation, module docstring)."""
        return 1.0 - math.exp(-self.rate(prefix) / max(1, replicas) * self.lifetime_s(replica_id))

    def as_dict(self) -> dict[str, object]:
        return {"prefixes": len(self._seen),
                "cache_lifetime_s": {r: round(self.lifetime_s(r), 1) for r in sorted(self._caches)}}
