"""The turn planner: where a conversation turn runs, and whether it reuses a local prefix, pulls, or recomputes.

`plan_turn` is a pure function of the turn's length, the KV directory's answer, the live replicas' load and
the cost model. It weighs every (target replica, mode) pair and, under the `kvrelay` policy, returns the one
with the lowest cost: its estimated time to first token plus the delay it would impose on other requests' first
tokens (requests arriving at a busy target wait for its prefill; an idle engine that starts work slows the busy
engines sharing its node, by the measured contention, and with them the first tokens waiting or arriving there;
and on any target, the later turns the conversation will bring there keep it decoding beside the busy engines of
its node, slowing the first tokens arriving at them). Slower decoding is priced only through those first tokens:
it lengthens replies already started, not their wait.
So a busy holder can lose the turn to an idle replica that pulls from it, a turn joins a busy engine beside an
idle one when that engine is busy enough that slowing it would cost others more than the turn saves, and of two
busy engines the one with less traffic drains into the other as its conversations' next turns move. The other
policies are the routing rules users would otherwise run (round robin, session affinity, prefix affinity, vLLM's
fixed pull threshold), chosen from the same options so that benchmarks compare them on the same engines and every
plan still reports every estimate.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Collection, Sequence
from enum import StrEnum
from typing import NamedTuple

from configs.app import Policy
from kvtransfer.cost_model import CostModel, LoadView
from kvtransfer.types import HoldOffer, LookupResult

logger = logging.getLogger(__name__)


class Mode(StrEnum):
    LOCAL = "local"  # the target's own prefix cache holds part of the history
    PULL = "pull"  # the target pulls the history's KV from the holder over NIXL
    RECOMPUTE = "recompute"  # the target computes the whole prompt


# vLLM's own rule (`kv_recompute_threshold`): pull whenever the remote prefix has at least this many tokens.
VLLM_PULL_THRESHOLD = 64

# A turn leaves the replica that caches most of its history only for an option estimated at least this much
# faster (fraction and milliseconds both): an estimate is a fit with errors of about this size, and a move costs
# a transfer, a second copy of the KV and the stay replica's warm cache for the next turn.
STAY_MARGIN = 0.10
STAY_MARGIN_MS = 5.0
# Engine steps a read of a hold adds before the reading request's prefill runs (`_read_wait_ms`).
READ_STEPS = 1


class PeerLoad(NamedTuple):
    """A busy engine beside a replica on its node: the first tokens that replica's work would delay there."""

    # Requests waiting there for their first token, and their prompt tokens still to compute.
    waiting: int = 0
    prefill_tokens: int = 0
    # Requests per second sent there lately: how many arrive while the replica's work slows that engine.
    arrival_rate: float = 0.0


class ReplicaView(NamedTuple):
    """A live replica as the planner sees it."""

    replica_id: str
    running: int = 0
    waiting: int = 0
    decode_tok_s: float | None = None
    # Prompt tokens of requests known to be queued or prefilling there now (they run before a new turn).
    prefill_tokens: int = 0
    # Requests known to wait for their first token there (their tokens are in `prefill_tokens`).
    prefilling: int = 0
    # Other engines on the same node that are busy now: they share its CPUs.
    peers: tuple[PeerLoad, ...] = ()
    # Requests per second sent there lately by other conversations than the planned turn's: how many arrive while
    # a new turn's prefill holds it.
    arrival_rate: float = 0.0

    @property
    def busy_peers(self) -> int:
        return len(self.peers)

    @property
    def load(self) -> LoadView:
        return LoadView(self.running, self.waiting, self.decode_tok_s, self.prefill_tokens, self.busy_peers,
                        self.replica_id, self.prefilling)

    @property
    def idle(self) -> bool:
        return not (self.running or self.waiting or self.prefill_tokens or self.prefilling)


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

    @property
    def cost_ms(self) -> float:
        """What the kvrelay policy minimizes: this turn's time to first token plus the delay it causes others."""
        return self.estimate_ms + self.impact_ms


