"""Session affinity: each turn on its session's replica (rendezvous hash of `X-Session-Id`), whatever it holds;
never a pull. A turn without a session, or whose session's replica may not take it, goes round robin."""

from __future__ import annotations

from collections.abc import Sequence

from kvtransfer.options import Option
from kvtransfer.policies.base import PlacementPolicy, PolicyContext, register, without_pull
from kvtransfer.policies.round_robin import next_in_turn


@register
class SessionPolicy(PlacementPolicy):
    name = "session"

    def choose(self, options: Sequence[Option], context: PolicyContext) -> Option:
        preferred = context.preferred_replica
        if preferred is not None and any(o.replica_id == preferred for o in options):
            return without_pull(options, preferred)
        return without_pull(options, next_in_turn(options, context.rotation))
