"""How closely the fleet simulator reproduces a measured multi-turn run: its conversations, policies and replicas.

    python -m benchmarks.sim_fidelity --real benchmarks/results/multi_turn.json --profile cpu-smollm2 \\
        --out benchmarks/results/sim_fidelity.json

For each real `benchmarks.multi_turn` result, the fleet study serves the conversations that run served (each turn's
prompt and reply length as its records give them, in the order its clients took them, with its arrivals and think
time) on the real run's number of modelled replicas of the profile (measured on the same kind of machine by
`benchmarks.sim_profile`), with the real run's KV cache size, under each policy the real run measured, and compares
TTFT p50 and p90 per policy. Order of policies: for every pair the real run separates by more than 10% at p50,
whether the simulation orders them the same way (`rank_agreement`: the share that it does).

Per policy, `by_turn_kind` splits first turns (a cold prefill of the conversation's prefix) from later ones (a short
new message after a history that may be cached) and compares them request by request (`sim_over_real_p50`: the
median of sim/real TTFT over the same turns), with the new tokens each computed and their TPOT: where the two
disagree, this says which part of the engine model misses.

The profile must model the engine the real run ran: a profile measured in another dtype is refused.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable
from itertools import combinations, pairwise
from pathlib import Path
from typing import Any

from benchmarks.common import write_result
from benchmarks.fleet_sim import Fleet
from benchmarks.fleet_workloads import Conversation, Turn, from_bench_config
from benchmarks.multi_turn_results import percentile
from benchmarks.multi_turn_workload import BenchConfig
from configs.engine import EngineConfig
from configs.models import DEFAULT_MODEL
from kvtransfer.sim.profile import EngineProfile, load_profile

SEPARATED = 0.10  # real p50s further apart than this must keep their order in the simulation
TARGETS = {"max_p50_error": 0.15, "max_p90_error": 0.25, "rank_agreement": 1.0}
KINDS: dict[str, Callable[[int], bool]] = {"first_turns": lambda turn: turn == 0, "later_turns": lambda turn: turn > 0}
Key = tuple[int, str, int]  # (round, conversation, turn)


def recorded_machine(data: dict[str, Any]) -> dict[str, Any]:
    """The machine a results file or profile records (in its provenance; older files at their top level)."""
    return (data.get("provenance") or {}).get("machine") or data.get("machine") or {}


def real_dtype(real: dict[str, Any]) -> tuple[str, str]:
    """The dtype the real run's engines ran and how that is known: its configured one, else the engine's choice on
    its machine; a file whose machine does not record bf16 support ran the model's recommended dtype (what engines
    ran on every CPU before they looked, and run on a CPU with native bf16)."""
    config = real["config"]
    machine = recorded_machine(real)
    engine = EngineConfig(model=config.get("model") or DEFAULT_MODEL, **{
        k: v for k, v in config.get("engine", {}).items() if k in EngineConfig.model_fields})
    if engine.dtype is not None:
        return engine.dtype, "configured"
    if "native_bf16" in machine:
        return engine.engine_dtype(machine["native_bf16"]), "the engine's choice on the recorded machine"
    return engine.engine_dtype(True), "the model's recommended dtype: the file does not record the CPU's bf16 support"


def profile_dtype(profile: EngineProfile) -> str | None:
    return ((profile.measurement or {}).get("engine") or {}).get("dtype")


def served_profile(profile: EngineProfile, real: dict[str, Any]) -> EngineProfile:
    """The profile with the real run's KV cache size; refuses a profile measured in another dtype or on another kind
    of CPU (where both record theirs: the two kinds this project runs on differ by several times in step time)."""
    want, have = real_dtype(real)[0], profile_dtype(profile)
    if have != want:
        raise SystemExit(f"profile {profile.name!r} was measured in {have or 'an unrecorded dtype'}, the real run's "
                         f"engines ran {want}: measure one with `python -m benchmarks.sim_profile --dtype {want}`")
    real_cpu = recorded_machine(real).get("cpu")
    profile_cpu = ((profile.provenance or {}).get("machine") or {}).get("cpu")
    if real_cpu and profile_cpu and real_cpu != profile_cpu:
        raise SystemExit(f"profile {profile.name!r} was measured on {profile_cpu!r}, the real run on {real_cpu!r}: "
                         "measure both on one kind of machine (`python -m benchmarks.sim_profile`)")
    kv_bytes = real["config"].get("engine", {}).get("kv_cache_memory_bytes")
    if kv_bytes is None:
        return profile
    return profile.model_copy(update={"kv_cache_tokens": kv_bytes // profile.kv_bytes_per_token})


def ok_records(real: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in real["requests"] if r["ok"]]


def replayed(real: dict[str, Any], config: BenchConfig, number: int) -> list[Conversation]:
    """Round `number`'s conversations as the real run served them: each turn's prompt and reply length from its
    records (every policy served the same ones), in its clients' order. Token ids stand for text, one shared system
    prompt; a later turn's new message is what its prompt adds to the previous prompt and reply."""
    rng = random.Random(config.seed + number)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, 32000) for _ in range(n)]

    served: dict[str, list[dict[str, Any]]] = defaultdict(list)
    policy = config.policies[0]
    for r in ok_records(real):
        if r["round"] == number and r["policy"] == policy:
            served[r["conv_id"]].append(r)
    system = tokens(config.system_prefix_tokens)
    first_user = (config.user_tokens.min + config.user_tokens.max) // 2
    arrivals = random.Random(config.seed)  # the real client's gaps between conversation starts (poisson)
    convs, start = [], 0.0
    for conv_id in sorted(served, key=lambda c: (len(c), c)):
        recs = sorted(served[conv_id], key=lambda r: r["turn"])
        users = [max(1, r["prompt_tokens"] - p["prompt_tokens"] - p["completion_tokens"]) for p, r in pairwise(recs)]
        own = max(0, recs[0]["prompt_tokens"] - len(system) - first_user)
        prefix = system + tokens(own)
        users.insert(0, recs[0]["prompt_tokens"] - len(prefix))
        turns = [Turn(user_tokens=tokens(u), output_tokens=tokens(r["completion_tokens"]),
                      think_s=config.think_time_s if k else 0.0)
                 for k, (u, r) in enumerate(zip(users, recs, strict=True))]
        convs.append(Conversation(conv_id=conv_id, tenant="tenant-0", prefix_tokens=prefix, turns=turns,
                                  start_s=start if config.arrival == "poisson" else None))
        start += arrivals.expovariate(config.rate)
    return convs