class Plan(NamedTuple):
    """The planner's decision for one turn, with every estimate it weighed."""

    replica_id: str
    mode: Mode
    holder: str | None
    reused_tokens: int
    cached_tokens: int
    estimate_ms: float
    # Best estimate per mode among the options that exist for this turn.
    estimates_ms: dict[str, float]
    reason: str
    # PULL: the hold to pull. LOCAL: the target's own hold of this history, which the turn reads when it reuses
    # more than the prefix cache has (`reads_hold`) and otherwise releases once it has run.
    hold: HoldOffer | None = None
    # Holds of this history the turn makes redundant (it leaves a longer one): release them once it runs.
    superseded: tuple[HoldOffer, ...] = ()
    # Busy engines beside the target on its node when planned (what its timings are measured under).
    busy_peers: int = 0
    # The chosen option's estimate before correction by the planner's measured error.
    model_ms: float = 0.0
    # The delay the chosen option imposes on other requests' first tokens (on its target or beside it).
    impact_ms: float = 0.0
    # The turn's place in its conversation as planned (0: its first; None: not known).
    turn_index: int | None = 0


def _options(
    num_tokens: int,
    lookup: LookupResult,
    replicas: Sequence[ReplicaView],
    cost: CostModel,
    targets: Collection[str] | None = None,
    output_tokens: int = 1,
    met: Collection[tuple[str, str]] | None = None,
    turn_index: int | None = None,
) -> list[Option]:
    live = {r.replica_id for r in replicas}
    future = cost.expected_future_turns(turn_index)
    # A hold on a replica that is not live cannot be pulled (the holder died or is leaving).
    holds = [m.hold for m in lookup.matches if m.hold is not None and m.replica_id in live]
    options: list[Option] = []
    for replica in replicas:
        if targets is not None and replica.replica_id not in targets:
            continue
        match = lookup.get(replica.replica_id)
        # vLLM computes at least the last prompt token, so at most num_tokens - 1 can be reused.
        cached = min(match.cached_tokens if match else 0, num_tokens - 1)
        # The target's own hold of this history: its prefix cache has the full blocks; reading the hold (a copy
        # inside the engine, no transfer) adds the last partial block.
        own_hold = match.hold if match is not None else None
        if own_hold is not None and own_hold.replica_id != replica.replica_id:
            own_hold = None
        queue = cost.queue_ms(replica.load)
        # From the prefix cache alone; and, where the target's own hold has more, reading that too.
        own = min(own_hold.num_tokens, num_tokens - 1) if own_hold is not None else 0
        for reused in (cached, own) if own > cached else (cached,):
            compute = cost.recompute_ms(num_tokens - reused, reused, replica.busy_peers, replica.replica_id)
            mode = Mode.LOCAL if reused > 0 else Mode.RECOMPUTE
            ms = queue + compute + (_read_wait_ms(replica, cost) if reused > cached else 0.0)
            options.append(Option(mode, replica.replica_id, None, reused, cached,
                                  cost.error.corrected(mode, contending_peers(replica, cost), ms), own_hold, ms,
                                  _impact_ms(replica, compute, output_tokens, cost, future)))
        for hold in holds:
            reused = min(hold.num_tokens, num_tokens - 1)
            if hold.replica_id == replica.replica_id or reused <= cached:
                continue
            transfer = cost.pull_ms(reused - cached)
            if met is not None and (replica.replica_id, hold.replica_id) not in met:
                transfer += cost.handshake_ms  # the target's first pull from this holder
            rest = cost.recompute_ms(num_tokens - reused, reused, replica.busy_peers, replica.replica_id)
            ms = queue + _read_wait_ms(replica, cost) + transfer + rest
            options.append(Option(Mode.PULL, replica.replica_id, hold.replica_id, reused, cached,
                                  cost.error.corrected(Mode.PULL, contending_peers(replica, cost), ms), hold, ms,
                                  _impact_ms(replica, rest, output_tokens, cost, future)))
    return options


def contending_peers(replica: ReplicaView, cost: CostModel) -> int:
    """The busy engines beside `replica` that slow it: all of them where a node's engines share compute (CPU
    replicas, `CostModel.shared_compute`), else none. The planner's estimate error is kept apart for turns beside
    busy engines (their estimates also carry the contention fit's miss); where each engine has its own GPU, the
    node's other busy GPUs are no such thing, and splitting by them charged a holder beside busy GPUs the error
    that first turns made under load, so later turns left their cached history for a GPU on a quieter node
    (modelled: H100 profile, think-time workload, `benchmarks.fleet`)."""
    return replica.busy_peers if cost.shared_compute else 0


