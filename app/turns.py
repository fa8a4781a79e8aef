"""Running one conversation turn: plan it, execute the plan on the engine replicas, record what it left behind.

The one path every request takes (HTTP or Python handle): hash the turn's token ids, ask this ingress's mirror
of the KV directory who holds them and how loaded each replica is (no remote call), let `kvtransfer.planner`
choose, take the hold from the directory when the plan pulls, stream from the chosen replica, then record the
replica's new hold and feed the timings back to the cost model. A failed pull (dead holder, expired hold, NIXL
error) re-runs the turn without the pull: the client sees a correct answer, only later. A replica that dies
while it serves a turn does not end it: the turn continues on another replica from the tokens already streamed
(their prompt plus what was sent, pulled from a live holder where the planner says so), at most `max_migrations`
times; the client sees one stream, each token once.

`TurnRunner` runs aggregated turns (every replica prefills and decodes); `app/disaggregated.py` runs the same
plan as a prefill on one pool and a decode on another.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ray.exceptions import RayActorError
from ray.serve.exceptions import ReplicaUnavailableError
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.exceptions import EngineDeadError

from actors.directory_mirror import DirectoryMirror
from actors.prefix_hash import BlockHash, PrefixKey, Scope
from actors.replica_api import GenerateDelta, GenerateRequest, HoldRelease, ReplicaStats
from app.recent_prompts import RecentPrompts
from app.responses import caused_by
from kvtransfer.calibration import CALIBRATION_TENANT
from kvtransfer.connector import is_load_failure
from kvtransfer.cost_model import CostModel
from kvtransfer.load import preferred_replica, with_busy_peers
from kvtransfer.options import Mode, ReplicaView
from kvtransfer.planner import Plan, plan_turn, reads_hold
from kvtransfer.policies import DEFAULT_POLICY, PlacementPolicy, get_policy
from kvtransfer.types import Hold, HoldOffer, LookupResult

logger = logging.getLogger(__name__)

PREFILL_POOL = "engines"
# Work a turn leaves behind (ending the engine's stream, releasing the holds it superseded, recording its hold at the
# directory actor, teaching the cost model what the turn measured) starts this long after the turn's last token, when
# its response has left: each Serve call is 0.3-1 ms of this process's CPU, and started at once they delayed the
# response by about 3 ms here (the ingress sends it ~2.5 ms after the last token; `python -m benchmarks.overhead`).
AFTER_RESPONSE_S = 0.005


class TurnLost(Exception):
    """Every replica a turn ran on died before its last token, `max_migrations` times over. The message is safe to
    show a client: it names no replica, actor or process."""


def lost_replica(exc: BaseException) -> bool:
    """Whether a failed engine call means its replica (or the engine inside it) is gone: the turn may continue
    elsewhere. Any other failure is not retried."""
    return caused_by(exc, RayActorError, ReplicaUnavailableError, EngineDeadError) is not None


def continuation(turn: Turn, produced: list[int]) -> Turn | None:
    """The rest of `turn` after `produced` tokens were streamed: their prompt with those tokens appended, sampling
    the remaining budget (prompt logprobs already went out with the first tokens). None if nothing is left."""
    if not produced:
        return turn
    params = turn.params.clone()
    if params.max_tokens is not None:
        params.max_tokens -= len(produced)
        if params.max_tokens < 1:
            return None
    params.min_tokens = max(0, params.min_tokens - len(produced))
    params.prompt_logprobs = None
    return replace(turn, token_ids=turn.token_ids + produced, params=params)


async def drained(stream: AsyncIterator[GenerateDelta], request_id: str) -> None:
    """Read an engine stream to its end after its last delta, so that Serve closes the request as it would have."""
    try:
        async for _ in stream:
            pass
    except Exception as exc:  # the turn is answered already; a replica lost now costs it nothing
        logger.debug("the engine stream of %s ended with %r after its last delta", request_id, exc)


def whole_turn(last: GenerateDelta, turn: Turn, streamed: int, cached_tokens: int) -> GenerateDelta:
    """The last delta of the rest of `turn` (after `streamed` tokens came from elsewhere), its totals counted for
    the whole turn, `cached_tokens` of whose prompt were not computed."""
    return last.model_copy(update={"prompt_tokens": len(turn.token_ids), "num_cached_tokens": cached_tokens,
                                   "completion_tokens": streamed + last.completion_tokens})


@dataclass
class Turn:
    """One turn: the whole conversation so far as token ids, and how to sample the reply."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    # Whose KV this is (an API key or cache salt); turns of different tenants never share KV.
    tenant: str = ""
    # A placement hint only (X-Session-Id): equal options go to the replica that id usually maps to.
    session_id: str | None = None
    # How the turn is placed; the baselines exist so benchmarks can compare on the same engines.
    policy: PlacementPolicy = field(default_factory=lambda: get_policy(DEFAULT_POLICY))
    # vLLM's scheduling priority (lower runs first; engines refuse non-zero ones unless they schedule by priority).
    priority: int = 0
    # The token ids hashed into blocks (`TurnRunner.key`): once per turn, not per plan and request.
    key: PrefixKey | None = field(default=None, init=False, repr=False, compare=False)


