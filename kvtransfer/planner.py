"""The turn planner: where a conversation turn runs, and whether it reuses a local prefix, pulls, or recomputes.

`plan_turn` is a pure function of the turn's length, the KV directory's answer, the live replicas' load and the cost
model. It weighs every (target replica, mode) pair and, under the `kvrelay` policy, returns the one with the lowest
cost: its estimated time to first token plus the delay it would impose on other requests' first tokens (requests
arriving at a busy target wait for its prefill; an idle engine that starts work slows the busy engines sharing its
node, by the measured contention, and with them the first tokens waiting or arriving there; and on any target, the
later turns the conversation will bring there keep it decoding beside the busy engines of its node, slowing the
first tokens arriving at them). Slower decoding is priced only through those first tokens: it lengthens replies
already started, not their wait. Wherever a turn runs, its conversation's later turns will find their history: they
compute there beside the node's busy engines, slower by the measured contention, which each option is priced for. A
conversation's first turn founds that home: its later turns will also wait there what turns typically wait there
(`CostModel.typical_wait`), so each of its options is priced for those waits too; and one that computes a prefix
other replicas cache (a shared system prompt) leaves it cached on the target for the next first turns sharing it,
whose recompute it is credited with, by the chance they find it still there (`CostModel.shared_prefixes`). So a busy
holder can lose the turn to an idle replica that pulls from it, a turn joins a busy engine beside an idle one when
that engine is busy enough that slowing it would cost others more than the turn saves, and of two busy engines the
one with less traffic drains into the other as its conversations' next turns move. The choice among the priced
options is a placement policy's (`kvtransfer/policies/`, one file each): kvrelay's own, or one of the routing rules
users would otherwise run (round robin, session affinity, prefix affinity, vLLM's fixed pull threshold), chosen from
the same options so that benchmarks compare them on the same engines and every plan still reports every estimate."""

from __future__ import annotations

import logging
from bisect import bisect_right
from collections.abc import Callable, Collection, Sequence
from itertools import accumulate
from typing import NamedTuple

from kvtransfer.cost_model import CostModel
from kvtransfer.load import ReplicaView
from kvtransfer.options import Mode, Option, busy_target, contending_peers, fastest
from kvtransfer.plan_prices import PlanPrices
from kvtransfer.policies import DEFAULT_POLICY, PlacementPolicy, PolicyContext, get_policy
from kvtransfer.prefix_key import BlockHash
from kvtransfer.types import HoldOffer, LookupResult, ReplicaMatch

logger = logging.getLogger(__name__)


# Engine steps a read of a hold adds before the reading request's prefill runs (`_read_wait_ms`).
READ_STEPS = 1


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
    # Whether the target was busy when planned, on a node whose engines share compute (`options.busy_target`).
    busy_target: bool = False
    # The chosen option's estimate before correction by the planner's measured error.
    model_ms: float = 0.0
    # The delay the chosen option imposes on other requests' first tokens (on its target or beside it).
    impact_ms: float = 0.0
    # The turn's place in its conversation as planned (0: its first; None: not known).
    turn_index: int | None = 0
    # PULL: whether the holder was busy when planned (which of the cost model's pull fits the transfer teaches).
    holder_busy: bool = False
    # Each weighed target's queue when planned: what `CostModel.typical_wait` averages once the turn is dispatched.
    queues_ms: dict[str, float] = {}
    # A first turn's prompt prefix cached on some replica, by its last block (`shared_prefix`), as planned: what
    # `CostModel.shared_prefixes` counts once the turn is dispatched.
    shared_prefix: BlockHash | None = None