def _read_wait_ms(target: ReplicaView, cost: CostModel) -> float:
    """What reading a hold adds on `target` besides the transfer: vLLM parks the reading request, starts the read
    in its next step and schedules the prefill only in a step after the read is done. On an idle engine such a
    step is a millisecond; on a busy one it is a decode step of the batch there (measured under a multi-turn load:
    local turns reading their own hold took about a decode step longer than turns using the prefix cache alone)."""
    return 0.0 if target.idle else READ_STEPS * cost.decode_step_ms


def _impact_ms(target: ReplicaView, compute_ms: float, output_tokens: int, cost: CostModel, future: float) -> float:
    """The delay a turn on `target` imposes on other requests' first tokens.

    On a busy target, requests that arrive while its prefill runs wait for it: at the target's recent arrival rate,
    about rate x compute^2 / 2 in all, so a long prefill on a busy engine costs far more than a short one. On an
    idle target, the node gains a busy engine for the turn's occupancy of it (its compute, then its decode at the
    solo step), and each busy engine beside it runs slower by the measured contention meanwhile: the requests
    waiting there for their first token get it later for as long as both work (the occupancy or that engine's
    prefill backlog, whichever ends first), and so do requests arriving there during the occupancy (at that
    engine's recent rate, about rate x occupancy of them, each for half of it on average). Requests already
    decoding there are slowed too, but their first tokens are out.

    A turn also decides where its conversation lives: its later turns find their history on the target and stay
    there (moving them costs a pull or a recompute), and each keeps the target decoding beside the busy engines of
    its node, whose arrivals are slowed again meanwhile, for `future` turns (`CostModel.expected_future_turns`: as
    many as recent conversations brought after the turn's place in its own). That is priced on a busy target too:
    whether it would stay busy without this conversation depends on where its other conversations go, and they are
    placed by the same rule. It makes two busy engines unequal (traffic being the other conversations' turns:
    `ReplicaView.arrival_rate` leaves out the turn's own conversation, whose later turns go wherever it goes): a
    conversation on the one with less traffic slows the arrivals at the busier one, and moves there (pulling its
    history) once that costs less, so the quieter engine drains. A CPU decode step
    costs about the same for one request or four, so one engine's batch grows almost for free, while a second
    engine decoding beside the first slows it (the measured contention: the cores themselves do not slow each
    other, benchmarks/two_cores.py, but with both engines busy the node's other processes, replica actors, ingress
    and Ray, take their CPU from the engines).
    """
    later = output_tokens * cost.decode_step_ms  # each later turn's stay: its decode (its prefill is short)
    stays = sum(cost.contention_impact_ms(later / 2, future * peer.arrival_rate / 1e3 * later, target.replica_id)
                for peer in target.peers)
    if not target.idle:
        return target.arrival_rate / 1e3 * compute_ms**2 / 2 + stays
    occupancy = compute_ms + output_tokens * cost.decode_step_ms
    return stays + sum(
        cost.contention_impact_ms(min(occupancy, cost.queued_prefill_ms(peer.prefill_tokens, peer.waiting)),
                                  peer.waiting, target.replica_id)
        + cost.contention_impact_ms(occupancy / 2, peer.arrival_rate / 1e3 * occupancy, target.replica_id)
        for peer in target.peers
    )