@dataclass
class TurnOutcome:
    """What happened, for the response's `kvrelay` object, metrics and the caller's logs."""

    plan: Plan
    replica_id: str = ""
    reused_tokens: int = 0
    ttft_ms: float | None = None
    completion_tokens: int = 0
    pull_failed: bool = False
    # The reading engine's verdict on the pull's KV, where it checked one ("verified", "refused: ..."; vLLM's NIXL
    # connector as kvrelay extends it: kvtransfer/throttled_nixl.py).
    read_check: str | None = None
    # How often the turn moved to another replica because the one serving it died (`plan` is the last one's).
    migrations: int = 0
    counters: Counter = field(default_factory=Counter)
    # This process's clock (time.perf_counter) when the first engine request was made and when the last delta came:
    # what the ingress spends outside them is its own work (`Ingress.stats`, "ingress_own_ms").
    engine_called_at: float | None = None
    last_delta_at: float | None = None

    def public(self) -> dict[str, Any]:
        reason = self.plan.reason + ("; the pull failed, recomputed" if self.pull_failed else "")
        if self.migrations:
            reason += f"; continued on another replica after {self.migrations} replica failure(s)"
        elif self.replica_id and self.plan.replica_id and self.replica_id != self.plan.replica_id:
            # The replica router sends a turn elsewhere when its target has left Serve's set (it died or drains).
            reason += f"; planned for {self.plan.replica_id}, which Serve no longer routes to: ran here instead"
        return {
            "mode": self.plan.mode.value if not self.pull_failed else Mode.RECOMPUTE.value,
            "replica": self.replica_id or self.plan.replica_id,
            "holder": self.plan.holder,
            "reused_tokens": self.reused_tokens,
            "estimates_ms": self.plan.estimates_ms,
            "reason": reason,
            "ttft_ms": round(self.ttft_ms, 2) if self.ttft_ms is not None else None,
        }


