"""What a finished turn teaches the planner: its prefill, pull and decode timings (the cost model's fits), how far
off the plan's estimate of its first token was (the estimate error), and how long turns decode."""

from __future__ import annotations

from collections.abc import Callable

from actors.replica_api import GenerateDelta, ReplicaStats
from app.inflight import InFlight
from app.turn_types import Turn, TurnOutcome
from kvtransfer.cost_model import CostModel
from kvtransfer.options import Mode
from kvtransfer.planner import Plan, reads_hold
from kvtransfer.types import Hold


class Feedback:
    """Teaches `cost` from turns this ingress ran (mutates `cost` only)."""

    def __init__(self, cost: CostModel, inflight: InFlight, replicas: Callable[[], list[ReplicaStats]]) -> None:
        self.cost = cost
        self.inflight = inflight
        self.replicas = replicas

    def busy_peers_since(self, replica_id: str, since: float) -> float:
        """How many other engines of `replica_id`'s node were busy from `since` until now, each counted for the
        share of that time it had a request of this ingress in flight (others' requests are not seen here)."""
        node_of = {r.replica_id: r.node_id for r in self.replicas()}
        node, now = node_of.get(replica_id), self.inflight.now()
        return sum(self.inflight.busy_share(peer, since, now)
                   for peer, peer_node in node_of.items() if peer != replica_id and peer_node == node)

    async def learn_request(self, plan: Plan, pulled: bool, last: GenerateDelta, busy_peers: float) -> None:
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
            self.cost.observe_pull(reused - plan.cached_tokens, last.wait_s * 1e3, plan.holder_busy)

    async def learn_turn(self, turn: Turn, plan: Plan, pull: Hold | None, outcome: TurnOutcome,
                         force: tuple[Mode, str] | None) -> None:
        """The whole turn's lessons: its estimate's error and, for a turn a client sent, how long it decoded."""
        # The calibration sets its turns' output length (1 or 256 tokens): they say nothing of how long turns decode.
        if self.observe_error(turn, plan, pull, outcome, force) and not turn.calibration:
            self.cost.workload.observe_output(outcome.completion_tokens)

    def observe_error(self, turn: Turn, plan: Plan, pull: Hold | None, outcome: TurnOutcome,
                      force: tuple[Mode, str] | None) -> bool:
        """If the turn's first stage ran as planned (no failed or skipped read, not moved, and not forced unless the
        start-up calibration forced it), teach the planner how far off its estimate of that stage's time to first
        token was; returns whether it did.

        The calibration's forced turns are real turns of each mode on idle or busy engines: they teach the error too,
        so an app's first turns are already corrected."""
        planned = force is None or turn.calibration
        if (planned and not outcome.migrations and not outcome.pull_failed and outcome.ttft_ms is not None
                and (pull is not None or not reads_hold(plan))):
            self.cost.error.observe(plan.mode, plan.busy_peers, plan.model_ms, outcome.ttft_ms, plan.busy_target)
            return True
        return False
