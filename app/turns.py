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
import resource
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any

from actors.replica_api import GenerateDelta, GenerateRequest, ReplicaStats, ReplyParams
from app.directory_mirror import DirectoryMirror
from app.feedback import Feedback
from app.holds import Holds
from app.inflight import InFlight
from app.recent_prompts import RecentPrompts
from app.turn_types import Turn, TurnLost, TurnOutcome, continuation, lost_replica, whole_turn
from kvtransfer.connector import is_load_failure
from kvtransfer.cost_model import CostModel
from kvtransfer.load import preferred_replica, with_busy_peers
from kvtransfer.options import Mode
from kvtransfer.planner import Plan, observe_queues, plan_turn, reads_hold
from kvtransfer.prefix_key import PrefixKey, Scope
from kvtransfer.shared_prefix import shared_prefix
from kvtransfer.types import Hold, LookupResult

logger = logging.getLogger(__name__)

PREFILL_POOL = "engines"
# Work a turn leaves behind (ending the engine's stream, releasing the holds it superseded, recording its hold at the
# directory actor, teaching the cost model what the turn measured) starts this long after the turn's last token, when
# its response has left: each Serve call is 0.3-1 ms of this process's CPU, and started at once they delayed the
# response by about 3 ms here (the ingress sends it ~2.5 ms after the last token; `python -m benchmarks.overhead`).
AFTER_RESPONSE_S = 0.005


