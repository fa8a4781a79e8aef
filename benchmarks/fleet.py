"""Fleet study in virtual time: kvrelay's planner against the routers users would run, on N modelled replicas.

    python -m benchmarks.fleet --profile h100-llama-3.1-8b --replicas 16 --workload all \\
        --policies round_robin,session,prefix_affinity,fixed_threshold,kvrelay --out benchmarks/results/fleet.json
    python -m benchmarks.fleet --profile h100-llama-3.3-70b-tp4 --replicas 16 --topology disaggregated \\
        --workload long_history --policies kvrelay,recompute --out benchmarks/results/fleet_pd.json
    python -m benchmarks.fleet --sensitivity --out benchmarks/results/fleet_sensitivity.json

Every figure is modelled (`kvtransfer/sim`, profiles in `configs/profiles/`), not measured. Each policy serves the
same conversations (same seed) on a fresh fleet, calibrated as the app calibrates at start-up. Writes the JSON
(with provenance), a markdown table beside it, and a TTFT plot per workload. Under `--topology disaggregated` the
policies are `kvrelay` (the planner, pulling each turn's history back from the decode replica that holds it) and
`recompute` (every turn recomputed on the least busy prefill replica: vLLM PR #32553's baseline).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.common import write_result
from benchmarks.fleet_sim import Fleet
from benchmarks.fleet_turns import FleetResult
from benchmarks.fleet_workloads import MULTI_TURN, load_workload
from kvtransfer.sim.profile import EngineProfile, Link, load_profile

POLICIES = ("round_robin", "session", "prefix_affinity", "fixed_threshold", "kvrelay")
# `all`: the real benchmark's four and the fleet's own; `pr32553` (vLLM PR #32553's P/D run) is named when wanted.
WORKLOADS = (*MULTI_TURN, "trace", "bursts", "hot_tenant", "long_context")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _quantiles(ttfts: list[float]) -> dict[str, float]:
    return {"turns": len(ttfts), "p50": round(percentile(ttfts, 0.5), 1), "p90": round(percentile(ttfts, 0.9), 1),
            "p99": round(percentile(ttfts, 0.99), 1)}


def summarize(result: FleetResult, slo_ms: float) -> dict[str, Any]:
    ttfts = [r.ttft_ms for r in result.records]
    prompt = sum(r.prompt_tokens for r in result.records)
    per_replica = result.requests_per_replica
    return {
        "turns": len(ttfts),
        "ttft_ms": {"p50": round(percentile(ttfts, 0.5), 1), "p90": round(percentile(ttfts, 0.9), 1),
                    "p99": round(percentile(ttfts, 0.99), 1), "mean": round(statistics.fmean(ttfts), 1)},
        # A conversation's first turn (its prompt's shared prefix at most cached) and its later turns (its history).
        "ttft_ms_by_turn": {"first": _quantiles([r.ttft_ms for r in result.records if r.turn == 0]),
                            "later": _quantiles([r.ttft_ms for r in result.records if r.turn > 0])},
        "goodput_rps": round(sum(1 for t in ttfts if t <= slo_ms) / result.duration_s, 3),
        "pulls": result.counters["pulls"],
        "pulled_gb": round(result.counters["pulled_bytes"] / 1e9, 2),
        "reused_token_share": round(sum(r.reused_tokens for r in result.records) / prompt, 4) if prompt else 0.0,
        "modes": {m: sum(1 for r in result.records if r.mode == m) for m in ("local", "pull", "recompute")},
        "requests_per_replica": {"min": min(per_replica.values(), default=0),
                                 "max": max(per_replica.values(), default=0)},
        "virtual_s": round(result.duration_s, 1),
    }


def run_policy(profile: EngineProfile, replicas: int, policy: str, workload_name: str, topology: str,
               seed: int, slo_ms: float, load: float = 1.0) -> tuple[dict[str, Any], FleetResult]:
    workload = load_workload(workload_name).scaled(replicas, load)
    baseline = policy == "recompute"
    fleet = Fleet(profile, replicas, "round_robin" if baseline else policy, seed, topology,
                  prefill_prefix_caching=topology != "disaggregated", recompute_baseline=baseline)
    started = time.perf_counter()
    result = fleet.run(workload)
    summary = summarize(result, slo_ms) | {"wall_s": round(time.perf_counter() - started, 1)}
    return summary, result


def plot(out: Path, workload: str, results: dict[str, FleetResult]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for policy, result in results.items():
        ttfts = sorted(r.ttft_ms for r in result.records)
        ax.plot(ttfts, [i / len(ttfts) for i in range(len(ttfts))], label=policy)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, modelled)")
    ax.set_ylabel("share of turns")
    ax.set_title(f"{workload}: TTFT distribution")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_name(f"{out.stem}_{workload}.png"), dpi=90)
    plt.close(fig)


def markdown(data: dict[str, Any]) -> str:
    lines = [f"Modelled with profile `{data['profile']}`, {data['replicas']} replicas, topology `{data['topology']}`, "
             f"SLO {data['slo_ms']:.0f} ms.", "",
             "| workload | policy | TTFT p50 | p90 | p99 | goodput (req/s) | pulls | reused tokens "
             "| requests/replica |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, w in data["workloads"].items():
        for policy, p in w["policies"].items():
            t = p["ttft_ms"]
            lines.append(f"| {name} | {policy} | {t['p50']:.0f} | {t['p90']:.0f} | {t['p99']:.0f} | "
                         f"{p['goodput_rps']:.2f} | {p['pulls']} | {p['reused_token_share']:.1%} | "
                         f"{p['requests_per_replica']['min']}-{p['requests_per_replica']['max']} |")
    return "\n".join(lines) + "\n"


def sensitivity(base: EngineProfile, replicas: int, workload: str, seed: int, slo_ms: float, load: float,
                bandwidths: list[float], prefill_scales: list[float]) -> dict[str, Any]:
    """kvrelay's p50 gain over prefix affinity (and over session affinity, the best other router on this fleet)
    across pull bandwidth x prefill speed (the profile's compute scaled)."""
    grid = []
    for scale in prefill_scales:
        for gb_s in bandwidths:
            profile = base.model_copy(update={
                "prefill_ms_per_token": base.prefill_ms_per_token / scale,
                "prefill_ms_per_ktoken_ctx": base.prefill_ms_per_ktoken_ctx / scale,
                "same_node": Link(fixed_ms=base.same_node.fixed_ms, gb_s=gb_s),
                "other_node": Link(fixed_ms=base.other_node.fixed_ms, gb_s=gb_s)})
            runs = {p: run_policy(profile, replicas, p, workload, "aggregated", seed, slo_ms, load)[0]
                    for p in ("kvrelay", "prefix_affinity", "session")}
            p50 = {p: r["ttft_ms"]["p50"] for p, r in runs.items()}
            grid.append({"prefill_speed_x": scale, "pull_gb_s": gb_s, "kvrelay_p50": p50["kvrelay"],
                         "prefix_affinity_p50": p50["prefix_affinity"], "session_p50": p50["session"],
                         "kvrelay_pulls": runs["kvrelay"]["pulls"],
                         "gain": round(p50["prefix_affinity"] / p50["kvrelay"], 3),
                         "gain_over_session": round(p50["session"] / p50["kvrelay"], 3)})
            print(f"prefill x{scale} pull {gb_s} GB/s: gain {grid[-1]['gain']} "
                  f"(over session {grid[-1]['gain_over_session']}), {grid[-1]['kvrelay_pulls']} pulls", flush=True)
    return {"profile": base.name, "replicas": replicas, "workload": workload, "load": load,
            "fixed_handover_ms": base.other_node.fixed_ms, "grid": grid}


def plot_sensitivity(out: Path, data: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scales = sorted({g["prefill_speed_x"] for g in data["grid"]})
    bws = sorted({g["pull_gb_s"] for g in data["grid"]})
    gain = [[next(g["gain"] for g in data["grid"] if g["prefill_speed_x"] == s and g["pull_gb_s"] == b)
             for b in bws] for s in scales]
    fig, ax = plt.subplots(figsize=(7, 4))
    flat = [g for row in gain for g in row]
    im = ax.imshow(gain, origin="lower", aspect="auto", cmap="RdYlGn", vmin=min(1.0, *flat), vmax=max(1.0, *flat))
    pulls = [[next(g["kvrelay_pulls"] for g in data["grid"] if g["prefill_speed_x"] == s and g["pull_gb_s"] == b)
              for b in bws] for s in scales]
    for i, row in enumerate(pulls):
        for j, n in enumerate(row):
            ax.text(j, i, f"{gain[i][j]:.2f}\n{n} pulls", ha="center", va="center", fontsize=7)
    # Where kvrelay starts pulling: left of the line pulls do not pay and it runs as an affinity router.
    ax.contour([[1.0 if n else 0.0 for n in row] for row in pulls], levels=[0.5], colors="black")
    ax.set_xticks(range(len(bws)), [f"{b:g}" for b in bws])
    ax.set_yticks(range(len(scales)), [f"{s:g}x" for s in scales])
    ax.set_xlabel("pull bandwidth (GB/s)")
    ax.set_ylabel("prefill speed vs profile")
    ax.set_title(f"kvrelay's p50 gain over prefix affinity\n(modelled: {data['profile']}, {data['workload']})")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=90)
    plt.close(fig)


def policy_runs(
    runs: list[tuple[str, str]], jobs: int, profile: EngineProfile, replicas: int, topology: str, seed: int,
    slo_ms: float, load: float,
) -> Iterator[tuple[dict[str, Any], FleetResult]]:
    """`run_policy`'s result for each (workload, policy) of `runs`, in that order. With `jobs` > 1 they run in that many
    processes at once (each run is deterministic), prefix affinity's first: they are the longest (one replica's queue
    holds every turn)."""
    args = (topology, seed, slo_ms, load)
    if jobs <= 1:
        for workload, policy in runs:
            yield run_policy(profile, replicas, policy, workload, *args)
        return
    with ProcessPoolExecutor(jobs) as pool:
        pending = {(workload, policy): pool.submit(run_policy, profile, replicas, policy, workload, *args)
                   for workload, policy in sorted(runs, key=lambda run: run[1] != "prefix_affinity")}
        for run in runs:
            yield pending[run].result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="h100-llama-3.1-8b")
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--workload", default="all",
                        help=f"comma-separated names of benchmarks/configs/ files, or all: {', '.join(WORKLOADS)}")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--topology", choices=("aggregated", "disaggregated"), default="aggregated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ms", type=float, default=1000.0)
    parser.add_argument("--load", type=float, default=1.0,
                        help="users per replica as a multiple of the workload file's (sized for two CPU replicas)")
    parser.add_argument("--sensitivity", action="store_true",
                        help="sweep pull bandwidth x prefill speed for kvrelay vs prefix_affinity instead")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/fleet.json"))
    parser.add_argument("--jobs", type=int, default=1,
                        help="(workload, policy) runs at once, each in a process of its own (each is deterministic)")
    args = parser.parse_args()
    profile = load_profile(args.profile)
    if args.sensitivity:
        workload = args.workload if args.workload != "all" else "long_history"
        data = sensitivity(profile, args.replicas, workload, args.seed, args.slo_ms, args.load,
                           [1, 3, 10, 30, 100], [0.25, 0.5, 1, 2, 4])
        write_result(args.out, data)
        plot_sensitivity(args.out, data)
        return
    workloads = list(WORKLOADS) if args.workload == "all" else args.workload.split(",")
    data: dict[str, Any] = {"profile": profile.name, "replicas": args.replicas, "topology": args.topology,
                            "slo_ms": args.slo_ms, "seed": args.seed, "load": args.load, "modelled": True,
                            "workloads": {}}
    names = args.policies.split(",")
    done = policy_runs([(name, policy) for name in workloads for policy in names], args.jobs, profile, args.replicas,
                       args.topology, args.seed, args.slo_ms, args.load)
    for name in workloads:
        results: dict[str, FleetResult] = {}
        policies: dict[str, Any] = {}
        for policy in names:
            policies[policy], results[policy] = next(done)
            t = policies[policy]["ttft_ms"]
            print(f"{name:14s} {policy:16s} p50 {t['p50']:8.1f}  p90 {t['p90']:8.1f}  p99 {t['p99']:8.1f}  "
                  f"goodput {policies[policy]['goodput_rps']:.2f}/s  pulls {policies[policy]['pulls']}", flush=True)
        data["workloads"][name] = {"policies": policies}
        plot(args.out, name, results)
    write_result(args.out, data)
    args.out.with_suffix(".md").write_text(markdown(data))


if __name__ == "__main__":
    main()
