"""How long the planner alone takes to plan one turn, in a plain process (no Ray, no engines): p50/p99 of
`with_busy_peers` + `plan_turn`, wall and this thread's CPU time (a shared machine's preemptions leave the latter
out), over random turns at 8/16/32/64 replicas on 2 or 8 nodes, half of the replicas busy, with a
calibrated cost model (per-node contention fits, a measured estimate error, a workload forecast). And the step before
it on the ingress, the replicas' views for a turn (`InFlight.views`, `views_<N>r`), after ten seconds of the
traffic `benchmarks.control_plane` drives (20 turns/s of 3,840-token prompts spread over the replicas).

`--dump PATH` instead writes every plan of a fixed set of random turns under every policy, one `repr` a line:
plans from two versions of the planner are identical if the files are.

    python -m benchmarks.plan_time [--turns 2000] [--dump plans.txt]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from itertools import count

from actors.replica_api import ReplicaStats
from app.inflight import InFlight
from kvtransfer.cost_model import CostModel
from kvtransfer.load import ReplicaView, preferred_replica, with_busy_peers
from kvtransfer.planner import plan_turn
from kvtransfer.prefix_key import PrefixKey, Scope
from kvtransfer.types import Hold, HoldId, HoldOffer, LookupResult, ReplicaMatch

POLICIES = ("kvrelay", "round_robin", "session", "prefix_affinity", "fixed_threshold")
_SERIALS = count()


def calibrated_cost(rng: random.Random, nodes: list[str], shared_compute: bool = True) -> CostModel:
    """A cost model as it stands after a while of running: fitted prefill and pull, per-node contention, a
    decode step, a workload forecast and an estimate error per kind of turn. `shared_compute` False: engines with a
    GPU each, which do not slow each other."""
    cost = CostModel(lambda n: 23040 * n, shared_compute=shared_compute)
    for n in (64, 256, 1024, 2048, 4096):
        cost.observe_prefill(n, 0, 5.0 + 0.3 * n * rng.uniform(0.95, 1.05))
    for n in (256, 1024, 4096):
        cost.observe_pull(n, 8.0 + 23040 * n / 2e6 * rng.uniform(0.9, 1.1))
    node_of = {f"r{i}": nodes[i % len(nodes)] for i in range(64)}
    cost.set_nodes(node_of)
    for _ in range(16 * len(nodes)):
        replica = f"r{rng.randrange(64)}"
        cost.observe_prefill(512, 0, (5.0 + 0.3 * 512) * rng.uniform(1.1, 1.6), rng.uniform(0.5, 3), replica)
    cost.observe_decode(18.0)
    for _ in range(64):
        cost.workload.observe_turn(rng.choice((0, 1, 2, 3, None)))
        cost.workload.observe_output(rng.randrange(16, 256))
    for _ in range(64):
        mode = rng.choice(("local", "pull", "recompute"))
        cost.error.observe(mode, rng.choice((0, 1)), 100.0, 100.0 + rng.gauss(5, 20))
    return cost


def random_turn(rng: random.Random, replicas: int, nodes: list[str]) -> dict:
    """A turn's planner inputs: views (half of the replicas busy) with their busy peers, and a lookup in which a
    few replicas hold part of the prompt (some with a pullable hold)."""
    ids = [f"r{i}" for i in range(replicas)]
    node_of = {r: nodes[i % len(nodes)] for i, r in enumerate(ids)}
    busy = set(rng.sample(ids, replicas // 2))
    views = []
    for r in ids:
        if r in busy:
            prefilling = rng.randrange(3)
            views.append(ReplicaView(r, running=rng.randrange(1, 5), waiting=rng.randrange(2),
                                     decode_tok_s=rng.choice((None, rng.uniform(20, 60))),
                                     prefill_tokens=prefilling * rng.randrange(100, 2000), prefilling=prefilling,
                                     arrival_rate=rng.uniform(0, 3)))
        else:
            views.append(ReplicaView(r, arrival_rate=rng.choice((0.0, rng.uniform(0, 1)))))
    num_tokens = rng.randrange(64, 4096)
    matches = []
    for r in sorted(rng.sample(ids, rng.randrange(0, min(4, replicas) + 1))):
        held = rng.randrange(1, num_tokens + 64)
        offer = None
        if rng.random() < 0.7:
            hold = Hold(engine_id=f"e-{r}", host="127.0.0.1", port=1, block_ids=[[1]], num_tokens=held,
                        hold_id=HoldId(f"e-{r}", next(_SERIALS)))
            offer = HoldOffer(r, held, 1e12, hold)
        matches.append(ReplicaMatch(r, held, "hold" if offer else "resident", held // 32 * 32, offer))
    matches.sort(key=lambda m: -m.num_tokens)
    met = {(a, b) for a in ids for b in ids if rng.random() < 0.5} if rng.random() < 0.5 else None
    session = f"s{rng.randrange(1000)}" if rng.random() < 0.8 else None
    return {
        "num_tokens": num_tokens, "lookup": LookupResult(num_tokens, tuple(matches)), "views": views,
        "node_of": node_of, "preferred": preferred_replica(session, ids), "rotation": rng.randrange(100),
        "output_tokens": rng.randrange(1, 256), "met": met, "turn_index": rng.choice((0, 1, 3, None)),
    }


def plan(cost: CostModel, turn: dict, policy: str = "kvrelay"):
    """Plan `turn` as the ingress does: busy peers from the nodes, then the planner."""
    views = with_busy_peers(turn["views"], turn["node_of"], cost.shared_compute)
    return plan_turn(turn["num_tokens"], turn["lookup"], views, cost, turn["preferred"], policy=policy,
                     rotation=turn["rotation"], output_tokens=turn["output_tokens"], met=turn["met"],
                     turn_index=turn["turn_index"])


def timings(turns: int) -> dict[str, dict[str, float]]:
    out = {}
    # CPU replicas on 2 or 8 nodes, and GPU replicas (no contention between them) on 8 nodes or on one, as 64
    # simulated ones on one host (`benchmarks.control_plane`).
    for nodes, shared_compute in ((2, True), (8, True), (8, False), (1, False)):
        names = [f"n{i}" for i in range(nodes)]
        for replicas in (8, 16, 32, 64):
            rng = random.Random(replicas * 100 + nodes)
            cost = calibrated_cost(rng, names, shared_compute)
            cases = [random_turn(rng, replicas, names) for _ in range(turns)]
            wall, cpu = [], []
            for turn in cases:
                start, start_cpu = time.perf_counter(), time.thread_time()
                plan(cost, turn)
                cpu.append((time.thread_time() - start_cpu) * 1e3)
                wall.append((time.perf_counter() - start) * 1e3)
            q, q_cpu = statistics.quantiles(wall, n=100), statistics.quantiles(cpu, n=100)
            name = f"{replicas}r_{nodes}n" + ("" if shared_compute else "_gpu")
            out[name] = {"p50_ms": round(q[49], 3), "p99_ms": round(q[98], 3),
                         "cpu_p50_ms": round(q_cpu[49], 3), "cpu_p99_ms": round(q_cpu[98], 3)}
    return out


def views_timings(turns: int, rate: float = 20.0, seconds: float = 10.0, turn_s: float = 1.2) -> dict:
    """`InFlight.views` of every replica for a follow-up turn, after `seconds` of `rate` first turns per second, each
    in flight for `turn_s`, on random replicas."""
    out = {}
    for replicas in (8, 16, 32, 64):
        rng, now = random.Random(replicas), [1000.0]
        inflight, ids = InFlight(clock=lambda now=now: now[0]), [f"r{i}" for i in range(replicas)]
        keys, running = [], []
        for i in range(int(rate * seconds)):
            now[0] += 1 / rate
            key = PrefixKey.build([rng.randrange(32_000) for _ in range(3840)], Scope("m", ""), 16)
            replica = rng.choice(ids)
            inflight.started(replica, str(i), key.num_tokens, key.prompt_end(key.num_tokens))
            keys.append(key)
            running.append((now[0], replica, str(i)))
            while running[0][0] < now[0] - turn_s:
                _, done, request = running.pop(0)
                inflight.first_token(done, request)
                inflight.ended(done, request)
        beats = [ReplicaStats(replica_id=r, at=now[0] - 0.3, running=rng.randrange(3), waiting=0, kv_cache_usage=0.1,
                              prefix_cache_hit_rate=0.5, prefill_tok_s=None, decode_tok_s=50.0, requests_finished=1)
                 for r in ids]
        follow_ups = [rng.choice(keys).extend([rng.randrange(32_000) for _ in range(128)]) for _ in range(turns)]
        cpu = []
        for key in follow_ups:
            start = time.thread_time()
            inflight.views(beats, key)
            cpu.append((time.thread_time() - start) * 1e3)
        q = statistics.quantiles(cpu, n=100)
        out[f"views_{replicas}r"] = {"cpu_p50_ms": round(q[49], 3), "cpu_p99_ms": round(q[98], 3)}
    return out


def dump(path: str, turns: int) -> None:
    rng = random.Random(37)
    with open(path, "w") as f:
        for i in range(turns):
            nodes = [f"n{k}" for k in range(rng.choice((1, 2, 8)))]
            cost = calibrated_cost(rng, nodes)
            turn = random_turn(rng, rng.choice((1, 2, 3, 8, 16, 64)), nodes)
            for policy in POLICIES:
                f.write(f"{i} {policy} {plan(cost, turn, policy)!r}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=2000)
    parser.add_argument("--dump", help="write every plan of --turns random turns x every policy here instead")
    args = parser.parse_args()
    if args.dump:
        dump(args.dump, args.turns)
    else:
        print(json.dumps(timings(args.turns) | views_timings(min(args.turns, 500)), indent=1))


if __name__ == "__main__":
    main()
