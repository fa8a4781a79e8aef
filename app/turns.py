"""Running one conversation turn: plan it, execute the plan on the engine replicas, record what it left behind.

The one path every request takes (HTTP or Python handle): hash the turn's token ids, ask this ingress's mirror
of the KV directory who holds them and how loaded each replica is (no remote call), let `kvtransfer.planner`
choose, take the hold from the directory when the plan pulls, stream from the chosen replica, then record the
replica's new hold and feed the timings back to the cost model. A failed pull (dead holder, expired hold, NIXL
error) re-runs the turn without the pull: the client sees a correct answer, only later.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from actors.directory_mirror import DirectoryMirror
from actors.prefix_hash import PrefixKey, Scope
from actors.replica_api import GenerateDelta, GenerateRequest, HoldRelease, ReplicaStats, Sampling
from kvtransfer.connector import is_load_failure
from kvtransfer.cost_model import CostModel
from kvtransfer.planner import Mode, Plan, Policy, ReplicaView, plan_turn
from kvtransfer.types import Hold, HoldOffer

logger = logging.getLogger(__name__)

PREFILL_POOL = "engines"


@dataclass
class Turn:
    """One turn: the whole conversation so far as token ids, and how to sample the reply."""

    request_id: str
    token_ids: list[int]
    sampling: Sampling
    # Whose KV this is (an API key or cache salt); turns of different tenants never share KV.
    tenant: str = ""
    # A placement hint only (X-Session-Id): equal options go to this session's usual replica.
    session_id: str | None = None
    # How the turn is placed; the baselines exist so benchmarks can compare on the same engines.
    policy: Policy = Policy.KVRELAY


@dataclass
class TurnOutcome:
    """What happened, for the response's `kvrelay` object, metrics and the caller's logs."""

    plan: Plan
    replica_id: str = ""
    reused_tokens: int = 0
    ttft_ms: float | None = None
    pull_failed: bool = False
    counters: Counter = field(default_factory=Counter)

    def public(self) -> dict[str, Any]:
        return {
            "mode": self.plan.mode.value if not self.pull_failed else Mode.RECOMPUTE.value,
            "replica": self.replica_id or self.plan.replica_id,
            "holder": self.plan.holder,
            "reused_tokens": self.reused_tokens,
            "estimates_ms": self.plan.estimates_ms,
            "reason": self.plan.reason + ("; the pull failed, recomputed" if self.pull_failed else ""),
        }


class InFlight:
    """This ingress's own requests per replica, reconciled with the replicas' heartbeats.

    A heartbeat is up to half a second old: it still counts requests that have ended since, and misses those
    sent since. This keeps each own request's start and end (wall clock, the heartbeat's clock too) so a view
    counts what the heartbeat saw of others, plus what this ingress has in flight now. Not thread-safe.
    """

    RETAIN_S = 5.0  # ended requests are kept this long, longer than any heartbeat is old

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        # replica -> request id -> [started_at, ended_at or None, prompt tokens still to prefill or None]
        self._requests: dict[str, dict[str, list]] = {}

    def started(self, replica_id: str, request_id: str, new_tokens: int) -> None:
        self._requests.setdefault(replica_id, {})[request_id] = [self._clock(), None, new_tokens]

    def first_token(self, replica_id: str, request_id: str) -> None:
        entry = self._requests.get(replica_id, {}).get(request_id)
        if entry is not None:
            entry[2] = None

    def ended(self, replica_id: str, request_id: str) -> None:
        now = self._clock()
        mine = self._requests.get(replica_id, {})
        if request_id in mine:
            mine[request_id][1] = now
        for rid in [rid for rid, (_, ended, _) in mine.items() if ended is not None and now - ended > self.RETAIN_S]:
            del mine[rid]

    def view(self, stats: ReplicaStats) -> ReplicaView:
        """The planner's view of a replica: others' requests as of its heartbeat, and this ingress's now."""
        mine = self._requests.get(stats.replica_id, {}).values()
        seen_by_heartbeat = sum(
            1 for started, ended, _ in mine if started <= stats.at and (ended is None or ended > stats.at)
        )
        live = [(started, pending) for started, ended, pending in mine if ended is None]
        others = max(0, stats.running + stats.waiting - seen_by_heartbeat)
        return ReplicaView(
            stats.replica_id,
            running=others + sum(1 for _, pending in live if pending is None),
            waiting=0,
            decode_tok_s=stats.decode_tok_s,
            prefill_tokens=sum(pending for _, pending in live if pending is not None),
        )