def simulate(profile: EngineProfile, real: dict[str, Any], seed: int) -> dict[str, dict[Key, dict[str, float]]]:
    """Per policy: (round, conversation, turn) -> the simulated turn's TTFT, TPOT, prompt and reused tokens."""
    config = BenchConfig.model_validate({k: v for k, v in real["config"].items() if k != "sharegpt"})
    workload = from_bench_config("real", config)
    out: dict[str, dict[Key, dict[str, float]]] = {}
    for policy in real["policies"]:
        out[policy] = {}
        for number in range(config.rounds):
            fleet = Fleet(profile, config.num_replicas, policy, seed=config.seed + number + seed)
            result = fleet.run(workload, replayed(real, config, number))
            for t in result.records:
                out[policy][(number, t.conv_id, t.turn)] = {
                    "ttft_ms": t.ttft_ms, "tpot_ms": fleet.tpot_ms.get((t.conv_id, t.turn)),
                    "prompt_tokens": t.prompt_tokens, "reused_tokens": t.reused_tokens}
    return out


def _p(values: list[float], q: float) -> float | None:
    return percentile([v for v in values if v is not None], q)


def _share_under_half(turns: Iterable[dict[str, Any]]) -> float | None:
    turns = list(turns)
    return round(sum(2 * t["reused_tokens"] < t["prompt_tokens"] for t in turns) / len(turns), 3) if turns else None


def by_turn_kind(real: list[dict[str, Any]], sim: dict[Key, dict[str, float]]) -> dict[str, Any]:
    """First and later turns, real against simulated, matched turn by turn."""
    out = {}
    for kind, chosen in KINDS.items():
        r = {(x["round"], x["conv_id"], x["turn"]): x for x in real if chosen(x["turn"])}
        s = {k: v for k, v in sim.items() if chosen(k[2])}
        both = sorted(r.keys() & s.keys())
        out[kind] = {
            "turns": len(r), "simulated": len(s),
            "real_p50": _p([x["ttft_ms"] for x in r.values()], 0.5),
            "sim_p50": _p([x["ttft_ms"] for x in s.values()], 0.5),
            "real_p90": _p([x["ttft_ms"] for x in r.values()], 0.9),
            "sim_p90": _p([x["ttft_ms"] for x in s.values()], 0.9),
            "sim_over_real_p50": round(statistics.median(s[k]["ttft_ms"] / r[k]["ttft_ms"] for k in both), 3)
            if both else None,
            "new_tokens_p50": {"real": _p([x["prompt_tokens"] - x["reused_tokens"] for x in r.values()], 0.5),
                               "sim": _p([x["prompt_tokens"] - x["reused_tokens"] for x in s.values()], 0.5)},
            "tpot_ms_p50": {"real": _p([x["tpot_ms"] for x in r.values()], 0.5),
                            "sim": _p([x["tpot_ms"] for x in s.values()], 0.5)},
            # Turns that found less than half their prompt cached where they ran (a later turn away from its history).
            "reused_under_half": {"real": _share_under_half(r.values()), "sim": _share_under_half(s.values())},
        }
    return out


