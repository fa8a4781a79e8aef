"""kvrelay's own policy: the option with the lowest cost as the planner priced it (the turn's time to first token
plus the delay it imposes on others' first tokens), except that a turn leaves the replica caching most of its
history only for an option clearly cheaper than staying."""

from __future__ import annotations

from collections.abc import Sequence

from kvtransfer.cost_model import CostModel
from kvtransfer.options import STAY_MARGIN_MS, Mode, Option, busy_target, contending_peers, fastest
from kvtransfer.policies.base import PlacementPolicy, PolicyContext, register
from kvtransfer.policies.prefix_affinity import PrefixAffinityPolicy

# A turn leaves the replica that caches most of its history only for an option estimated at least this much
# faster (this fraction and STAY_MARGIN_MS both): an estimate is a fit with errors of about this size, and a move
# costs a transfer, a second copy of the KV and the stay replica's warm cache for the next turn.
STAY_MARGIN = 0.10


@register
class KvrelayPolicy(PlacementPolicy):
    name = "kvrelay"
    pulls = True

    def choose(self, options: Sequence[Option], context: PolicyContext) -> Option:
        best = fastest(options, context.preferred_replica, context.rotation)
        situations = {r.replica_id: (contending_peers(r, context.cost), busy_target(r, context.cost))
                      for r in context.replicas}
        # A conversation's first turn has no history of its own to stay with: what it finds cached is a prefix other
        # conversations share (a system prompt), which any replica can compute once and then keep. It owes the
        # replica caching it no margin (held by one, kvrelay's p90 on the modelled hot-tenant workload was 483 ms
        # against session affinity's 75), only a gain beyond what the estimates miss by: where they are unsure, the
        # conversation starts where prefix affinity would start it.
        if context.turn_index == 0:
            # Its place is also its conversation's home. Where a node's engines slow each other, a home beside a busy
            # engine slows that engine for every later turn the conversation brings there (`planner._Impact`), a
            # price read from the workload forecast; before the forecast has seen enough turns to say whether
            # conversations go on, the estimates cannot tell whether starting a second engine pays, and the
            # conversation starts where prefix affinity would start it. Priced as one-shot traffic, the four first
            # turns of aiperf's multi-turn run on two CPU replicas (closed loop, four at a time) split between the
            # two engines in three runs of four, and every later turn there ran beside the other engine's: TTFT p50
            # 0.89x of prefix affinity's, which kept them on one engine (1.03x in the run where kvrelay did too).
            if context.cost.contention_per_peer() > 0 and not context.cost.workload.knows_future:
                return PrefixAffinityPolicy().choose(options, context)
            return stay_unless_clearly_faster(options, best, context.cost, situations, margin=0.0, margin_ms=0.0)
        return stay_unless_clearly_faster(options, best, context.cost, situations)


def stay_unless_clearly_faster(
    options: Sequence[Option], best: Option, cost: CostModel, situations: dict[str, tuple[int, bool]],
    margin: float = STAY_MARGIN, margin_ms: float = STAY_MARGIN_MS,
) -> Option:
    """`best` (the cheapest option, by `fastest`), unless it leaves the replica caching the longest part of the
    history, or pulls onto it what it could compute from its own cache, without costing at least `margin` and
    `margin_ms` less than staying there, and less by more than the planner's measured uncertainty for the two
    kinds of turn (`departure_noise_ms`). A pull costs more than its estimate shows: the holder's CPU for the
    transfer, and a second copy of the KV (measured in P/D, where kvrelay pulled onto the prefill replica whenever
    the estimate was a few percent lower: every turn of that run came slower than on the replica's own cache alone).
    And a gain within what the estimates miss by is no gain: with a badly calibrated cost model (an error offset
    learned on other turns, a kind with few samples) the planner keeps the affinity choice instead of moving on
    noise."""
    stays = [o for o in options if o.mode is Mode.LOCAL]
    if not stays:
        return best
    most = max(o.reused_tokens for o in stays)
    homes = {o.replica_id for o in stays if o.reused_tokens == most}
    stay = min((o for o in stays if o.replica_id in homes), key=lambda o: o.cost_ms)
    if best.replica_id == stay.replica_id and best.mode is not Mode.PULL:
        return best
    noise = departure_noise_ms(stay, best, cost, situations)
    if best.cost_ms <= stay.cost_ms * (1 - margin) - margin_ms - noise:
        return best
    return stay


def departure_noise_ms(stay: Option, move: Option, cost: CostModel, situations: dict[str, tuple[int, bool]]) -> float:
    """How much of a move's estimated gain over staying could be the estimates' own error: the two kinds' measured
    uncertainties (`EstimateError.uncertainty_ms`; a replica's situation: its contending busy peers, and whether it
    is a busy target), combined as independent errors."""
    u_stay = cost.error.uncertainty_ms(stay.mode, *situations.get(stay.replica_id, (0, False)))
    u_move = cost.error.uncertainty_ms(move.mode, *situations.get(move.replica_id, (0, False)))
    return (u_stay**2 + u_move**2) ** 0.5
