"""Where a policy's turns land by tenant, in the fleet study (modelled, not measured): TTFT of the hot tenant's
conversations (those starting with its long system prompt) and the others' first and later turns, each replica's
share of the hot conversations' turns, and how many of their first turns computed that prompt.

    python -m benchmarks.fleet_tenants --out benchmarks/results/fleet_tenants.json

Same fleet, workload and seed as `python -m benchmarks.fleet` (`hot_tenant`, profile `h100-llama-3.1-8b`, 16 replicas,
4x load), so its totals equal that run's; this splits them. docs/design.md reads it for why kvrelay's p50 there trails
session affinity's.
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

from benchmarks.common import write_result
from benchmarks.fleet import percentile, run_policy
from benchmarks.fleet_turns import FleetResult
from benchmarks.fleet_workloads import conversations, load_workload
from kvtransfer.sim.profile import load_profile


def split(result: FleetResult, hot_ids: set[str], prompt_cached_tokens: int) -> dict[str, Any]:
    """`prompt_cached_tokens`: what a hot first turn reuses where the hot system prompt is cached (its full blocks)."""
    groups: dict[str, list[float]] = {}
    hot_turns: Counter = Counter()
    prompt_computed = 0  # hot first turns that found less than the hot system prompt cached where they ran
    for r in result.records:
        hot = r.conv_id in hot_ids
        hot_turns[r.replica] += hot
        groups.setdefault(f"{'hot' if hot else 'other'}_{'first' if r.turn == 0 else 'later'}", []).append(r.ttft_ms)
        prompt_computed += hot and r.turn == 0 and r.reused_tokens < prompt_cached_tokens
    return {
        "ttft_ms": {name: {"turns": len(v), "p50": round(percentile(v, 0.5), 1), "p90": round(percentile(v, 0.9), 1)}
                    for name, v in sorted(groups.items())},
        "hot_share_by_replica": sorted(round(hot_turns[rep] / n, 3)
                                       for rep, n in result.requests_per_replica.items() if n),
        "hot_first_turns_computing_the_prompt": prompt_computed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="h100-llama-3.1-8b")
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--load", type=float, default=4.0)
    parser.add_argument("--workload", default="hot_tenant")
    parser.add_argument("--policies", default="session,kvrelay")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    profile = load_profile(args.profile)
    workload = load_workload(args.workload).scaled(args.replicas, args.load)
    hot_ids = {c.conv_id for c in conversations(workload, args.seed) if c.hot}
    policies = {}
    for policy in args.policies.split(","):
        summary, result = run_policy(profile, args.replicas, policy, args.workload, "aggregated", args.seed, 1000.0,
                                     args.load)
        prompt_cached = workload.hot_tenant_system_tokens // profile.block_size * profile.block_size
        policies[policy] = {"ttft_ms": summary["ttft_ms"]} | split(result, hot_ids, prompt_cached)
        print(policy, policies[policy], flush=True)
    write_result(args.out, {"what": "modelled, not measured", "profile": args.profile, "replicas": args.replicas,
                            "load": args.load, "workload": args.workload, "policies": policies})


if __name__ == "__main__":
    main()