def _options(
    num_tokens: int,
    lookup: LookupResult,
    replicas: Sequence[ReplicaView],
    cost: CostModel,
    targets: Collection[str] | None = None,
    output_tokens: int = 1,
    met: Collection[tuple[str, str]] | None = None,
    turn_index: int | None = None,
    queues: dict[str, float] | None = None,
    founds_home: bool = True,
    shared_prefix: BlockHash | None = None,
) -> list[Option]:
    """Every (target, mode) option for the turn, priced; `queues` (if given) receives each target's queue estimate."""
    live = {r.replica_id: r for r in replicas}
    prices = PlanPrices(cost)
    impact = _Impact(cost, output_tokens, cost.workload.expected_future_turns(turn_index))
    matches: dict[str, ReplicaMatch] = {}
    for m in lookup.matches:
        matches.setdefault(m.replica_id, m)
    # A hold on a replica that is not live cannot be pulled (the holder died or is leaving).
    holds = [m.hold for m in lookup.matches if m.hold is not None and m.replica_id in live]
    # A first turn computing its prompt's prefix that other replicas cache, where it founds its home, leaves it
    # cached there for the first turns sharing it next (`kvtransfer/shared_prefix.py`).
    shared = 0
    if turn_index == 0 and founds_home and shared_prefix is not None:
        shared = min(max((m.cached_tokens for m in lookup.matches), default=0), num_tokens - 1)
    options: list[Option] = []
    for replica in replicas:
        if targets is not None and replica.replica_id not in targets:
            continue
        match = matches.get(replica.replica_id)
        # vLLM computes at least the last prompt token, so at most num_tokens - 1 can be reused.
        cached = min(match.cached_tokens if match else 0, num_tokens - 1)
        # The target's own hold of this history: its prefix cache has the full blocks; reading the hold (a copy
        # inside the engine, no transfer) adds the last partial block.
        own_hold = match.hold if match is not None else None
        if own_hold is not None and own_hold.replica_id != replica.replica_id:
            own_hold = None
        queue = cost.queue_ms(replica)
        if queues is not None:
            queues[replica.replica_id] = queue
        contending, on_busy, impact_ms = contending_peers(replica, cost), busy_target(replica, cost), impact.on(replica)
        # Where the turn runs, its conversation's later turns find their history: they will compute beside the busy
        # engines of the target's node, slower by the measured contention, and, priced for a first turn, wait there
        # what turns typically wait (a later turn's move is the stay rule's: a transient queue would move it off a
        # holder about to be idle).
        later = impact.future * _later_turn_ms(replica, contending, cost, turn_index == 0) if founds_home else 0.0
        # From the prefix cache alone; and, where the target's own hold has more, reading that too.
        own = min(own_hold.num_tokens, num_tokens - 1) if own_hold is not None else 0
        for reused in (cached, own) if own > cached else (cached,):
            compute = prices.recompute_ms(num_tokens - reused, reused, replica)
            mode = Mode.LOCAL if reused > 0 else Mode.RECOMPUTE
            ms = queue + compute + (cost.take_hold_ms + _read_wait_ms(replica, cost) if reused > cached else 0.0)
            imposed = impact_ms(compute)
            seeds = 0.0
            if shared > reused:
                # The next first turn sharing the prefix here would compute only the rest: its first token sooner,
                # and the requests beside it delayed less.
                rest = prices.recompute_ms(num_tokens - shared, shared, replica)
                spared = compute - rest + imposed - impact_ms(rest)
                seeds = spared * cost.shared_prefixes.reuse_probability(shared_prefix, replica.replica_id, len(live))
            options.append(Option(mode, replica.replica_id, None, reused, cached,
                                  prices.corrected(mode, contending, ms, on_busy), own_hold, ms, imposed, later, seeds))
        for hold in holds:
            reused = min(hold.num_tokens, num_tokens - 1)
            if hold.replica_id == replica.replica_id or reused <= cached:
                continue
            transfer = prices.pull_ms(reused - cached, live.get(hold.replica_id))
            if met is not None and (replica.replica_id, hold.replica_id) not in met:
                transfer += cost.handshake_ms  # the target's first pull from this holder
            rest = prices.recompute_ms(num_tokens - reused, reused, replica)
            ms = queue + cost.take_hold_ms + _read_wait_ms(replica, cost) + transfer + rest
            options.append(Option(Mode.PULL, replica.replica_id, hold.replica_id, reused, cached,
                                  prices.corrected(Mode.PULL, contending, ms, on_busy), hold, ms, impact_ms(rest),
                                  later))
    return options


