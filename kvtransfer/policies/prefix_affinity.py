"""Prefix affinity: each turn on the replica holding the longest prefix of its prompt (of equals, the least loaded,
then by name), with its own prefix cache; never a pull. What a cache-aware router without a cost model does."""

from __future__ import annotations

from collections.abc import Sequence

from kvtransfer.options import Option
from kvtransfer.policies.base import PlacementPolicy, PolicyContext, register, without_pull


@register
class PrefixAffinityPolicy(PlacementPolicy):
    name = "prefix_affinity"

    def choose(self, options: Sequence[Option], context: PolicyContext) -> Option:
        ids = sorted({o.replica_id for o in options})
        held = {t: (m.num_tokens if (m := context.lookup.get(t)) else 0) for t in ids}
        load = {r.replica_id: r.running + r.waiting for r in context.replicas}
        return without_pull(options, min(ids, key=lambda t: (-held[t], load.get(t, 0), t)))