async def drained(stream: AsyncIterator[GenerateDelta], request_id: str) -> None:
    """Read an engine stream to its end after its last delta, so that Serve closes the request as it would have."""
    try:
        async for _ in stream:
            pass
    except Exception as exc:  # the turn is answered already; a replica lost now costs it nothing
        logger.debug("the engine stream of %s ended with %r after its last delta", request_id, exc)



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
        modelled_engines: bool = False,
    ) -> None:
        """`modelled_engines`: the pools run simulated replicas (`engine.kind: sim`), sent `ReplyParams`."""
        self.engines = engines
        self.directory = directory
        self.cost = cost
        self.model = model
        self.block_size = block_size
        self.hold_ttl_s = hold_ttl_s
        self.max_migrations = max_migrations
        self.modelled_engines = modelled_engines
        self.counters: Counter = Counter(pulls_verified=0, pulls_refused=0)  # shown in stats from the start
        self._rotation = 0  # turn counter for the round-robin baselines
        self.inflight = InFlight()
        self.holds = Holds(directory, engines, self.replicas, self.counters, model, block_size, hold_ttl_s,
                           release_pool=PREFILL_POOL, record_after_s=AFTER_RESPONSE_S)
        self.feedback = Feedback(cost, self.inflight, self.replicas)
        self.recent_prompts = RecentPrompts()
        self._background: set[asyncio.Task] = set()  # work after turns, in flight (asyncio keeps weak refs only)
        self.plan_ms: deque[float] = deque(maxlen=1024)  # how long recent plans took
        # The CPU time this thread spent on them: the planner's own cost, without waits for a busy machine's cores.
        self.plan_cpu_ms: deque[float] = deque(maxlen=1024)
        # Whether the planning thread was switched out meanwhile: (waits, preemptions) it counted (a wait is a
        # voluntary switch, such as for the GIL another thread of the process holds; a preemption is the OS giving
        # its core to another process).
        self.plan_switches: deque[tuple[int, int]] = deque(maxlen=1024)
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
        views = with_busy_peers(self.inflight.views(replicas, key), node_of, self.cost.shared_compute)

        if not views:
            # Replicas have not reported yet (start-up) or the directory restarted: let Serve choose.
            return Plan("", Mode.RECOMPUTE, None, 0, 0, 0.0, {}, "no replica has reported its load yet",
                        turn_index=turn_index)
        eligible = [v.replica_id for v in views if targets is None or v.replica_id in targets]
        preferred = preferred_replica(turn.session_id, eligible)
        return plan_turn(
            len(turn.token_ids), lookup, views, self.cost, preferred, force, targets, turn.policy,
            self._rotation + 1, self._output_tokens(turn), self.met, turn_index, self._founds_home(),
            shared_prefix(key, lookup) if turn_index == 0 else None,
        )

    def record_planned(
        self, turn: Turn, plan: Plan, force: tuple[Mode, str] | None, plan_ms: float, plan_cpu_ms: float,
        switches: tuple[int, int],
    ) -> None:
        """Count a turn that runs as `plan` (once per turn: not again for its continuation after a lost replica):
        the round-robin baselines' rotation, the queues it found (the replicas' typical waits), the turn's place in its
        conversation (the forecast of turns to come) and its prompt (the next turn's place), and how long planning it
        took."""
        self._rotation += 1
        now = time.monotonic()
        observe_queues(self.cost, plan, now)
        self.cost.shared_prefixes.observe_caches(self.directory.cache_turnover, now)
        self.plan_ms.append(plan_ms)
        self.plan_cpu_ms.append(plan_cpu_ms)
        self.plan_switches.append(switches)
        if self._tracks_conversations(turn, force):
            self.cost.workload.observe_turn(plan.turn_index)
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
            planning, planning_cpu, switched = time.perf_counter(), time.thread_time(), thread_switches()
            plan = self.plan(rest, force, self._targets())
            if outcome is None:
                waits, preemptions = thread_switches()
                self.record_planned(turn, plan, force, (time.perf_counter() - planning) * 1e3,
                                    (time.thread_time() - planning_cpu) * 1e3,
                                    (waits - switched[0], preemptions - switched[1]))
                outcome = TurnOutcome(plan, reused_tokens=plan.reused_tokens)
            else:
                outcome.plan, outcome.pull_failed = plan, False
            self.counters[f"plans_{plan.mode.value}"] += 1
            try:
                pull = None
                if reads_hold(plan):
                    taking = time.monotonic()
                    pull = await self.holds.take(rest, plan)
                    self.cost.observe_take_hold((time.monotonic() - taking) * 1e3)
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
        return self.cost.workload.expected_output_tokens(turn.params.max_tokens or 1)

    def _founds_home(self) -> bool:
        """Whether the replica a turn starts on keeps its KV for the conversation's later turns."""
        return True

    def _leaves_holds(self, turn: Turn, stage: str) -> bool:
        """Whether the turn's `stage` request exports a hold: only policies that pull need them, and only where another
        replica could pull it. A lone replica's hold would pin its KV blocks until the lease ends, for nobody (no
        other replica can release it either): under load they filled the cache and stalled every new request."""
        return turn.policy.pulls and turn.keeps_history and len(self.replicas()) > 1

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
            self._after_response(self.feedback.learn_turn(turn, plan, pull, outcome, force))

    def _request(
        self, turn: Turn, plan: Plan, stage: str, pull: Hold | None = None, skip_cache: bool = False,
    ) -> GenerateRequest:
        """The request for one stage of a turn (`stage` names it: "turn", or "prefill" and "decode" for P/D)."""
        return GenerateRequest(
            request_id=f"{turn.request_id}-{stage}-{'kv' if pull else 'run'}",
            prompt_token_ids=turn.token_ids,
            params=ReplyParams.of(turn.params) if self.modelled_engines else turn.params,
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
                        busy_peers = self.feedback.busy_peers_since(where, sent_at)
                    if outcome.ttft_ms is None:
                        outcome.ttft_ms = (time.monotonic() - started) * 1e3
                    if prefills and plan.superseded:
                        # The turn has read what it reuses; older holds of its history only pin blocks now.
                        self._after_response(self.holds.release(plan.superseded))
                output.extend(delta.token_ids)
                if delta.finished:
                    outcome.replica_id = delta.replica_id
                    outcome.reused_tokens = delta.num_cached_tokens
                    outcome.completion_tokens = delta.completion_tokens
                    if request.pull is not None and plan.holder:
                        self.met.add((delta.replica_id, plan.holder))  # their NIXL agents have shaken hands
                    if records_hold:
                        self.holds.record(turn, turn.token_ids + output, delta)
                    if prefills:
                        pulled = request.pull is not None and plan.mode is Mode.PULL
                        self._after_response(self.feedback.learn_request(plan, pulled, delta, busy_peers))
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


def thread_switches() -> tuple[int, int]:
    """This thread's context switches so far: (voluntary, involuntary), as Linux counts them per thread ((0, 0)
    where the OS does not count per thread)."""
    if not hasattr(resource, "RUSAGE_THREAD"):
        return 0, 0
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_nvcsw, usage.ru_nivcsw