def compare(real: dict[str, Any], sim: dict[str, dict[Key, dict[str, float]]]) -> dict[str, Any]:
    policies = {}
    for policy, measured in real["policies"].items():
        r, s = measured["ttft_ms"], [x["ttft_ms"] for x in sim[policy].values()]
        sim_p50, sim_p90 = _p(s, 0.5), _p(s, 0.9)
        policies[policy] = {"real_p50": r["p50"], "sim_p50": sim_p50, "real_p90": r["p90"], "sim_p90": sim_p90,
                            "p50_error": round(abs(sim_p50 - r["p50"]) / r["p50"], 3),
                            "p90_error": round(abs(sim_p90 - r["p90"]) / r["p90"], 3),
                            "by_turn_kind": by_turn_kind([x for x in ok_records(real) if x["policy"] == policy],
                                                         sim[policy])}
    pairs = [(a, b) for a, b in combinations(policies, 2)
             if abs(policies[a]["real_p50"] - policies[b]["real_p50"]) > SEPARATED * min(
                 policies[a]["real_p50"], policies[b]["real_p50"])]
    agree = [(a, b) for a, b in pairs if (policies[a]["real_p50"] < policies[b]["real_p50"])
             == (policies[a]["sim_p50"] < policies[b]["sim_p50"])]
    return {"policies": policies, "separated_pairs": len(pairs), "agreeing_pairs": len(agree)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--real", required=True, help="comma-separated benchmarks.multi_turn result files")
    parser.add_argument("--profile", default="cpu-smollm2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/sim_fidelity.json"))
    args = parser.parse_args()
    profile = load_profile(args.profile)
    workloads = {}
    for path in args.real.split(","):
        real = json.loads(Path(path).read_text())
        provenance = real.get("provenance") or {}
        workloads[Path(path).stem] = compare(real, simulate(served_profile(profile, real), real, args.seed)) | {
            "real_file": path, "real_commit": provenance.get("commit"), "real_date": provenance.get("date"),
            "real_machine": recorded_machine(real) or None,
            "real_dtype": dict(zip(("dtype", "from"), real_dtype(real), strict=True))}
    every = [p for w in workloads.values() for p in w["policies"].values()]
    pairs = sum(w["separated_pairs"] for w in workloads.values())
    result = {"profile": args.profile, "profile_dtype": profile_dtype(profile), "workloads": workloads,
              "max_p50_error": max(p["p50_error"] for p in every), "max_p90_error": max(p["p90_error"] for p in every),
              "rank_agreement": round(sum(w["agreeing_pairs"] for w in workloads.values()) / pairs, 3) if pairs
              else None}
    result["targets"] = {k: {"target": v, "met": result[k] is None or (
        result[k] >= v if k == "rank_agreement" else result[k] <= v)} for k, v in TARGETS.items()}
    write_result(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "workloads"}, indent=1))
    for name, w in workloads.items():
        for policy, p in w["policies"].items():
            print(f"{name:28s} {policy:16s} p50 real {p['real_p50']:8.0f} sim {p['sim_p50']:8.0f}   "
                  f"p90 real {p['real_p90']:8.0f} sim {p['sim_p90']:8.0f}")
            for kind, k in p["by_turn_kind"].items():
                print(f"{'':28s}   {kind:13s} p50 real {k['real_p50']:8.0f} sim {k['sim_p50']:8.0f}   "
                      f"p90 real {k['real_p90']:8.0f} sim {k['sim_p90']:8.0f}   sim/real {k['sim_over_real_p50']}"
                      f"   tpot {k['tpot_ms_p50']}")


if __name__ == "__main__":
    main()
