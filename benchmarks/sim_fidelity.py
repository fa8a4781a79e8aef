"""How closely the fleet simulator reproduces a measured multi-turn run: same workload, same policies, two replicas.

    python -m benchmarks.sim_fidelity --real benchmarks/results/multi_turn_avx2.json --profile cpu-smollm2 \\
        --out benchmarks/results/sim_fidelity.json

For each real `benchmarks.multi_turn` result (its JSON records the workload it ran), the fleet study serves the
same workload (conversations, turns, prompt and reply lengths, concurrency, rounds) on two modelled replicas of the
profile (measured on the same kind of machine by `benchmarks.sim_profile`) under each policy the real run measured,
and compares TTFT p50 and p90 per policy. Order of policies: for every pair the real run separates by more than
10% at p50, whether the simulation orders them the same way (`rank_agreement`: the share that it does).
"""

from __future__ import annotations

import argparse
import json
from itertools import combinations
from pathlib import Path
from typing import Any

from benchmarks.common import write_result
from benchmarks.fleet import summarize
from benchmarks.fleet_sim import Fleet
from benchmarks.fleet_workloads import from_bench_config
from benchmarks.multi_turn_workload import BenchConfig
from kvtransfer.sim.profile import load_profile

SEPARATED = 0.10  # real p50s further apart than this must keep their order in the simulation


def simulate(profile_name: str, real: dict[str, Any], seed: int) -> dict[str, dict[str, float]]:
    config = BenchConfig.model_validate({k: v for k, v in real["config"].items() if k != "sharegpt"})
    profile = load_profile(profile_name)
    workload = from_bench_config("real", config)
    out = {}
    for policy in real["policies"]:
        records, duration = [], 0.0
        for r in range(config.rounds):  # the real run served fresh conversations each round (seed + round)
            result = Fleet(profile, config.num_replicas, policy, seed=config.seed + r + seed).run(workload)
            records += result.records
            duration += result.duration_s
        result.records, result.duration_s = records, duration
        out[policy] = summarize(result, slo_ms=1000.0)["ttft_ms"]
    return out


def compare(real: dict[str, Any], sim: dict[str, dict[str, float]]) -> dict[str, Any]:
    policies = {}
    for policy, measured in real["policies"].items():
        r, s = measured["ttft_ms"], sim[policy]
        policies[policy] = {"real_p50": r["p50"], "sim_p50": s["p50"], "real_p90": r["p90"], "sim_p90": s["p90"],
                            "p50_error": round(abs(s["p50"] - r["p50"]) / r["p50"], 3),
                            "p90_error": round(abs(s["p90"] - r["p90"]) / r["p90"], 3)}
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
    workloads = {}
    for path in args.real.split(","):
        real = json.loads(Path(path).read_text())
        workloads[Path(path).stem] = compare(real, simulate(args.profile, real, args.seed)) | {
            "real_file": path, "real_machine": (real.get("provenance") or {}).get("machine") or real.get("machine")}
    every = [p for w in workloads.values() for p in w["policies"].values()]
    pairs = sum(w["separated_pairs"] for w in workloads.values())
    result = {"profile": args.profile, "workloads": workloads,
              "max_p50_error": max(p["p50_error"] for p in every), "max_p90_error": max(p["p90_error"] for p in every),
              "rank_agreement": round(sum(w["agreeing_pairs"] for w in workloads.values()) / pairs, 3) if pairs
              else None}
    write_result(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "workloads"}, indent=1))
    for name, w in workloads.items():
        for policy, p in w["policies"].items():
            print(f"{name:28s} {policy:16s} p50 real {p['real_p50']:8.0f} sim {p['sim_p50']:8.0f}   "
                  f"p90 real {p['real_p90']:8.0f} sim {p['sim_p90']:8.0f}")


if __name__ == "__main__":
    main()