def _later_turn_ms(target: ReplicaView, contending: int, cost: CostModel, waits: bool) -> float:
    """What each later turn of a conversation living on `target` adds to first tokens there: its compute (a turn's
    typical) slowed by the `contending` busy engines beside `target` while they stay busy, and if `waits`, its
    typical wait with the waits it adds to others' (`TypicalWait.marginal_ms`). Priced by the wait alone, new
    conversations under aiperf's closed loop on two CPU replicas started on the idle engine beside the one serving the
    four others (a wait of 200 ms a turn there against none), and a later turn queued there pulled its history over:
    from then on both engines computed at once, and every later turn's prefill ran slower beside the other's (TTFT
    p50 0.81x of prefix affinity's, which kept every conversation on one engine)."""
    typical = cost.typical_wait
    slowed = (cost.slowdown(contending, target.replica_id) - 1.0) * (typical.service_ms or 0.0)
    return slowed + (typical.marginal_ms(target.replica_id) if waits else 0.0)


def _read_wait_ms(target: ReplicaView, cost: CostModel) -> float:
    """What reading a hold adds on `target` besides the transfer: vLLM parks the reading request, starts the read
    in its next step and schedules the prefill only in a step after the read is done. On an idle engine such a
    step is a millisecond; on a busy one it is a decode step of the batch there (measured under a multi-turn load:
    local turns reading their own hold took about a decode step longer than turns using the prefix cache alone), as
    the replica's recent requests decoded (`CostModel.step_ms`), not a request decoding alone: under aiperf's
    multi-turn load on two CPU replicas those steps took 130-200 ms, against the solo step's 20 ms prior (or 88 ms
    measured), and reading a hold to save the last partial block's prefill looked cheaper than it was."""
    return 0.0 if target.idle else READ_STEPS * cost.step_ms(target)


class _BusyPeers:
    """Sums over a set of busy engines beside a target, all that `_Impact` reads of them: their arrival rate, and
    their requests waiting for a first token by how long the prefills queued there will take. Built once per set
    (the idle replicas of a node share theirs, `with_busy_peers`), so that pricing an option costs a bisection
    instead of a pass over the node's busy engines."""

    def __init__(self, peers: Sequence[ReplicaView], cost: CostModel) -> None:
        self.arrival_per_ms = sum(p.arrival_rate for p in peers) / 1e3
        self._peers, self._cost = peers, cost
        self._backlog_ms: list[float] | None = None  # built on first use: only idle targets read it

    def waiting_overlap_ms(self, occupancy_ms: float) -> float:
        """Over the waiting requests, how long each waits while a turn occupies an engine beside them for
        `occupancy_ms`: the overlap with its engine's queued prefills, whichever ends first."""
        if self._backlog_ms is None:
            # Each one's queued prefills, less what its engine has done of them.
            backlog = sorted((p.left_of(self._cost.queued_prefill_ms(p.prefill_tokens, p.awaiting_first_token)),
                              p.awaiting_first_token) for p in self._peers if p.awaiting_first_token)
            self._backlog_ms = [ms for ms, _ in backlog]
            # Over the backlogs before each index: their waiting requests x backlog, and their waiting requests.
            self._work = list(accumulate((ms * n for ms, n in backlog), initial=0.0))
            self._waiting = list(accumulate((n for _, n in backlog), initial=0))
        k = bisect_right(self._backlog_ms, occupancy_ms)
        return self._work[k] + occupancy_ms * (self._waiting[-1] - self._waiting[k])


