"""The cost model's estimates for one plan, each term computed once (`PlanPrices`).

A plan on 64 replicas with a few holds prices hundreds of options, whose prefills share a few lengths, whose pulls
share a few holders, and whose replicas each price all their options at one slowdown and speed: priced from scratch,
a plan made ~640 fit predictions, most of its time (`python -m benchmarks.plan_time`). One instance serves one plan:
the cost model does not change while it lives.
"""

from __future__ import annotations

from kvtransfer.cost_model import CostModel
from kvtransfer.estimate_error import with_offset
from kvtransfer.load import ReplicaView


class PlanPrices:
    """`CostModel.recompute_ms`, `CostModel.pull_ms` and `EstimateError.corrected` for one plan, memoized."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self._solo: dict[tuple[int, int], float] = {}
        self._factors: dict[str, tuple[float, float]] = {}
        self._pulls: dict[tuple[int, str | None], float] = {}
        self._offsets: dict[tuple[str, int, bool], float] = {}

    def recompute_ms(self, new_tokens: int, context_tokens: int, replica: ReplicaView) -> float:
        """`CostModel.recompute_ms` on `replica` beside its busy peers."""
        if new_tokens <= 0:
            return 0.0
        solo = self._solo.get((new_tokens, context_tokens))
        if solo is None:
            solo = self._solo[new_tokens, context_tokens] = self.cost.solo_prefill_ms(new_tokens, context_tokens)
        factors = self._factors.get(replica.replica_id)
        if factors is None:
            factors = self._factors[replica.replica_id] = self.cost.prefill_factors(replica.busy_peers,
                                                                                    replica.replica_id)
        return solo * factors[0] * factors[1]

    def pull_ms(self, num_tokens: int, holder: ReplicaView | None) -> float:
        """`CostModel.pull_ms` from `holder`."""
        key = (num_tokens, holder.replica_id if holder is not None else None)
        ms = self._pulls.get(key)
        if ms is None:
            ms = self._pulls[key] = self.cost.pull_ms(num_tokens, holder)
        return ms

    def corrected(self, mode: str, busy_peers: int, estimate_ms: float, busy_target: bool) -> float:
        """`EstimateError.corrected`."""
        offset = self._offsets.get((mode, busy_peers, busy_target))
        if offset is None:
            offset = self._offsets[mode, busy_peers, busy_target] = self.cost.error.offset_ms(mode, busy_peers,
                                                                                              busy_target)
        return with_offset(estimate_ms, offset)