def plan_turn(
    num_tokens: int,
    lookup: LookupResult,
    replicas: Sequence[ReplicaView],
    cost: CostModel,
    preferred_replica: str | None = None,
    force: tuple[Mode, str] | None = None,
    targets: Collection[str] | None = None,
    policy: Policy = Policy.KVRELAY,
    rotation: int = 0,
    output_tokens: int = 1,
    met: Collection[tuple[str, str]] | None = None,
    turn_index: int | None = None,
) -> Plan:
    """Choose target replica and mode together; under `Policy.KVRELAY`, the lowest cost: estimated time to first
    token plus the delay imposed on requests running beside the target (`output_tokens`: how long the turn will
    decode there, which is how long it keeps an idle target busy). `met`: the (puller, holder) pairs that have
    pulled before; a pull between any other two replicas also pays NIXL's handshake (None: every pair has met).
    `turn_index`: the turn's place in its conversation (0: its first; None: not known), which tells how many more
    turns the conversation will bring wherever the turn runs.

    `preferred_replica` (a session's usual replica) wins near-ties (2% and 5 ms), so equal options keep affinity; under
    `Policy.SESSION` it is the target. `rotation` is the caller's turn counter for the round-robin policies.
    `force` = (mode, replica) restricts the choice to that pair (tests and benchmarks measure every option);
    its estimates still cover every option. Raises ValueError if the forced option does not exist.
    `targets` limits where the turn may run (a prefill pool, a benchmark's "off the holder" question);
    holds on any live replica can still be pulled.
    """
    if not replicas:
        raise ValueError("no live engine replica to plan on")
    if num_tokens <= 0:
        raise ValueError("a turn needs at least one prompt token")
    options = _options(num_tokens, lookup, replicas, cost, targets, output_tokens, met, turn_index)
    if not options:
        raise ValueError(f"none of the target replicas {sorted(targets or [])} is live")
    if force is not None:
        mode, replica_id = force
        candidates = [o for o in options if o.replica_id == replica_id and (
            o.mode is mode or (mode is Mode.RECOMPUTE and o.mode is not Mode.PULL))]
        if not candidates:
            raise ValueError(f"no {mode.value} option on replica {replica_id} for this turn")
        chosen = _fastest(candidates, preferred_replica, rotation)
        if mode is Mode.RECOMPUTE:
            chosen = chosen._replace(mode=Mode.RECOMPUTE, reused_tokens=0, cached_tokens=0, hold=None)
    elif policy is Policy.KVRELAY:
        peers = {r.replica_id: contending_peers(r, cost) for r in replicas}
        fastest = _fastest(options, preferred_replica, rotation)
        # A conversation's first turn has no history of its own to stay with: what it finds cached is a prefix other
        # conversations share (a system prompt), which any replica can compute once and then keep.
        chosen = fastest if turn_index == 0 else _stay_unless_clearly_faster(options, fastest, cost, peers)
    else:
        chosen = _baseline_choice(policy, options, lookup, replicas, preferred_replica, rotation)
    estimates: dict[str, float] = {}
    for o in options:
        estimates[o.mode] = round(min(estimates.get(o.mode, float("inf")), o.estimate_ms), 2)
    reason = _reason(chosen, estimates, num_tokens)
    if policy is not Policy.KVRELAY and force is None:
        reason = f"{policy.value} policy: {reason}"
    logger.debug("plan for %d tokens: %s (%s)", num_tokens, chosen, reason)
    return Plan(
        replica_id=chosen.replica_id,
        mode=chosen.mode,
        holder=chosen.holder,
        reused_tokens=chosen.reused_tokens,
        cached_tokens=chosen.cached_tokens,
        estimate_ms=round(chosen.estimate_ms, 2),
        estimates_ms=estimates,
        reason=reason,
        hold=chosen.hold,
        superseded=tuple(
            m.hold for m in lookup.matches
            if m.hold is not None and not (reads_hold(chosen) and m.hold.hold_id == chosen.hold.hold_id)
        ),
        busy_peers=next(contending_peers(r, cost) for r in replicas if r.replica_id == chosen.replica_id),
        model_ms=round(chosen.model_ms, 2),
        impact_ms=round(chosen.impact_ms, 2),
        turn_index=turn_index,
    )


def reads_hold(plan: Plan | Option) -> bool:
    """Whether the turn reads `plan.hold`: a pull, or a local turn reusing more than its target's prefix cache has
    (its own hold's last partial block)."""
    return plan.hold is not None and (
        plan.mode is Mode.PULL or (plan.mode is Mode.LOCAL and plan.reused_tokens > plan.cached_tokens))


def _fastest(options: Sequence[Option], preferred_replica: str | None, rotation: int = 0) -> Option:
    """The option with the lowest cost; within 2% and STAY_MARGIN_MS of it, the preferred replica's (replicas'
    measured speeds differ by a few percent, and a short turn's estimates by a few milliseconds of noise). Of options
    that cost exactly the same, the one reusing more; then (idle replicas alike) in an order that `rotation`
    shuffles: taking the first listed sent every new conversation without a session to the same idle replica
    until it was busy, and a fleet's first turns queued on its first few replicas (modelled: 16 H100 replicas)."""
    best_ms = min(o.cost_ms for o in options)

    def rank(o: Option) -> tuple[bool, float, float, int, int]:
        near_best = o.cost_ms <= best_ms * 1.02 + STAY_MARGIN_MS
        return (not near_best, 0.0 if near_best and o.replica_id == preferred_replica else 1.0, o.cost_ms,
                -o.reused_tokens, zlib.crc32(f"{rotation}:{o.replica_id}".encode()))

    return min(options, key=rank)