class _Impact:
    """The delay a turn on a target imposes on other requests' first tokens, for one plan (its turn's output length
    and the later turns its conversation brings); per-target and per-node terms are computed once per plan.

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
    its node, whose arrivals are slowed again meanwhile, for `future` turns
    (`WorkloadForecast.expected_future_turns`: as many as recent conversations brought after the turn's place in
    its own). That is priced on a busy target too:
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

    def __init__(self, cost: CostModel, output_tokens: int, future: float) -> None:
        self.cost = cost
        # Each later turn's stay on the target: its decode (its prefill is short).
        self.output_ms = output_tokens * cost.decode_step_ms
        self.future = future
        self._peers: dict[int, tuple[tuple[ReplicaView, ...], _BusyPeers]] = {}

    def _busy_peers(self, target: ReplicaView) -> _BusyPeers:
        cached = self._peers.get(id(target.peers))
        if cached is None or cached[0] is not target.peers:
            cached = self._peers[id(target.peers)] = (target.peers, _BusyPeers(target.peers, self.cost))
        return cached[1]

    def on(self, target: ReplicaView) -> Callable[[float], float]:
        """The impact of a turn on `target` by its compute time there (ms)."""
        per_peer = self.cost.contention_per_peer(target.replica_id)
        arrival_per_ms = target.arrival_rate / 1e3
        if per_peer == 0.0:  # engines that do not slow each other (a GPU each): only a busy target's arrivals wait
            return (lambda compute_ms: arrival_per_ms * compute_ms**2 / 2) if not target.idle else _no_impact
        peers = self._busy_peers(target)
        later = self.output_ms
        stays = per_peer * (later / 2) * (self.future * peers.arrival_per_ms * later)
        if not target.idle:
            return lambda compute_ms: arrival_per_ms * compute_ms**2 / 2 + stays

        def idle_target(compute_ms: float) -> float:
            occupancy = compute_ms + later
            return stays + per_peer * peers.waiting_overlap_ms(occupancy) + per_peer * (occupancy / 2) * (
                peers.arrival_per_ms * occupancy)

        return idle_target


def _no_impact(compute_ms: float) -> float:
    return 0.0


def plan_turn(
    num_tokens: int,
    lookup: LookupResult,
    replicas: Sequence[ReplicaView],
    cost: CostModel,
    preferred_replica: str | None = None,
    force: tuple[Mode, str] | None = None,
    targets: Collection[str] | None = None,
    policy: PlacementPolicy | str = DEFAULT_POLICY,
    rotation: int = 0,
    output_tokens: int = 1,
    met: Collection[tuple[str, str]] | None = None,
    turn_index: int | None = None,
    founds_home: bool = True,
    shared_prefix: BlockHash | None = None,
) -> Plan:
    """Choose target replica and mode together: price every option, then let `policy` (a policy or its registered
    name, `kvtransfer/policies/`) choose one. An option's cost is its estimated time to first token plus the delay
    it imposes on requests running beside the target (`output_tokens`: how long the turn will decode there, which is
    how long it keeps an idle target busy). `met`: the (puller, holder) pairs that have pulled before; a pull between
    any other two replicas also pays NIXL's handshake (None: every pair has met). `turn_index`: the turn's place in
    its conversation (0: its first; None: not known), which tells how many more turns the conversation will bring
    wherever the turn runs. `founds_home`: whether the target keeps the turn's KV for the conversation's later turns,
    so that a first turn is also priced for the waits they will find there; not in P/D, where the decode pool holds
    the history and each later turn starts wherever the prefill pool has room (priced for them, the first turns of a
    modelled 16-replica P/D fleet went where queues were short on average rather than now: `long_history` TTFT p50
    900 ms against 404 without, `benchmarks.fleet --topology disaggregated`).

    `preferred_replica` (a session's usual replica) and `rotation` (the caller's turn counter) are the policy's to
    weigh: kvrelay's lets the preferred replica win near-ties (2% and 5 ms), so equal options keep affinity; session
    affinity runs the turn there; round robin walks the replicas by `rotation`.
    `force` = (mode, replica) restricts the choice to that pair, whatever the policy (tests and benchmarks measure
    every option), reusing all it can there; its estimates still cover every option. Raises ValueError if the forced
    option does not exist.
    `targets` limits where the turn may run (a prefill pool, a benchmark's "off the holder" question);
    holds on any live replica can still be pulled.
    """
    if isinstance(policy, str):
        policy = get_policy(policy)
    if not replicas:
        raise ValueError("no live engine replica to plan on")
    if num_tokens <= 0:
        raise ValueError("a turn needs at least one prompt token")
    queues: dict[str, float] = {}
    options = _options(num_tokens, lookup, replicas, cost, targets, output_tokens, met, turn_index, queues,
                       founds_home, shared_prefix)
    if not options:
        raise ValueError(f"none of the target replicas {sorted(targets or [])} is live")
    if force is not None:
        mode, replica_id = force
        candidates = [o for o in options if o.replica_id == replica_id and (
            o.mode is mode or (mode is Mode.RECOMPUTE and o.mode is not Mode.PULL))]
        if not candidates:
            raise ValueError(f"no {mode.value} option on replica {replica_id} for this turn")
        if mode is not Mode.RECOMPUTE:  # the mode itself, as far as it goes: a hold's last partial block too
            most = max(o.reused_tokens for o in candidates)
            candidates = [o for o in candidates if o.reused_tokens == most]
        chosen = fastest(candidates, preferred_replica, rotation)
        if mode is Mode.RECOMPUTE:
            chosen = chosen._replace(mode=Mode.RECOMPUTE, reused_tokens=0, cached_tokens=0, hold=None)
    else:
        chosen = policy.choose(options, PolicyContext(lookup, replicas, cost, preferred_replica, rotation, turn_index))
    estimates: dict[str, float] = {}
    for o in options:
        if o.estimate_ms < estimates.get(o.mode, float("inf")):
            estimates[o.mode] = o.estimate_ms
    estimates = {mode: round(ms, 2) for mode, ms in estimates.items()}
    reason = _reason(chosen, estimates, num_tokens)
    if policy.name != DEFAULT_POLICY and force is None:
        reason = f"{policy.name} policy: {reason}"
    logger.debug("plan for %d tokens: %s (%s)", num_tokens, chosen, reason)
    target = next(r for r in replicas if r.replica_id == chosen.replica_id)
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
        busy_peers=contending_peers(target, cost),
        busy_target=busy_target(target, cost),
        model_ms=round(chosen.model_ms, 2),
        impact_ms=round(chosen.impact_ms, 2),
        turn_index=turn_index,
        holder_busy=any(r.replica_id == chosen.holder and not r.idle for r in replicas),
        queues_ms=queues,
        shared_prefix=shared_prefix if turn_index == 0 and founds_home else None,
    )


def observe_queues(cost: CostModel, plan: Plan, now_s: float) -> None:
    """What a dispatched turn's plan teaches the cost model (mutates `cost`): the queue it found on every replica it
    weighed and its own compute (its estimate less the queue on its target), for the typical waits; and, for a first
    turn, the shared prefix its prompt starts with."""
    cost.typical_wait.observe(now_s, plan.queues_ms, plan.model_ms - plan.queues_ms.get(plan.replica_id, 0.0))
    if plan.shared_prefix is not None:
        cost.shared_prefixes.observe_first_turn(plan.shared_prefix, now_s)


def reads_hold(plan: Plan | Option) -> bool:
    """Whether the turn reads `plan.hold`: a pull, or a local turn reusing more than its target's prefix cache has
    (its own hold's last partial block)."""
    return plan.hold is not None and (
        plan.mode is Mode.PULL or (plan.mode is Mode.LOCAL and plan.reused_tokens > plan.cached_tokens))


def _reason(chosen: Option, estimates: dict[str, float], num_tokens: int) -> str:
    others = ", ".join(f"{m} {ms:.0f} ms" for m, ms in estimates.items() if m != chosen.mode)
    what = {
        Mode.LOCAL: f"{chosen.reused_tokens}/{num_tokens} tokens already cached on the target",
        Mode.PULL: f"pull {chosen.reused_tokens}/{num_tokens} tokens from {chosen.holder}",
        Mode.RECOMPUTE: f"compute all {num_tokens} tokens",
    }[chosen.mode]
    slows = f", delaying others' first tokens by {chosen.impact_ms:.0f} ms" if chosen.impact_ms >= 0.5 else ""
    return f"{what}: {chosen.estimate_ms:.0f} ms{slows}" + (f" (vs {others})" if others else "")
