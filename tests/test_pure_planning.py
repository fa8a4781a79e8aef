"""Planning a turn reads state and records nothing; a turn that runs is counted once, also when it migrates.

`Ingress.plan` answers "where would this turn run" through `TurnRunner.plan`: asking must not count a turn (the
round-robin rotation, the forecast of a conversation's turns to come, the recent prompts that place the next turn,
the planning times shown in stats). A turn whose replica dies mid-stream is planned again for its continuation,
and still counts as one turn. The engine pool here is a double that streams tokens and can die once: the subject
is the ingress's bookkeeping, not the engine path (`tests/test_migration.py` kills real engines).
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from ray.exceptions import RayActorError

from actors.replica_api import GenerateDelta, GenerateRequest, ReplicaStats, Sampling
from app.turn_types import Turn
from app.turns import TurnRunner
from kvtransfer.cost_model import CostModel
from kvtransfer.types import LookupResult

BLOCK_SIZE = 16


def stats(replica_id: str) -> ReplicaStats:
    return ReplicaStats(replica_id=replica_id, node_id="n1", running=0, waiting=0, kv_cache_usage=0.0,
                        prefix_cache_hit_rate=0.0, prefill_tok_s=None, decode_tok_s=None, requests_finished=0)


class Directory:
    """The mirror's reads, with nothing held anywhere; records what the runner sends it."""

    def __init__(self) -> None:
        self.deregistered: list[str] = []

    def live(self) -> list[ReplicaStats]:
        return [stats("a"), stats("b")]

    def lookup(self, key: Any) -> LookupResult:
        return LookupResult(key.num_tokens, ())

    def continues(self, key: Any) -> bool:
        return False

    def cache_turnover(self) -> dict[str, tuple[int, int]]:
        return {}

    async def deregister(self, replica_id: str) -> None:
        self.deregistered.append(replica_id)


class Engines:
    """An engine pool whose replica dies after `die_after` tokens of its first request; later requests finish."""

    def __init__(self, die_after: int | None, tokens: int = 6) -> None:
        self.die_after = die_after
        self.tokens = tokens
        self.requests: list[GenerateRequest] = []

    def options(self, stream: bool) -> Engines:
        return self

    @property
    def generate(self) -> Engines:
        return self

    def remote(self, request: GenerateRequest) -> Any:
        self.requests.append(request)
        dies = self.die_after if len(self.requests) == 1 else None
        return self._stream(request, dies)

    async def _stream(self, request: GenerateRequest, dies: int | None) -> Any:
        budget = request.params.max_tokens
        for i in range(budget):
            if dies is not None and i == dies:
                raise RayActorError()
            last = i == budget - 1
            yield GenerateDelta(token_ids=[500 + i], text="x", finished=last, finish_reason="length" if last else None,
                                prompt_tokens=len(request.prompt_token_ids), completion_tokens=i + 1,
                                replica_id=request.target_replica or "a")


def runner(engines: Engines | None = None) -> TurnRunner:
    return TurnRunner(engines, Directory(), CostModel(lambda n: 1024 * n), "m", BLOCK_SIZE, hold_ttl_s=10.0)


def recorded(r: TurnRunner) -> dict[str, Any]:
    """Everything planning a turn could record."""
    return {"rotation": r._rotation, "plan_ms": list(r.plan_ms), "plan_cpu_ms": list(r.plan_cpu_ms),
            "plan_switches": list(r.plan_switches),
            "recent_prompts": len(r.recent_prompts),
            "turn_indexes": list(r.cost.workload._turn_index), "cost_model": copy.deepcopy(r.cost.snapshot()),
            "counters": dict(r.counters)}


def turn(n: int, max_tokens: int = 6) -> Turn:
    return Turn(f"t{n}", list(range(100 + n, 100 + n + 64)), Sampling(max_tokens=max_tokens).to_params())


def test_planning_a_turn_records_nothing_and_plans_the_same_each_time():
    r = runner()
    before = recorded(r)
    plans = [r.plan(turn(1)) for _ in range(3)]
    assert recorded(r) == before
    assert plans[1:] == plans[:-1]


def test_a_turn_that_runs_is_counted_once_and_its_next_turn_continues_it():
    async def main() -> TurnRunner:
        r = runner(Engines(die_after=None))
        first = turn(1)
        [item async for item in r.run(first)]
        # The next turn of the same conversation: its prompt starts with the whole first prompt.
        second = Turn("t1b", first.token_ids + [7] * 40, Sampling(max_tokens=6).to_params())
        plan = r.plan(second)
        assert plan.turn_index == 1
        return r

    r = asyncio.run(main())
    assert r._rotation == 1 and len(r.plan_ms) == 1
    # Its planning's CPU time too: the planner's own cost, whatever waits a busy machine added to its wall time.
    assert len(r.plan_cpu_ms) == 1 and r.plan_cpu_ms[0] > 0
    # And whether its thread was switched out meanwhile (waits, preemptions): what tells those waits apart.
    assert len(r.plan_switches) == 1 and all(n >= 0 for n in r.plan_switches[0])
    assert list(r.cost.workload._turn_index) == [0] and len(r.recent_prompts) == 1


def test_a_turn_whose_replica_dies_mid_stream_is_planned_again_but_counted_once():
    async def main() -> tuple[TurnRunner, list[GenerateDelta]]:
        r = runner(Engines(die_after=3))
        deltas = [delta async for delta, _ in r.run(turn(2))]
        return r, deltas

    r, deltas = asyncio.run(main())
    engines: Engines = r.engines
    assert len(engines.requests) == 2, "the turn continued on a second request"
    assert [t for d in deltas for t in d.token_ids] == [500, 501, 502, 500, 501, 502]
    assert r.counters["migrations"] == 1
    assert r._rotation == 1 and len(r.plan_ms) == 1
    assert list(r.cost.workload._turn_index) == [0] and len(r.recent_prompts) == 1
