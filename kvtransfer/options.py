"""What the planner weighs for a turn: the live replicas as it sees them, and the options they offer (a target
replica with a mode: reuse its prefix cache, pull, or recompute), each priced by the cost model.

The planner builds the options (`kvtransfer/planner.py`) and a placement policy picks one (`kvtransfer/policies/`);
both read these types, so a policy depends on this module and never on the planner.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from enum import StrEnum
from typing import NamedTuple

from kvtransfer.cost_model import CostModel
from kvtransfer.load import ReplicaView
from kvtransfer.types import HoldOffer


class Mode(StrEnum):
    LOCAL = "local"  # the target's own prefix cache holds part of the history
    PULL = "pull"  # the target pulls the history's KV from the holder over NIXL
    RECOMPUTE = "recompute"  # the target computes the whole prompt


# Of two options this close in cost, neither is clearly faster: an estimate is a fit with errors of a few
# milliseconds (`fastest` lets affinity decide within it; the kvrelay policy leaves a turn's home only beyond it).
STAY_MARGIN_MS = 5.0


class Option(NamedTuple):
    mode: Mode
    replica_id: str
    holder: str | None
    reused_tokens: int
    # The part of reused_tokens found in the target's own prefix cache (the rest is pulled).
    cached_tokens: int
    estimate_ms: float
    hold: HoldOffer | None = None
    # The fits' estimate before the planner's measured error scaled it (what that error is learned against).
    model_ms: float = 0.0
    # Delay this option imposes on other requests' first tokens: on its target, or on busy engines beside it.
    impact_ms: float = 0.0
    # What the conversation's later turns, which find their history on the target, add to first tokens there: their
    # compute slowed by the busy engines beside it, and, for a first turn, what turns typically wait there.
    later_turns_ms: float = 0.0
    # What computing a shared prefix here (a first turn's, cached elsewhere) spares the first turns sharing it next.
    seeds_ms: float = 0.0

    @property
    def cost_ms(self) -> float:
        """What the kvrelay policy minimizes: this turn's time to first token, the delay it causes others, and the
        delays its conversation's later turns will find where it leaves the history, less what it spares other
        conversations' first turns (their recompute and its delay to others) by caching a prefix they share."""
        return self.estimate_ms + self.impact_ms + self.later_turns_ms - self.seeds_ms


def contending_peers(replica: ReplicaView, cost: CostModel) -> int:
    """The busy engines beside `replica` that slow it: all of them where a node's engines share compute (CPU
    replicas, `CostModel.shared_compute`), else none. The planner's estimate error is kept apart for turns beside
    busy engines (their estimates also carry the contention fit's miss); where each engine has its own GPU, the
    node's other busy GPUs are no such thing, and splitting by them charged a holder beside busy GPUs the error
    that first turns made under load, so later turns left their cached history for a GPU on a quieter node
    (modelled: H100 profile, think-time workload, `benchmarks.fleet`)."""
    return replica.busy_peers if cost.shared_compute else 0


def busy_target(replica: ReplicaView, cost: CostModel) -> bool:
    """Whether a turn on `replica` runs on a busy engine whose node's engines share compute: such turns keep an
    estimate error of their own (`EstimateError`), for the busy engine's processes take the CPU their prefill needs.
    Where each engine has its own GPU, a prefill batched with decodes is what the fits and the queue price."""
    return cost.shared_compute and not replica.idle


def fastest(options: Sequence[Option], preferred_replica: str | None, rotation: int = 0) -> Option:
    """The option with the lowest cost; within 2% and STAY_MARGIN_MS of it, the preferred replica's (replicas'
    measured speeds differ by a few percent, and a short turn's estimates by a few milliseconds of noise). Of options
    that cost exactly the same, the one reusing more; then (idle replicas alike) in an order that `rotation`
    shuffles: taking the first listed sent every new conversation without a session to the same idle replica
    until it was busy, and a fleet's first turns queued on its first few replicas (modelled: 16 H100 replicas)."""
    bound = min(o.cost_ms for o in options) * 1.02 + STAY_MARGIN_MS
    near_best = [o for o in options if o.cost_ms <= bound]

    def rank(o: Option) -> tuple[float, float, int, int]:
        return (0.0 if o.replica_id == preferred_replica else 1.0, o.cost_ms, -o.reused_tokens,
                zlib.crc32(f"{rotation}:{o.replica_id}".encode()))

    return min(near_best, key=rank)