def _stay_unless_clearly_faster(
    options: Sequence[Option], fastest: Option, cost: CostModel, busy_peers: dict[str, int]
) -> Option:
    """`fastest`, unless it leaves the replica caching the longest part of the history, or pulls onto it what it
    could compute from its own cache, without costing at least STAY_MARGIN and STAY_MARGIN_MS less than staying
    there, and less by more than the planner's measured uncertainty for the two kinds of turn (`departure_noise_ms`).
    A pull costs more than its estimate shows: the holder's CPU for the transfer, and a second copy of the
    KV (measured in P/D, where kvrelay pulled onto the prefill replica whenever the estimate was a few percent
    lower: every turn of that run came slower than on the replica's own cache alone). And a gain within what the
    estimates miss by is no gain: with a badly calibrated cost model (an error offset learned on other turns, a
    kind with few samples) the planner keeps the affinity choice instead of moving on noise."""
    stays = [o for o in options if o.mode is Mode.LOCAL]
    if not stays:
        return fastest
    most = max(o.reused_tokens for o in stays)
    homes = {o.replica_id for o in stays if o.reused_tokens == most}
    stay = min((o for o in stays if o.replica_id in homes), key=lambda o: o.cost_ms)
    if fastest.replica_id == stay.replica_id and fastest.mode is not Mode.PULL:
        return fastest
    noise = departure_noise_ms(stay, fastest, cost, busy_peers)
    if fastest.cost_ms <= stay.cost_ms * (1 - STAY_MARGIN) - STAY_MARGIN_MS - noise:
        return fastest
    return stay


def departure_noise_ms(stay: Option, move: Option, cost: CostModel, busy_peers: dict[str, int]) -> float:
    """How much of a move's estimated gain over staying could be the estimates' own error: the two kinds' measured
    uncertainties (`EstimateError.uncertainty_ms`), combined as independent errors."""
    u_stay = cost.error.uncertainty_ms(stay.mode, busy_peers.get(stay.replica_id, 0))
    u_move = cost.error.uncertainty_ms(move.mode, busy_peers.get(move.replica_id, 0))
    return (u_stay**2 + u_move**2) ** 0.5


def _baseline_choice(
    policy: Policy,
    options: Sequence[Option],
    lookup: LookupResult,
    replicas: Sequence[ReplicaView],
    preferred_replica: str | None,
    rotation: int,
) -> Option:
    """The option a conventional router would run: its target by its own rule, and no cost model."""
    by_target: dict[str, list[Option]] = {}
    for o in options:
        by_target.setdefault(o.replica_id, []).append(o)
    ids = sorted(by_target)
    load = {r.replica_id: r.running + r.waiting for r in replicas}
    if policy is Policy.SESSION and preferred_replica in by_target:
        target = preferred_replica
    elif policy is Policy.PREFIX_AFFINITY:
        held = {t: (m.num_tokens if (m := lookup.get(t)) else 0) for t in ids}
        target = min(ids, key=lambda t: (-held[t], load.get(t, 0), t))
    else:  # round robin; also SESSION without a session id
        target = ids[rotation % len(ids)]
    own = next(o for o in by_target[target] if o.mode is not Mode.PULL)
    if policy is Policy.FIXED_THRESHOLD:
        pulls = [o for o in by_target[target] if o.mode is Mode.PULL]
        longest = max(pulls, key=lambda o: o.reused_tokens, default=None)
        if longest is not None and longest.reused_tokens - own.cached_tokens >= VLLM_PULL_THRESHOLD:
            return longest
    return own


def _reason(chosen: Option, estimates: dict[str, float], num_tokens: int) -> str:
    others = ", ".join(f"{m} {ms:.0f} ms" for m, ms in estimates.items() if m != chosen.mode)
    what = {
        Mode.LOCAL: f"{chosen.reused_tokens}/{num_tokens} tokens already cached on the target",
        Mode.PULL: f"pull {chosen.reused_tokens}/{num_tokens} tokens from {chosen.holder}",
        Mode.RECOMPUTE: f"compute all {num_tokens} tokens",
    }[chosen.mode]
    slows = f", delaying others' first tokens by {chosen.impact_ms:.0f} ms" if chosen.impact_ms >= 0.5 else ""
    return f"{what}: {chosen.estimate_ms:.0f} ms{slows}" + (f" (vs {others})" if others else "")