class InFlight:
    """This ingress's own requests per replica, reconciled with the replicas' heartbeats.

    A heartbeat is up to half a second old: it still counts requests that have ended since, and misses those
    sent since. This keeps each own request's start and end (wall clock, the heartbeat's clock too) so a view
    counts what the heartbeat saw of others, plus what this ingress has in flight now. Not thread-safe.
    """

    RETAIN_S = 5.0  # ended requests are kept this long, longer than any heartbeat is old
    RATE_WINDOW_S = 10.0  # arrival rates count the requests sent this long ago at most

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        # replica -> request id -> [started_at, ended_at or None, prompt tokens still to prefill or None]
        self._requests: dict[str, dict[str, list]] = {}
        # replica -> (start time, where its prompt ended: `PrefixKey.prompt_end`) of requests within the rate window
        self._arrivals: dict[str, deque[tuple[float, BlockHash | None]]] = {}

    def started(self, replica_id: str, request_id: str, new_tokens: int, prompt_end: BlockHash | None = None) -> None:
        now = self._clock()
        self._requests.setdefault(replica_id, {})[request_id] = [now, None, new_tokens]
        self._arrivals.setdefault(replica_id, deque()).append((now, prompt_end))

    def now(self) -> float:
        return self._clock()

    def arrival_rate(self, replica_id: str, conversation: PrefixKey | None = None) -> float:
        """Requests per second this ingress sent to the replica over the last RATE_WINDOW_S, not counting the
        earlier turns of `conversation` (a turn's prompt): the traffic a placement of its next turn would slow is
        the other conversations'. Counted with its own, a conversation living on the quieter of two busy engines
        saw its own turns there as traffic its stay elsewhere would slow, and two engines holding two conversations
        each priced staying and moving alike: both stayed busy side by side for the rest of those conversations."""
        arrivals = self._arrivals.get(replica_id)
        if not arrivals:
            return 0.0
        while arrivals and arrivals[0][0] < self._clock() - self.RATE_WINDOW_S:
            arrivals.popleft()
        count = len(arrivals)
        if conversation is not None:
            count -= sum(1 for _, end in arrivals if end is not None and conversation.has_block(end))
        return count / self.RATE_WINDOW_S

    def busy_share(self, replica_id: str, since: float, until: float) -> float:
        """The share of [since, until] (this clock) during which this ingress had a request in flight on the
        replica; ended requests are kept RETAIN_S, so `since` should be more recent than that."""
        if until <= since:
            return 0.0
        spans = sorted((max(start, since), min(until, ended if ended is not None else until))
                       for start, ended, _ in self._requests.get(replica_id, {}).values())
        covered, reached = 0.0, since
        for start, end in spans:
            start = max(start, reached)
            if end > start:
                covered += end - start
                reached = end
        return covered / (until - since)

    def moved(self, from_replica: str, to_replica: str, request_id: str) -> None:
        """The request runs on `to_replica`, not where it was accounted (Serve chose: a P/D decode stage, or a
        target Serve no longer routes to): count it there from now on, so the replica's heartbeats are reconciled
        with it and its end is seen."""
        entry = self._requests.get(from_replica, {}).pop(request_id, None)
        if entry is not None:
            self._requests.setdefault(to_replica, {})[request_id] = entry

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

    def view(self, stats: ReplicaStats, conversation: PrefixKey | None = None) -> ReplicaView:
        """The planner's view of a replica for a turn whose prompt is `conversation`: others' requests as of its
        heartbeat, and this ingress's now; its arrival rate without the conversation's own turns."""
        mine = self._requests.get(stats.replica_id, {}).values()
        seen_by_heartbeat = sum(
            1 for started, ended, _ in mine if started <= stats.at and (ended is None or ended > stats.at)
        )
        live = [(started, pending) for started, ended, pending in mine if ended is None]
        others = max(0, stats.running + stats.waiting - seen_by_heartbeat)
        prefilling = [pending for _, pending in live if pending is not None]
        return ReplicaView(
            stats.replica_id,
            running=others + len(live) - len(prefilling),
            waiting=0,
            decode_tok_s=stats.decode_tok_s,
            prefill_tokens=sum(prefilling),
            prefilling=len(prefilling),
            arrival_rate=self.arrival_rate(stats.replica_id, conversation),
        )


