"""Round robin: each turn on the next replica in turn, with whatever that replica's prefix cache holds; never a
pull. What a plain load balancer does."""

from __future__ import annotations

from collections.abc import Sequence

from kvtransfer.options import Option
from kvtransfer.policies.base import PlacementPolicy, PolicyContext, register, without_pull


def next_in_turn(options: Sequence[Option], rotation: int) -> str:
    """The replica whose turn it is: the targets in name order, walked by the caller's turn counter."""
    ids = sorted({o.replica_id for o in options})
    return ids[rotation % len(ids)]


@register
class RoundRobinPolicy(PlacementPolicy):
    name = "round_robin"

    def choose(self, options: Sequence[Option], context: PolicyContext) -> Option:
        return without_pull(options, next_in_turn(options, context.rotation))