def with_busy_peers(views: list[ReplicaView], node_of: dict[str, str]) -> list[ReplicaView]:
    """Each view with the number of other replicas on its node that are busy (running, queued or prefilling)."""
    busy = [v.replica_id for v in views if v.running or v.waiting or v.prefill_tokens]
    return [
        v._replace(busy_peers=sum(1 for b in busy if b != v.replica_id and node_of.get(b) == node_of.get(v.replica_id)))
        for v in views
    ]


def preferred_replica(session_id: str | None, replica_ids: Sequence[str]) -> str | None:
    """Rendezvous hashing: a session keeps its replica while that replica lives, and moves minimally."""
    if not session_id or not replica_ids:
        return None

    def score(replica_id: str) -> bytes:
        return hashlib.blake2b(f"{session_id}\x00{replica_id}".encode(), digest_size=8).digest()

    return max(replica_ids, key=score)


class TurnRunner:
    """Plans and runs turns against one engine deployment. One per ingress replica, on its event loop."""

    def __init__(
        self,
        engines: Any,
        directory: DirectoryMirror,
        cost: CostModel,
        model: str,
        block_size: int,
        hold_ttl_s: float,
        decode_engines: Any = None,
    ) -> None:
        self.engines = engines
        # Disaggregated: `engines` prefill (one token, leaving a hold), `decode_engines` pull it and decode.
        self.decode_engines = decode_engines
        self.directory = directory
        self.cost = cost
        self.model = model
        self.block_size = block_size
        self.hold_ttl_s = hold_ttl_s
        self.counters: Counter = Counter()
        self._rotation = 0  # turn counter for the round-robin baselines
        self.inflight = InFlight()
        self._background: set[asyncio.Task] = set()  # hold releases in flight (asyncio keeps weak refs only)
        self.plan_ms: deque[float] = deque(maxlen=1024)  # how long recent plans took

    def replicas(self) -> list[ReplicaStats]:
        return self.directory.live()

    def plan(
        self, turn: Turn, force: tuple[Mode, str] | None = None, targets: Sequence[str] | None = None
    ) -> tuple[PrefixKey, Plan]:
        """Plan a turn from this ingress's own view (no remote call); `targets` limits where it may run (holders
        may be any live replica)."""
        started = time.perf_counter()
        key = PrefixKey.build(turn.token_ids, Scope(self.model, turn.tenant), self.block_size)
        lookup, replicas = self.directory.lookup(key), self.directory.live()
        views = with_busy_peers([self.inflight.view(r) for r in replicas], {r.replica_id: r.node_id for r in replicas})

        if not views:
            # Replicas have not reported yet (start-up) or the directory restarted: let Serve choose.
            return key, Plan("", Mode.RECOMPUTE, None, 0, 0, 0.0, {}, "no replica has reported its load yet")
        eligible = [v.replica_id for v in views if targets is None or v.replica_id in targets]
        preferred = preferred_replica(turn.session_id, eligible)
        self._rotation += 1
        plan = plan_turn(
            len(turn.token_ids), lookup, views, self.cost, preferred, force, targets, turn.policy, self._rotation
        )
        self.plan_ms.append((time.perf_counter() - started) * 1e3)
        return key, plan

    async def run(
        self, turn: Turn, force: tuple[Mode, str] | None = None
    ) -> AsyncIterator[tuple[GenerateDelta, TurnOutcome]]:
        """Stream the turn's deltas, each with the outcome so far (final on the last delta).

        `force` (tests, benchmarks) runs a given (mode, replica); a forced recompute also skips the
        target's prefix cache, so it measures and reproduces a true recompute.
        """
        targets = None
        if self.decode_engines is not None:
            # Turns start on the prefill pool; holders may be any replica (decode replicas hold the history).
            targets = [r.replica_id for r in self.replicas() if r.pool == PREFILL_POOL]
        key, plan = self.plan(turn, force, targets)
        outcome = TurnOutcome(plan, reused_tokens=plan.reused_tokens)
        self.counters[f"plans_{plan.mode.value}"] += 1
        pull = None
        if plan.mode is Mode.PULL:
            hold = await self.directory.consume_hold(plan.hold.hold_id)
            if hold is not None and hold.num_tokens <= len(turn.token_ids) - 1:
                pull = hold
            else:
                # Raced with another turn or expired in between: compute on the same target instead.
                self.counters["holds_gone"] += 1
        started = time.monotonic()
        skip_cache = force is not None and force[0] is Mode.RECOMPUTE
        if self.decode_engines is not None:
            async for delta in self._run_disaggregated(turn, plan, pull, outcome, started, skip_cache):
                yield delta, outcome
            return
        async for delta in self._attempt(turn, plan, pull, outcome, started, skip_cache):
            yield delta, outcome
        if outcome.pull_failed:
            async for delta in self._attempt(turn, plan, None, outcome, started, skip_cache):
                yield delta, outcome
        elif force is None and outcome.ttft_ms is not None and (pull is not None or plan.mode is not Mode.PULL):
            # The turn ran as planned: teach the planner how far off its estimate was.
            self.cost.error.observe(plan.mode, plan.busy_peers, plan.model_ms, outcome.ttft_ms)

    async def _run_disaggregated(
        self, turn: Turn, plan: Plan, pull: Hold | None, outcome: TurnOutcome, started: float, skip_cache: bool
    ) -> AsyncIterator[GenerateDelta]:
        """Prefill on P (pulling the history when planned) with one output token, then P->D and decode on D."""
        prefill = replace(turn, sampling=turn.sampling.model_copy(update={"max_tokens": 1, "min_tokens": 0}))
        prefilled = [d async for d in self._attempt(prefill, plan, pull, outcome, started, skip_cache, "prefill")]
        if outcome.pull_failed:
            prefilled = [d async for d in self._attempt(prefill, plan, None, outcome, started, skip_cache, "prefill")]
        handoff = prefilled[-1].hold if prefilled else None
        if handoff is None:
            # P could not hand its KV over: it is a kv_both replica, so let it run the whole turn.
            self.counters["handoff_failures"] += 1
            async for delta in self._attempt(turn, plan, None, outcome, started, skip_cache):
                yield delta
            return
        outcome.ttft_ms = None  # P's token is not shown: the client's first token comes from D
        reused = prefilled[-1].num_cached_tokens
        decode_plan = plan._replace(replica_id="")
        async for delta in self._attempt(turn, decode_plan, handoff, outcome, started, stage="decode"):
            if delta.finished:
                delta.num_cached_tokens = reused
                outcome.reused_tokens = reused
            yield delta
        if outcome.pull_failed:  # D could not read P's KV: P recomputes and serves the turn itself
            outcome.pull_failed = False
            async for delta in self._attempt(turn, plan, None, outcome, started, skip_cache):
                yield delta

    async def _attempt(
        self,
        turn: Turn,
        plan: Plan,
        hold: Hold | None,
        outcome: TurnOutcome,
        started: float,
        skip_cache: bool = False,
        stage: str = "turn",
    ) -> AsyncIterator[GenerateDelta]:
        """One request to one replica, reading `hold`'s KV if given. `stage` "prefill" or "decode" for the two
        halves of a P/D turn (the decode half reads the prefill's hold of the whole prompt)."""
        engines = self.decode_engines if stage == "decode" else self.engines
        request = GenerateRequest(
            request_id=f"{turn.request_id}-{stage}-{'kv' if hold else 'run'}",
            prompt_token_ids=turn.token_ids,
            sampling=turn.sampling,
            pull=hold if stage != "decode" else None,
            prefilled=hold if stage == "decode" else None,
            target_replica=plan.replica_id or None,
            cache_salt=turn.tenant or None,
            skip_prefix_cache=skip_cache,
            # Only policies that pull need holds; a P/D turn always hands its KV over.
            export_hold=turn.policy.pulls or self.decode_engines is not None,
        )
        output: list[int] = []
        # Accounted on the planned replica; if Serve had to route elsewhere, the next heartbeat corrects it.
        where = plan.replica_id
        self.inflight.started(where, request.request_id, len(turn.token_ids) - plan.reused_tokens)
        try:
            async for delta in engines.options(stream=True).generate.remote(request):
                if delta.finished and hold is not None and is_load_failure(delta.finish_reason):
                    # Nothing was streamed: vLLM fails a pull before the first token. Re-run without it.
                    logger.warning("pull for %s from %s failed; recomputing", turn.request_id, plan.holder)
                    self.counters["pull_failures"] += 1
                    outcome.pull_failed = True
                    # A dead or restarted holder would fail every pull after a 5 s handshake timeout: forget
                    # it and all it holds. If it is alive, its next heartbeat and turns bring it back.
                    if plan.holder:
                        await self.directory.deregister(plan.holder)
                    return
                if delta.token_ids and not output:
                    self.inflight.first_token(where, request.request_id)
                    if outcome.ttft_ms is None:
                        outcome.ttft_ms = (time.monotonic() - started) * 1e3
                    if stage != "decode" and plan.superseded:
                        # The turn has read what it reuses; older holds of its history only pin blocks now.
                        task = asyncio.get_running_loop().create_task(self._release(plan.superseded))
                        self._background.add(task)
                        task.add_done_callback(self._background.discard)
                output.extend(delta.token_ids)
                if delta.finished:
                    outcome.replica_id = delta.replica_id
                    outcome.reused_tokens = delta.num_cached_tokens
                    self._after_turn(turn, turn.token_ids + output, plan, hold, delta, stage)
                yield delta
        finally:
            self.inflight.ended(where, request.request_id)

    async def _release(self, holds: Sequence[HoldOffer]) -> None:
        """Take holds out of the directory and free their blocks on their replicas, now rather than at expiry.

        A pending hold pins KV blocks (and keeps its engine stepping now and then to free them).
        """
        pool = {r.replica_id: r.pool for r in self.replicas()}
        for offer in holds:
            # Any replica of the engine pool but the holder can send the release (a holder cannot release its own).
            sender = next((rid for rid, p in sorted(pool.items()) if p == PREFILL_POOL and rid != offer.replica_id),
                          None)
            if sender is None:
                continue  # a lone replica: the hold lasts until its lease ends
            try:
                hold = await self.directory.consume_hold(offer.hold_id)
                if hold is not None:  # None: pulled, expired or released already
                    self.counters["holds_released"] += 1
                    await self.engines.release_hold.remote(HoldRelease(hold=hold, target_replica=sender))
            except Exception as exc:  # the hold then lasts until its lease ends: slower, never wrong
                logger.warning("could not release hold %s on %s: %s", offer.hold_id, offer.replica_id, exc)

    def _record_hold(self, turn: Turn, key_tokens: list[int], last: GenerateDelta) -> None:
        if last.hold is not None:
            key = PrefixKey.build(key_tokens, Scope(self.model, turn.tenant), self.block_size)
            self.directory.record_hold(last.replica_id, key, last.hold, time.time() + self.hold_ttl_s)

    def _after_turn(
        self,
        turn: Turn,
        key_tokens: list[int],
        plan: Plan,
        hold: Hold | None,
        last: GenerateDelta,
        stage: str,
    ) -> None:
        """Record the replica's new hold, release the one it supersedes, teach the cost model this turn's cost.

        A P/D prefill's hold is the decode replica's to read, so it is not recorded; a decode replica's
        prefill time is its transfer, not compute, so it teaches nothing.
        """
        if stage == "decode":
            self._record_hold(turn, key_tokens, last)
            return
        if stage == "turn":
            self._record_hold(turn, key_tokens, last)
        if last.prefill_s is None or not last.ran_alone:
            return  # a turn batched with others times the batch, not the model or the link
        prefill_ms = last.prefill_s * 1e3
        reused = last.num_cached_tokens
        new_tokens = last.prompt_tokens - reused
        self.cost.observe_prefill(new_tokens, reused, prefill_ms, plan.busy_peers)
        if hold is not None and last.wait_s is not None:
            # vLLM schedules a pulling request once its KV has arrived: the wait before scheduling is the
            # transfer (plus any queueing, which an idle calibration avoids).
            self.cost.observe_pull(reused - plan.cached_tokens, last.wait_s * 1e3)