class TurnRunner:
    """Plans and runs aggregated turns against one engine deployment. One per ingress replica, on its event loop."""

    def __init__(
        self,
        engines: Any,
        directory: DirectoryMirror,
        cost: CostModel,
        model: str,
        block_size: int,
        hold_ttl_s: float,
        max_migrations: int = 2,
    ) -> None:
        self.engines = engines
        self.directory = directory
        self.cost = cost
        self.model = model
        self.block_size = block_size
        self.hold_ttl_s = hold_ttl_s
        self.max_migrations = max_migrations
        self.counters: Counter = Counter(pulls_verified=0, pulls_refused=0)  # shown in stats from the start
        self._rotation = 0  # turn counter for the round-robin baselines
        self.inflight = InFlight()
        self.recent_prompts = RecentPrompts()
        self._background: set[asyncio.Task] = set()  # work after turns, in flight (asyncio keeps weak refs only)
        self.plan_ms: deque[float] = deque(maxlen=1024)  # how long recent plans took
        # (puller, holder) replica pairs whose NIXL agents have met (a pull between them succeeded).
        self.met: set[tuple[str, str]] = set()
        self._generate_handles: dict[Any, Any] = {}  # engine pool handle -> its streaming `generate` handle

    def replicas(self) -> list[ReplicaStats]:
        return self.directory.live()

    def plan(self, turn: Turn, force: tuple[Mode, str] | None = None, targets: Sequence[str] | None = None) -> Plan:
        """Plan a turn from this ingress's own view (no remote call); `targets` limits where it may run (holders
        may be any live replica). Reads state only: `Ingress.plan` is a dry run, and a turn that runs is counted by
        `record_planned`."""
        key = self.key(turn)
        lookup, replicas = self.directory.lookup(key), self.directory.live()
        if turn.params.prompt_logprobs is not None:
            # Every prompt position needs its logprobs computed: nothing cached or pulled may stand in for it.
            lookup = LookupResult(lookup.query_tokens, ())
        turn_index: int | None = 0  # the turn's place in its conversation (None: it continues one, where is unknown)
        if self._tracks_conversations(turn, force):
            # A turn whose prompt starts with a previous turn's whole prompt continues a conversation: how often that
            # happens tells how many turns a placement brings along. Not by a hold matching the prompt: the reply
            # comes back re-tokenized from its text, and in up to a quarter of the benchmark's continuing turns
            # its tokens differed from the generated ones. Nor only by a pending hold: after a pause longer than the
            # hold's lease, by where this ingress's recent prompts ended, which also tell the turn's place in its
            # conversation (not known where only the directory knows it continues: another ingress ran the turn
            # before, or this one restarted).
            turn_index = self.recent_prompts.place(key)
            if turn_index == 0 and self.directory.continues(key):
                turn_index = None
        node_of = {r.replica_id: r.node_id for r in replicas}
        self.cost.set_nodes(node_of)  # the live replicas' nodes, as the directory has them (no turn recorded)
        views = with_busy_peers([self.inflight.view(r, key) for r in replicas], node_of)

        if not views:
            # Replicas have not reported yet (start-up) or the directory restarted: let Serve choose.
            return Plan("", Mode.RECOMPUTE, None, 0, 0, 0.0, {}, "no replica has reported its load yet",
                        turn_index=turn_index)
        eligible = [v.replica_id for v in views if targets is None or v.replica_id in targets]
        preferred = preferred_replica(turn.session_id, eligible)
        return plan_turn(
            len(turn.token_ids), lookup, views, self.cost, preferred, force, targets, turn.policy,
            self._rotation + 1, self._output_tokens(turn), self.met, turn_index,
        )

    def record_planned(self, turn: Turn, plan: Plan, force: tuple[Mode, str] | None, plan_ms: float) -> None:
        """Count a turn that runs as `plan` (once per turn: not again for its continuation after a lost replica):
        the round-robin baselines' rotation, the turn's place in its conversation (the forecast of turns to come)
        and its prompt (the next turn's place), and how long planning it took."""
        self._rotation += 1
        self.plan_ms.append(plan_ms)
        if self._tracks_conversations(turn, force):
            self.cost.observe_turn(plan.turn_index)
            self.recent_prompts.add(self.key(turn), plan.turn_index)

    def _tracks_conversations(self, turn: Turn, force: tuple[Mode, str] | None) -> bool:
        """Whether the turn's place in its conversation is tracked: only where turns leave their history held for
        the next turn (the last stage's hold: in P/D the decode's, which only pulling policies keep) can a
        continuation be told from a new prompt sharing a prefix; forced turns (tests, benchmarks) are not counted."""
        return force is None and self._leaves_holds(turn, "decode")

    def key(self, turn: Turn) -> PrefixKey:
        """The turn's token ids hashed into blocks (built once per turn; a continuation after a lost replica is a
        new turn)."""
        if turn.key is None:
            turn.key = PrefixKey.build(turn.token_ids, Scope(self.model, turn.tenant), self.block_size)
        return turn.key

    async def run(
        self, turn: Turn, force: tuple[Mode, str] | None = None
    ) -> AsyncIterator[tuple[GenerateDelta, TurnOutcome]]:
        """Stream the turn's deltas, each with the outcome so far (final on the last delta).

        `force` (tests, benchmarks) runs a given (mode, replica); a forced recompute also skips the
        target's prefix cache, so it measures and reproduces a true recompute. If the replica serving the turn
        dies, the rest of the turn is planned again and runs elsewhere (`continuation`); the deltas carry on
        where the stream broke, and the last one counts the whole turn's tokens.
        """
        started = time.monotonic()
        produced: list[int] = []
        outcome: TurnOutcome | None = None
        rest: Turn | None = turn
        while rest is not None:
            planning = time.perf_counter()
            plan = self.plan(rest, force, self._targets())
            if outcome is None:
                self.record_planned(turn, plan, force, (time.perf_counter() - planning) * 1e3)
                outcome = TurnOutcome(plan, reused_tokens=plan.reused_tokens)
            else:
                outcome.plan, outcome.pull_failed = plan, False
            self.counters[f"plans_{plan.mode.value}"] += 1
            try:
                pull = await self._take_hold(rest, plan) if reads_hold(plan) else None
                sent_before = len(rest.token_ids) - len(turn.token_ids)  # streamed by replicas that died
                async for delta in self._execute(rest, plan, pull, outcome, started, force):
                    if delta.finished and sent_before:
                        delta = whole_turn(delta, turn, sent_before, min(delta.num_cached_tokens, len(turn.token_ids)))
                    produced.extend(delta.token_ids)
                    yield delta, outcome
                return
            except Exception as exc:
                if not lost_replica(exc):
                    raise
                if outcome.migrations >= self.max_migrations:
                    raise TurnLost(f"the replicas serving this request failed {outcome.migrations + 1} times; "
                                   "retry it") from exc
                lost = plan.replica_id or outcome.replica_id
                logger.warning("replica %s died serving %s after %d tokens; continuing elsewhere",
                               lost, turn.request_id, len(produced))
                self.counters["migrations"] += 1
                outcome.migrations += 1
                force = None  # a forced target is the one that died
                if lost:
                    await self.directory.deregister(lost)
                rest = continuation(turn, produced)
        # The replica died after the last token of the budget, before saying so: the turn is complete.
        yield GenerateDelta(token_ids=[], text="", finished=True, finish_reason="length",
                            prompt_tokens=len(turn.token_ids), completion_tokens=len(produced)), outcome

    def _targets(self) -> list[str] | None:
        """Where turns may start (None: any live replica)."""
        return None

    def _output_tokens(self, turn: Turn) -> int:
        """How many tokens the turn will decode on the replica it starts on (how long it keeps that engine busy)."""
        return self.cost.expected_output_tokens(turn.params.max_tokens or 1)

    def _leaves_holds(self, turn: Turn, stage: str) -> bool:
        """Whether the turn's `stage` request exports a hold: only policies that pull need them, and only where another
        replica could pull it. A lone replica's hold would pin its KV blocks until the lease ends, for nobody (no
        other replica can release it either): under load they filled the cache and stalled every new request."""
        return turn.policy.pulls and len(self.replicas()) > 1

    async def _take_hold(self, turn: Turn, plan: Plan) -> Hold | None:
        """The planned hold, taken from the directory; None if it is gone (another turn took it, it expired)."""
        hold = await self.directory.consume_hold(plan.hold.hold_id)
        if hold is not None and hold.num_tokens <= len(turn.token_ids) - 1:
            return hold
        # Raced with another turn or expired in between: compute on the same target instead.
        self.counters["holds_gone"] += 1
        return None

    async def _execute(
        self, turn: Turn, plan: Plan, pull: Hold | None, outcome: TurnOutcome, started: float,
        force: tuple[Mode, str] | None,
    ) -> AsyncIterator[GenerateDelta]:
        """Run the plan on its target, pulling `pull` when given; after a failed pull, once more without it."""
        skip_cache = force is not None and force[0] is Mode.RECOMPUTE
        async for delta in self._attempt(turn, plan, self._request(turn, plan, "turn", pull, skip_cache=skip_cache),
                                         outcome, started):
            yield delta
        if outcome.pull_failed:
            async for delta in self._attempt(turn, plan, self._request(turn, plan, "turn", skip_cache=skip_cache),
                                             outcome, started):
                yield delta
        else:
            self._after_response(self._learn_outcome(turn, plan, pull, outcome, force))

    async def _learn_outcome(self, turn: Turn, plan: Plan, pull: Hold | None, outcome: TurnOutcome,
                             force: tuple[Mode, str] | None) -> None:
        # The calibration sets its turns' output length (1 or 256 tokens): they say nothing of how long turns decode.
        if self._observe_error(turn, plan, pull, outcome, force) and turn.tenant != CALIBRATION_TENANT:
            self.cost.observe_output(outcome.completion_tokens)  # how long turns decode

    def _observe_error(self, turn: Turn, plan: Plan, pull: Hold | None, outcome: TurnOutcome,
                       force: tuple[Mode, str] | None) -> bool:
        """If the turn's first stage ran as planned (no failed or skipped read, not moved, and not forced unless the
        start-up calibration forced it), teach the planner how far off its estimate of that stage's time to first
        token was; returns whether it did.

        The calibration's forced turns are real turns of each mode on idle or busy engines: they teach the error too,
        so an app's first turns are already corrected."""
        planned = force is None or turn.tenant == CALIBRATION_TENANT
        if (planned and not outcome.migrations and not outcome.pull_failed and outcome.ttft_ms is not None
                and (pull is not None or not reads_hold(plan))):
            self.cost.error.observe(plan.mode, plan.busy_peers, plan.model_ms, outcome.ttft_ms)
            return True
        return False

    def _request(
        self, turn: Turn, plan: Plan, stage: str, pull: Hold | None = None, skip_cache: bool = False,
    ) -> GenerateRequest:
        """The request for one stage of a turn (`stage` names it: "turn", or "prefill" and "decode" for P/D)."""
        return GenerateRequest(
            request_id=f"{turn.request_id}-{stage}-{'kv' if pull else 'run'}",
            prompt_token_ids=turn.token_ids,
            params=turn.params,
            pull=pull,
            own_hold=pull is not None and plan.mode is Mode.LOCAL,
            target_replica=plan.replica_id or None,
            cache_salt=turn.tenant or None,
            priority=turn.priority,
            skip_prefix_cache=skip_cache,
            export_hold=self._leaves_holds(turn, stage),
        )

    async def _attempt(
        self,
        turn: Turn,
        plan: Plan,
        request: GenerateRequest,
        outcome: TurnOutcome,
        started: float,
        engines: Any = None,
        records_hold: bool = True,
        prefills: bool = True,
    ) -> AsyncIterator[GenerateDelta]:
        """One request to one replica of `engines` (default: the engine pool).

        `records_hold`: record the hold the replica leaves. `prefills`: the request computes the prompt as planned,
        so once it has read what it reuses the holds it supersedes are released, and its timings teach the cost model.
        """
        engines = self.engines if engines is None else engines
        reads_kv = request.pull is not None
        output: list[int] = []
        # Accounted on the planned replica (none for a P/D decode stage: Serve chooses), and moved to the one that
        # answers: that replica's heartbeats then count this request as this ingress's own, ended when it ends.
        where = plan.replica_id
        self.inflight.started(where, request.request_id, len(turn.token_ids) - plan.reused_tokens,
                              self.key(turn).prompt_end(len(turn.token_ids)))
        sent_at = self.inflight.now()
        busy_peers = 0.0  # other engines of its node busy until its first token, each for its share of that time
        if outcome.engine_called_at is None:
            outcome.engine_called_at = time.perf_counter()
        logger.debug("%s to %s: reads %s", request.request_id, where or "any replica",
                     request.pull.request_id if request.pull else "no hold")
        stream = self._generate(engines).remote(request)
        try:
            async for delta in stream:
                if delta.finished:
                    outcome.last_delta_at = time.perf_counter()
                if delta.replica_id and delta.replica_id != where:
                    self.inflight.moved(where, delta.replica_id, request.request_id)
                    where = delta.replica_id
                if delta.finished and reads_kv and delta.read_check is not None:
                    outcome.read_check = delta.read_check
                    self.counters["pulls_verified" if delta.read_check == "verified" else "pulls_refused"] += 1
                if delta.finished and reads_kv and is_load_failure(delta.finish_reason):
                    # Nothing was streamed: vLLM fails a pull before the first token. Re-run without it.
                    logger.warning("pull for %s from %s failed; recomputing", turn.request_id, plan.holder)
                    self.counters["pull_failures"] += 1
                    outcome.pull_failed = True
                    self._after_response(drained(stream, request.request_id))
                    # A dead or restarted holder would fail every pull after a 5 s handshake timeout: forget
                    # it and all it holds. If it is alive, its next heartbeat and turns bring it back. A read the
                    # reader refused (too close to the lease's end, or blocks unlike the holder's) came from a
                    # holder that answered: it stays.
                    if plan.holder and not (delta.read_check or "").startswith("refused"):
                        await self.directory.deregister(plan.holder)
                    return
                if delta.token_ids and not output:
                    self.inflight.first_token(where, request.request_id)
                    if prefills:  # only a prefilling request's timings teach the cost model
                        busy_peers = self._busy_peers_since(where, sent_at)
                    if outcome.ttft_ms is None:
                        outcome.ttft_ms = (time.monotonic() - started) * 1e3
                    if prefills and plan.superseded:
                        # The turn has read what it reuses; older holds of its history only pin blocks now.
                        self._after_response(self._release(plan.superseded))
                output.extend(delta.token_ids)
                if delta.finished:
                    outcome.replica_id = delta.replica_id
                    outcome.reused_tokens = delta.num_cached_tokens
                    outcome.completion_tokens = delta.completion_tokens
                    if request.pull is not None and plan.holder:
                        self.met.add((delta.replica_id, plan.holder))  # their NIXL agents have shaken hands
                    if records_hold:
                        self._record_hold(turn, turn.token_ids + output, delta)
                    if prefills:
                        self._after_response(self._learn(plan, request.pull is not None and plan.mode is Mode.PULL,
                                                         delta, busy_peers))
                    # The engine has said all it will: answer now. The end of Serve's stream (the replica's generator
                    # returning, gRPC's trailer: 2-3 ms here) is awaited after the response.
                    self._after_response(drained(stream, request.request_id))
                    yield delta
                    return
                yield delta
        finally:
            self.inflight.ended(where, request.request_id)

    def _generate(self, engines: Any) -> Any:
        """The pool's streaming `generate` handle, built once: a Serve handle makes a copy of itself on every
        `options()` and attribute access, and this runs for every engine request."""
        handle = self._generate_handles.get(engines)
        if handle is None:
            handle = self._generate_handles[engines] = engines.options(stream=True).generate
        return handle

    def _after_response(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` in the background, AFTER_RESPONSE_S from now."""
        async def later() -> None:
            try:
                await asyncio.sleep(AFTER_RESPONSE_S)
            except asyncio.CancelledError:
                work.close()
                raise
            await work

        task = asyncio.get_running_loop().create_task(later())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

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
                    logger.debug("releasing hold %s of %s through %s", hold.request_id, offer.replica_id, sender)
                    await self.engines.release_hold.remote(HoldRelease(hold=hold, target_replica=sender))
            except Exception as exc:  # the hold then lasts until its lease ends: slower, never wrong
                logger.warning("could not release hold %s on %s: %s", offer.hold_id, offer.replica_id, exc)

    def _record_hold(self, turn: Turn, key_tokens: list[int], last: GenerateDelta) -> None:
        """Record the hold the replica left (if any) in the directory, for the next turn to find."""
        if last.hold is not None:
            logger.debug("%s left hold %s on %s", turn.request_id, last.hold.request_id, last.replica_id)
            key = PrefixKey.build(key_tokens, Scope(self.model, turn.tenant), self.block_size)
            self.directory.record_hold(last.replica_id, key, last.hold, time.time() + self.hold_ttl_s,
                                       at_actor_after_s=AFTER_RESPONSE_S, prompt_tokens=len(turn.token_ids))

    def _busy_peers_since(self, replica_id: str, since: float) -> float:
        """How many other engines of `replica_id`'s node were busy from `since` until now, each counted for the
        share of that time it had a request of this ingress in flight (others' requests are not seen here)."""
        node_of = {r.replica_id: r.node_id for r in self.replicas()}
        node, now = node_of.get(replica_id), self.inflight.now()
        return sum(self.inflight.busy_share(peer, since, now)
                   for peer, peer_node in node_of.items() if peer != replica_id and peer_node == node)

    async def _learn(self, plan: Plan, pulled: bool, last: GenerateDelta, busy_peers: float) -> None:
        """Teach the cost model this request's prefill (and pull) time, if it had its engine to itself;
        `busy_peers`: the other engines of its node busy meanwhile, each for its share of the time. Not the count
        at planning: a peer busy then often finishes a few ms into the prefill, and such turns, counted as fully
        contended, had the slowdown fit end at 0.10-0.17 per busy peer in runs where prefills beside a decoding
        engine measured 0.13-0.30 (`benchmarks.contention`)."""
        if last.prefill_s is None or not last.ran_alone:
            return  # a turn batched with others times the batch, not the model or the link
        prefill_ms = last.prefill_s * 1e3
        reused = last.num_cached_tokens
        new_tokens = last.prompt_tokens - reused
        self.cost.observe_prefill(new_tokens, reused, prefill_ms, busy_peers, last.replica_id)
        if last.decode_step_s is not None and plan.busy_peers == 0:
            self.cost.observe_decode(last.decode_step_s * 1e3)
        if pulled and last.wait_s is not None:
            # vLLM schedules a pulling request once its KV has arrived: the wait before scheduling is the
            # transfer (plus any queueing, which an idle calibration avoids).
            self.cost.observe_pull(reused - plan.cached_tokens, last.wait_s * 1e3)
