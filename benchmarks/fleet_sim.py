"""A fleet of modelled engines driven by kvrelay's real planner, cost model and KV directory, in virtual time.

Every turn takes the path a served turn takes, minus Ray and HTTP: its prompt's block hashes (`PrefixKey`) are
looked up in a `KVDirectory` that the engines' vLLM-format KV events and exported holds keep current (through
`ResidentTracker`, as a real replica's forwarder does), `plan_turn` chooses a (replica, mode) from the replicas'
load, the plan runs on a `SimEngine` (consuming the hold it pulls from the directory, as the ingress does), and
what the turn measured teaches the `CostModel` online, as `TurnRunner` teaches it. The cost model is seeded by the
start-up calibration's sequence of forced turns (`kvtransfer.calibration`), run on the modelled engines.

What the model leaves out: the ingress's view is exact and current (a real mirror lags its directory by a
heartbeat), holds are recorded at once, and transfers do not share a link's bandwidth. A planned request reaches its
engine at once (the ingress's latency is added to its TTFT afterwards), so of turns planned at the same instant the
first starts a step alone, where a real engine may take several into its first step. Engines own their cores: a
profile measured on bare replicas leaves out the CPU the app's request path takes from them where it shares their
cores (on the 2-core CPU machine, engine steps in a loaded app ran about a fifth slower while decoding).
Deterministic for a seed: one heap of events, ties broken by insertion order.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable

from actors.kv_events import ResidentTracker
from benchmarks.fleet_turns import FleetResult, LiveConversation, TurnInFlight, TurnRecord
from benchmarks.fleet_workloads import Conversation, Workload, conversations
from kvtransfer.cost_model import CostModel
from kvtransfer.directory_index.index import KVDirectory
from kvtransfer.load import ReplicaView, preferred_replica, with_busy_peers
from kvtransfer.options import Mode
from kvtransfer.planner import observe_queues, plan_turn, reads_hold
from kvtransfer.policies import get_policy
from kvtransfer.prefix_key import PrefixKey, Scope
from kvtransfer.shared_prefix import shared_prefix
from kvtransfer.sim.block_cache import vllm_block_hashes
from kvtransfer.sim.engine import Hold as EngineHold
from kvtransfer.sim.engine import SimEngine, SimRequest
from kvtransfer.sim.profile import EngineProfile
from kvtransfer.types import Hold, HoldId

MODEL = "sim"
RATE_WINDOW_S = 10.0  # as the ingress's InFlight counts arrival rates


class Fleet:
    """N modelled replicas behind one planner. `run(workload)` serves a workload under one policy."""

    def __init__(self, profile: EngineProfile, replicas: int, policy: str, seed: int = 0,
                 topology: str = "aggregated", prefill_replicas: int | None = None,
                 prefill_prefix_caching: bool = True, recompute_baseline: bool = False) -> None:
        self.profile = profile
        self.policy = get_policy(policy)
        self.seed = seed
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        per_node = profile.replicas_per_node
        self.engines = [SimEngine(f"r{i}", f"node{i // per_node}", profile, self._busy_peers) for i in range(replicas)]
        self.by_id = {e.replica_id: e for e in self.engines}
        for e in self.engines:
            e.on_first_token = self._first_token
            e.on_finish = self._finished
        self.topology = topology
        # P/D's recompute baseline (`recompute`): every served turn forced to recompute on the least busy prefill
        # replica (the calibration before serving runs as the app's does).
        self.recompute_baseline = recompute_baseline
        self._serving = False
        n_prefill = prefill_replicas if prefill_replicas is not None else max(1, replicas // 2)
        self.prefill_pool = [e.replica_id for e in self.engines[:n_prefill]] if topology == "disaggregated" else None
        self.decode_pool = [e.replica_id for e in self.engines[n_prefill:]] if topology == "disaggregated" else []
        for rid in self.prefill_pool or ():
            self.by_id[rid].prefix_caching = prefill_prefix_caching
        # The app's directory stops offering a hold this long before its lease ends (app/builder.py).
        self.directory = KVDirectory(profile.block_size, clock=lambda: self.now, max_entries=50_000_000,
                                     max_bytes=1 << 40, expiry_margin_s=min(10.0, 0.3 * profile.hold_ttl_s))
        self.trackers: dict[str, dict[str, ResidentTracker]] = {}
        self.cost = CostModel(lambda n: n * profile.kv_bytes_per_token,
                              shared_compute=profile.contention_per_busy_peer > 0)
        self.cost.set_nodes({e.replica_id: e.node for e in self.engines})
        self.met: set[tuple[str, str]] = set()
        self.result = FleetResult()
        self._turns: dict[str, TurnInFlight] = {}
        self._holds: dict[HoldId, EngineHold] = {}  # the directory's hold -> the modelled engine's
        self._hold_serials = itertools.count()  # the holds' ids, minted as the replicas mint them (`HoldId`)
        self._arrivals: dict[str, deque[tuple[float, str]]] = {e.replica_id: deque() for e in self.engines}
        self._rotation = 0
        self._request_seq = 0
        self._last_finish = 0.0
        # (conversation, turn) -> each served turn's time per output token after the first (its TPOT), in ms.
        self.tpot_ms: dict[tuple[str, int], float] = {}

    # ----- the event loop

    def at(self, t: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, fn))

    def run_until_idle(self, limit_s: float = 1e9, done: Callable[[], bool] = lambda: False) -> None:
        """Process events up to `limit_s` (virtual seconds), or until `done()`."""
        while self._events and self._events[0][0] <= limit_s and not done():
            t, _, fn = heapq.heappop(self._events)
            self.now = max(self.now, t)
            fn()

    def _kick(self, engine: SimEngine) -> None:
        """Start `engine`'s next step if it is not stepping."""
        if engine.busy:
            return
        end = engine.next_step(self.now)
        if end is not None:
            self.at(end, lambda: self._step_done(engine))
        elif engine.waiting:  # requests waiting for their KV: look again when the first arrives
            ready = min((r.kv_ready_at for r in engine.waiting if r.kv_ready_at > self.now), default=None)
            if ready is not None:
                self.at(ready, lambda: self._kick(engine))

    def _step_done(self, engine: SimEngine) -> None:
        engine.finish_step(self.now)
        self._report_events(engine)
        self._kick(engine)

    def _busy_peers(self, engine: SimEngine) -> int:
        return sum(1 for e in self.engines if e is not engine and e.node == engine.node and e.busy)

    def _report_events(self, engine: SimEngine) -> None:
        """The engine's KV events, through its tracker, into the directory (as a replica's forwarder sends them)."""
        events = engine.cache.take_events()
        if not events:
            return
        tracker = self.trackers.setdefault(engine.replica_id, {}).setdefault(
            "", ResidentTracker(MODEL, self.profile.block_size))
        ops = tracker.apply(events)
        if ops:
            self.directory.apply_resident(engine.replica_id, ops)

    # ----- the planner's view

    def _views(self, conv_id: str) -> list[ReplicaView]:
        views = []
        for e in self.engines:
            waiting, backlog = e.prefill_backlog()
            decoding = sum(1 for r in e.running if not r.prefilling)
            arrivals = self._arrivals[e.replica_id]
            while arrivals and arrivals[0][0] < self.now - RATE_WINDOW_S:
                arrivals.popleft()
            rate = sum(1 for _, c in arrivals if c != conv_id) / RATE_WINDOW_S
            step = e.last_step_ms if decoding and e.last_step_ms else None
            views.append(ReplicaView(e.replica_id, running=decoding, waiting=0,
                                     decode_tok_s=1e3 / step if step else None, prefill_tokens=backlog,
                                     prefilling=waiting, arrival_rate=rate))
        return with_busy_peers(views, {e.replica_id: e.node for e in self.engines}, self.cost.shared_compute)

    # ----- turns

    def start_turn(self, live: LiveConversation, force: tuple[Mode, str] | None = None,
                   tenant_policy: str | None = None, on_done: Callable[[], None] | None = None,
                   max_tokens: int | None = None) -> None:
        """Plan and start the conversation's next turn now."""
        conv, index = live.conv, live.next_turn
        turn = conv.turns[index]
        prompt = live.tokens + turn.user_tokens
        output = turn.output_tokens[: max_tokens] if max_tokens else turn.output_tokens
        key = live.key.extend(turn.user_tokens)
        policy = get_policy(tenant_policy) if tenant_policy else self.policy
        pulls = policy.pulls and len(self.engines) > 1
        # Whether the turn's last stage leaves its history held for the next turn: of the calibration's turns, only a
        # first turn that the next one pulls from (as in the app, `Turn.keeps_history`).
        keeps = pulls and (not conv.calibration or (conv.calibration_hold and index == 0))
        turn_index: int | None = index
        baseline = self.recompute_baseline and self._serving
        if force is None and baseline:
            least = min(self.prefill_pool or self.by_id, key=lambda i: (len(self.by_id[i].running)
                                                                         + len(self.by_id[i].waiting), i))
            force = (Mode.RECOMPUTE, least)
        if force is None and pulls:
            self.cost.workload.observe_turn(turn_index)
        views = self._views(conv.conv_id)
        targets = self.prefill_pool
        preferred = preferred_replica(conv.conv_id, [v.replica_id for v in views
                                                     if targets is None or v.replica_id in targets])
        self._rotation += 1
        lookup = self.directory.lookup(key)
        self.cost.shared_prefixes.observe_caches(self.directory.cache_turnover, self.now)
        plan = plan_turn(len(prompt), lookup, views, self.cost, preferred, force, targets, policy, self._rotation,
                         self.cost.workload.expected_output_tokens(len(output)), self.met, turn_index,
                         founds_home=self.topology != "disaggregated",
                         shared_prefix=shared_prefix(key, lookup) if turn_index == 0 else None)
        self.result.counters[f"plans_{plan.mode.value}"] += 1
        observe_queues(self.cost, plan, self.now)
        full = prompt + output
        bs = self.profile.block_size
        known = len(live.vllm_hashes)
        hashes = live.vllm_hashes + vllm_block_hashes(
            full[known * bs:], bs, conv.tenant, parent=live.vllm_hashes[-1] if known else None)
        self._request_seq += 1
        # P/D: the prefill pool computes the first token and holds the prompt's KV for the decode pool to read.
        disaggregated = self.topology == "disaggregated"
        request = SimRequest(f"q{self._request_seq}", prompt, output[:1] if disaggregated else output, hashes,
                             self.now, cache_salt=conv.tenant,
                             skip_cache=force is not None and force[0] is Mode.RECOMPUTE,
                             export_hold=disaggregated or keeps, planned_reused=plan.reused_tokens)
        t = TurnInFlight(live, index, plan, self.now, prompt, request, forced=force is not None and not baseline,
                  on_done=on_done)
        t.output = output
        t.leaves_hold = keeps
        target = self.by_id[plan.replica_id]
        if reads_hold(plan):
            self._read_hold(t, target)
        self._turns[request.request_id] = t
        self._arrivals[target.replica_id].append((self.now, conv.conv_id))
        self.result.requests_per_replica[target.replica_id] += 1
        target.add(request)
        self._kick(target)

    def _read_hold(self, t: TurnInFlight, target: SimEngine) -> None:
        """Take the planned hold from the directory and start its read (a pull, or a copy inside the holder)."""
        hold = self.directory.consume_hold(t.plan.hold.hold_id)
        engine_hold = self._holds.pop(hold.hold_id, None) if hold is not None else None
        if engine_hold is None or engine_hold.released or hold.num_tokens > len(t.prompt) - 1:
            self.result.counters["holds_gone"] += 1
            return
        request = t.request
        request.pulled_tokens = hold.num_tokens
        holder = engine_hold.engine
        if holder is target:  # the turn's own hold: a copy inside the engine
            request.kv_ready_at = self.now
            engine_hold.release()
            return
        moved = hold.num_tokens - t.plan.cached_tokens
        first = (target.replica_id, holder.replica_id) not in self.met
        ms = self.profile.pull_ms(moved, holder.node == target.node, first)
        request.kv_ready_at = self.now + ms / 1e3
        t.kv_wait_ms = ms
        t.pulled_bytes = moved * self.profile.kv_bytes_per_token
        self.met.add((target.replica_id, holder.replica_id))
        self.result.counters["pulls"] += 1
        self.result.counters["pulled_bytes"] += t.pulled_bytes
        self.at(request.kv_ready_at, lambda: (engine_hold.release(), self._report_events(holder)))

    def _first_token(self, r: SimRequest) -> None:
        t = self._turns.get(r.request_id)
        if t is None or t.decode_stage:
            return
        ttft = (self.now - t.start) * 1e3 + self.profile.request_overhead_ms
        plan, engine = t.plan, self.by_id[t.plan.replica_id]
        planned = not t.forced or t.live.conv.calibration
        if planned and not (reads_hold(plan) and r.pulled_tokens == 0):
            self.cost.error.observe(plan.mode, plan.busy_peers, plan.model_ms, ttft, plan.busy_target)
        if r.ran_alone and r.prefill_started_at is not None:
            busy = self._busy_peers(engine)
            self.cost.observe_prefill(r.prompt_len - r.reused_tokens, r.reused_tokens,
                                      (self.now - r.prefill_started_at) * 1e3, busy, engine.replica_id)
            if t.kv_wait_ms is not None and plan.mode is Mode.PULL:
                self.cost.observe_pull(r.reused_tokens - plan.cached_tokens, t.kv_wait_ms, plan.holder_busy)
        for offer in plan.superseded:  # the turn has read what it reuses: older holds of its history only pin blocks
            hold = self.directory.consume_hold(offer.hold_id)
            engine_hold = self._holds.pop(hold.hold_id, None) if hold is not None else None
            if engine_hold is not None:
                engine_hold.release()
                self.result.counters["holds_released"] += 1
        if not t.forced:
            self.result.records.append(TurnRecord(
                t.live.conv.conv_id, t.index, self.policy.name, t.start, ttft, r.prompt_len, r.reused_tokens,
                plan.mode.value if r.pulled_tokens or plan.mode is not Mode.PULL else Mode.RECOMPUTE.value,
                engine.replica_id, plan.estimate_ms, t.pulled_bytes))

    def _finished(self, r: SimRequest, hold: EngineHold | None) -> None:
        t = self._turns.pop(r.request_id, None)
        engine = self.by_id[t.plan.replica_id] if t else None
        if t is None or engine is None:
            return
        if self.topology == "disaggregated" and not t.decode_stage:
            self._decode(t, r, hold)
            return
        if len(r.output_ids) > 1 and len(engine.running) == 0 and r.first_token_at is not None:
            self.cost.observe_decode((self.now - r.first_token_at) * 1e3 / (len(r.output_ids) - 1))
        if not t.live.conv.calibration:
            self.cost.workload.observe_output(r.generated)
        if not t.forced and r.first_token_at is not None and r.generated > 1:
            self.tpot_ms[(t.live.conv.conv_id, t.index)] = (self.now - r.first_token_at) * 1e3 / (r.generated - 1)
        live = t.live
        key = live.key.extend(live.conv.turns[t.index].user_tokens)
        live.tokens = t.prompt + r.output_ids
        if hold is not None and not t.leaves_hold:
            hold.release()  # P/D's decode holds only for policies that pull the history back
            hold = None
        live.key = key.extend(r.output_ids)
        full = len(live.tokens) // self.profile.block_size
        live.vllm_hashes = r.hashes[:full]
        live.next_turn += 1
        self._last_finish = self.now
        if hold is not None:
            self._record_hold(engine, r, hold, live)
        self._report_events(engine)
        if t.on_done is not None:
            t.on_done()

    def _decode(self, t: TurnInFlight, r: SimRequest, prefill_hold: EngineHold | None) -> None:
        """P/D: the least busy decode replica reads the prompt's KV from the prefill replica and decodes the rest,
        holding the whole turn's KV afterwards for the next turn's prefill to pull back."""
        target = min((self.by_id[i] for i in self.decode_pool),
                     key=lambda e: (len(e.running) + len(e.waiting), e.replica_id))
        prefill = self.by_id[t.plan.replica_id]
        request = SimRequest(f"{r.request_id}d", t.prompt, t.output, r.hashes, self.now, cache_salt=r.cache_salt,
                             export_hold=True)
        cached = target.cache.match(r.hashes[: r.prompt_len // self.profile.block_size]) * self.profile.block_size
        request.pulled_tokens = r.prompt_len - 1
        ms = self.profile.pull_ms(max(0, r.prompt_len - cached), prefill.node == target.node,
                                  (target.replica_id, prefill.replica_id) not in self.met)
        self.met.add((target.replica_id, prefill.replica_id))
        request.kv_ready_at = self.now + ms / 1e3
        if prefill_hold is not None:
            self.at(request.kv_ready_at, lambda: (prefill_hold.release(), self._report_events(prefill)))
        plan = t.plan._replace(replica_id=target.replica_id)
        d = TurnInFlight(t.live, t.index, plan, self.now, t.prompt, request, forced=True, on_done=t.on_done,
                  decode_stage=True, output=t.output, leaves_hold=t.leaves_hold)
        self._turns[request.request_id] = d
        target.add(request)
        self._report_events(prefill)
        self._kick(target)

    def _record_hold(self, engine: SimEngine, r: SimRequest, hold: EngineHold, live: LiveConversation) -> None:
        hold_id = HoldId(engine.replica_id, next(self._hold_serials))
        record = Hold(engine_id=engine.replica_id, host="sim", port=0, block_ids=[[]], num_tokens=hold.num_tokens,
                      hold_id=hold_id, request_id=r.request_id)
        result = self.directory.record_hold(engine.replica_id, live.key.truncate(hold.num_tokens), record,
                                            hold.expires_at, prompt_tokens=r.prompt_len)
        if not result.kept:
            hold.release()
            return
        self._holds[hold_id] = hold
        self.at(hold.expires_at, lambda: (hold.release(), self._holds.pop(hold_id, None),
                                          self._report_events(engine)))

    # ----- calibration and serving

    def new_conversation(self, conv: Conversation) -> LiveConversation:
        scope = Scope(MODEL, conv.tenant)
        return LiveConversation(conv, list(conv.prefix_tokens), [], PrefixKey.build(conv.prefix_tokens, scope,
                                                                        self.profile.block_size))

    def run(self, workload: Workload, convs: list[Conversation] | None = None) -> FleetResult:
        """Serve every conversation of the workload, or `convs` with the workload's arrivals (calibrating first);
        returns what each turn measured."""
        from benchmarks.fleet_calibration import calibrate

        calibrate(self)
        self.result = FleetResult()  # serving starts counting now
        self._serving = True
        self.tpot_ms.clear()
        start = self.now
        convs = conversations(workload, self.seed) if convs is None else convs
        queue = deque(convs)

        def run_conversation(conv: Conversation) -> None:
            live = self.new_conversation(conv)

            def next_turn() -> None:
                if live.next_turn >= len(conv.turns):
                    if workload.arrival == "concurrency" and queue:
                        run_conversation(queue.popleft())
                    return
                think = conv.turns[live.next_turn].think_s
                self.at(self.now + think, lambda: self.start_turn(live, on_done=next_turn))

            next_turn()

        if workload.arrival == "concurrency":
            for _ in range(min(workload.concurrency, len(queue))):
                run_conversation(queue.popleft())
        else:
            for c in convs:
                self.at(start + (c.start_s or 0.0), lambda c=c: run_conversation(c))
            queue.clear()
        self.run_until_idle()
        self.result.duration_s = self._last_finish - start  # not the holds' leases running out after the last turn
        self.result.cost_model = self.cost.snapshot()
        return self.result
