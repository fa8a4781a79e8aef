"""docs/benchmarks.md's fleet-simulation sections and the README's fleet table, from benchmarks/results/fleet*.json
(written by `python -m benchmarks.fleet`)."""

from __future__ import annotations

from typing import Any

from benchmarks.report_format import Results, best_other, fmt, pct, table


def fleet_table(data: dict[str, Any]) -> list[str]:
    rows = []
    for workload, figures in (data.get("workloads") or {}).items():
        for policy, p in (figures.get("policies") or {}).items():
            ttft = p.get("ttft_ms") or {}
            rows.append([workload, policy, ttft.get("p50"), ttft.get("p90"), ttft.get("p99"), p.get("goodput_rps"),
                         p.get("pulls"), pct(p.get("reused_token_share"))])
    return table(["workload", "policy", "TTFT p50 (ms)", "p90", "p99", "goodput (req/s)", "pulls", "reused tokens"],
                 rows, right_from=2)


def render_fleet(results: Results) -> list[str]:
    data = results["fleet.json"]
    head = [f"Profile `{data.get('profile', '?')}`, {fmt(data.get('replicas'))} replicas, topology "
            f"`{data.get('topology', '?')}`.", ""]
    return head + fleet_table(data)


def render_fleet_pd(results: Results) -> list[str]:
    lines = []
    for name in ("fleet_pd_pr32553.json", "fleet_pd.json"):
        if name in results:
            data = results[name]
            lines += [f"`{name}`: profile `{data.get('profile', '?')}`, {fmt(data.get('replicas'))} replicas "
                      "(half prefill, half decode), prefix caching off on the prefill side.", ""]
            lines += fleet_table(data) + [""]
    return lines


def render_sensitivity(results: Results) -> list[str]:
    data = results["fleet_sensitivity.json"]
    grid = data["grid"]
    bws = sorted({g["pull_gb_s"] for g in grid})
    def cell(s: float, b: float) -> str:
        g = next(g for g in grid if g["prefill_speed_x"] == s and g["pull_gb_s"] == b)
        return f"{g['gain']:.2f}x / {g.get('gain_over_session', float('nan')):.2f}x ({g.get('kvrelay_pulls', 0)})"

    rows = [[f"{s:g}x"] + [cell(s, b) for b in bws] for s in sorted({g["prefill_speed_x"] for g in grid})]
    return [f"kvrelay's TTFT p50 gain over prefix_affinity / over session affinity, and its pulls in brackets "
            f"(modelled: profile `{data['profile']}`, {data['replicas']} replicas, workload `{data['workload']}`, "
            f"{fmt(data.get('load'))}x its users per replica, {fmt(data.get('fixed_handover_ms'))} ms of fixed "
            "handover per pull), by prefill speed (rows, against the profile's) and pull bandwidth in GB/s "
            "(columns); plot `fleet_sensitivity.png`.", ""] + table(
        ["prefill speed", *[f"{b:g} GB/s" for b in bws]], rows)


def fleet_summary(results: Results) -> list[str]:
    """The README's fleet table: kvrelay against the best other policy per workload, and P/D pull-back."""
    data = results.get("fleet.json")
    if not data:
        return ["No fleet results in benchmarks/results/ yet."]
    rows = []
    for workload, figures in data["workloads"].items():
        policies = figures["policies"]
        kv = policies.get("kvrelay", {}).get("ttft_ms", {})
        b50, b90 = best_other(policies, "p50"), best_other(policies, "p90")
        if not kv or not b50 or not b90:
            continue
        rows.append([workload, f"{fmt(kv['p50'], 0)} / {fmt(kv['p90'], 0)}",
                     f"{fmt(b50[1], 0)} ({b50[0]}) / {fmt(b90[1], 0)} ({b90[0]})",
                     f"{b50[1] / kv['p50']:.2f}x / {b90[1] / kv['p90']:.2f}x",
                     f"{policies['round_robin']['ttft_ms']['p50'] / kv['p50']:.2f}x" if "round_robin" in policies
                     else None])
    lines = [f"Modelled, not measured: profile `{data['profile']}`, {data['replicas']} replicas, "
             f"{fmt(data.get('load'))}x the workload files' users per replica (`benchmarks/results/fleet.json`).", ""]
    lines += table(["workload", "kvrelay p50 / p90 (ms)", "best other p50 / p90 (ms)",
                    "kvrelay's gain p50 / p90", "gain over round robin p50"], rows)
    pd = results.get("fleet_pd_pr32553.json")
    if pd:
        policies = pd["workloads"]["pr32553"]["policies"]
        pull, recompute = policies["kvrelay"]["ttft_ms"]["p50"], policies["recompute"]["ttft_ms"]["p50"]
        lines += ["", f"P/D, vLLM PR #32553's workload on profile `{pd['profile']}`: pull-back TTFT p50 "
                      f"{fmt(pull, 0)} ms against {fmt(recompute, 0)} recomputing, {recompute / pull:.2f}x (the PR "
                      "measured 219.6 against 958.6 ms, 4.37x; `benchmarks/results/fleet_pd_pr32553.json`)."]
    return lines



def render_sim_fidelity(results: Results) -> list[str]:
    """The simulated against the measured TTFT per workload and policy, with the first/later-turn split that shows
    which part of the model misses (`python -m benchmarks.sim_fidelity`)."""
    data = results["sim_fidelity.json"]
    targets = data.get("targets") or {}
    head = [f"Profile `{data.get('profile', '?')}` ({data.get('profile_dtype') or 'dtype not recorded'}). "
            + "; ".join(f"{k.replace('_', ' ')} {fmt(data.get(k), 3)} (target {fmt(t.get('target'), 2)}: "
                        f"{'met' if t.get('met') else 'missed'})" for k, t in targets.items()) + ".", ""]
    rows = []
    for workload, w in (data.get("workloads") or {}).items():
        for policy, p in (w.get("policies") or {}).items():
            kinds = p.get("by_turn_kind") or {}
            first, later = kinds.get("first_turns") or {}, kinds.get("later_turns") or {}
            real_run = f"`{(w.get('real_commit') or '?')[:7]}` {str(w.get('real_date') or '?')[:10]}"
            rows.append([workload, real_run, policy, f"{fmt(p.get('real_p50'), 0)} / {fmt(p.get('sim_p50'), 0)}",
                         pct(p.get("p50_error")), f"{fmt(p.get('real_p90'), 0)} / {fmt(p.get('sim_p90'), 0)}",
                         pct(p.get("p90_error")),
                         f"{fmt(first.get('real_p50'), 0)} / {fmt(first.get('sim_p50'), 0)}",
                         f"{fmt(later.get('real_p50'), 0)} / {fmt(later.get('sim_p50'), 0)}",
                         " / ".join(fmt((later.get("tpot_ms_p50") or {}).get(k), 0) for k in ("real", "sim")),
                         " / ".join(pct((later.get("reused_under_half") or {}).get(k)) for k in ("real", "sim"))])
    return head + table(["workload", "real run", "policy", "TTFT p50 real / sim (ms)", "error", "p90 real / sim",
                         "error", "first turns p50", "later turns p50", "later TPOT p50",
                         "later turns away from history"], rows, right_from=3)
