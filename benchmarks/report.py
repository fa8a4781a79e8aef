"""Writes docs/benchmarks.md, and the results table in README.md, from the canonical results in benchmarks/results/.

    python -m benchmarks.report

Every figure in docs/benchmarks.md comes from a results JSON, with that file's provenance (commit, command, date,
machine). A file that is missing renders as "not measured yet" rather than failing. To add a benchmark: write a
function that turns its JSON into markdown lines and add a `Section` naming the file to SECTIONS.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT, RESULTS_DIR

DOC = REPO_ROOT / "docs" / "benchmarks.md"
README = REPO_ROOT / "README.md"
COMMAND = "python -m benchmarks.report"

Results = dict[str, dict[str, Any]]


@dataclass(frozen=True)
class Section:
    """One part of docs/benchmarks.md: the results files it reads and how it renders those that exist."""

    title: str
    files: tuple[str, ...]
    about: str
    render: Callable[[Results], list[str]]


def load(results_dir: Path = RESULTS_DIR) -> Results:
    """Every results JSON in `results_dir` by file name; unreadable files are left out."""
    loaded: Results = {}
    for path in sorted(results_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            loaded[path.name] = data
    return loaded


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        # Small figures (cores, ratios, sub-millisecond times) keep three significant digits.
        return f"{value:.3g}" if abs(value) < 1 else f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.0f}%"


def table(header: list[str], rows: list[list[Any]], right_from: int = 1) -> list[str]:
    align = ["---" if i < right_from else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(fmt(cell) for cell in row) + " |" for row in rows]
    return lines


def machine_text(machine: Any) -> str:
    if not isinstance(machine, dict):
        return str(machine) if machine else "not recorded"
    parts = [str(machine["cpu"])] if machine.get("cpu") else []
    if machine.get("cpus"):
        parts.append(f"{machine['cpus']} cores")
    if machine.get("simd_flags"):
        parts.append("/".join(f for f in machine["simd_flags"] if f.startswith(("avx512f", "avx2", "amx_tile"))
                              ) or ", ".join(machine["simd_flags"][:3]))
    return ", ".join(parts) or "not recorded"


def provenance_line(name: str, data: dict[str, Any]) -> str:
    prov = data.get("provenance") or {}
    commit = str(prov.get("commit", "unknown"))[:10]
    dirty = prov.get("dirty")
    state = " (uncommitted changes)" if dirty is True else "" if dirty is False else ""
    when = str(prov.get("date", "unknown"))[:10]
    rebuilt = " Provenance rebuilt from git history." if prov.get("reconstructed") else ""
    # A run saved under an earlier name is rerun with this file as its --out (the JSON keeps the command as run).
    command = re.sub(r"--out \S+", f"--out benchmarks/results/{name}", str(prov.get("command", "unknown")))
    return (f"Source: [`{name}`](../benchmarks/results/{name}) — commit `{commit}`{state}, {when}, "
            f"{machine_text(prov.get('machine'))}; command `{command}`.{rebuilt}")


def scalars(data: dict[str, Any], prefix: str = "") -> list[list[Any]]:
    """Every number, string or flag in `data` as (dotted key, value), provenance left out: the fallback view."""
    rows: list[list[Any]] = []
    for key, value in data.items():
        if key == "provenance":
            continue
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            rows += scalars(value, name + ".")
        elif not isinstance(value, list):
            rows.append([f"`{name}`", value])
    return rows


def generic(name: str) -> Callable[[Results], list[str]]:
    def render(results: Results) -> list[str]:
        return table(["figure", "value"], scalars(results[name])[:60])
    return render


# --- fleet simulation (benchmarks/results/fleet.json) ------------------------------------------------------------

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


# --- multi-turn routing ------------------------------------------------------------------------------------------

MULTI_TURN = {
    "multi_turn.json": "quick (`--quick`)",
    "multi_turn_saturating.json": "saturating",
    "multi_turn_long_history.json": "long histories",
    "multi_turn_think_time.json": "12 s think time",
}


def best_other(policies: dict[str, Any], key: str) -> tuple[str, float] | None:
    others = [(name, p["ttft_ms"][key]) for name, p in policies.items() if name != "kvrelay"]
    return min(others, key=lambda x: x[1]) if others else None


def multi_turn_summary_rows(results: Results) -> list[list[Any]]:
    rows = []
    for name, label in MULTI_TURN.items():
        if name not in results:
            continue
        policies = results[name]["policies"]
        kv = policies.get("kvrelay", {}).get("ttft_ms", {})
        b50, b90 = best_other(policies, "p50"), best_other(policies, "p90")
        ratio = (f"{kv['p50'] / b50[1]:.2f}x / {kv['p90'] / b90[1]:.2f}x" if kv and b50 and b90 else "—")
        others = f"{fmt(b50[1], 0)} / {fmt(b90[1], 0)} ({b50[0]}{'' if b90[0] == b50[0] else ', ' + b90[0]})" \
            if b50 and b90 else "—"
        other_means = ", ".join(f"{fmt(p['ttft_ms']['mean'], 0)} ({n})" for n, p in policies.items() if n != "kvrelay")
        rows.append([label, f"{fmt(kv.get('p50'), 0)} / {fmt(kv.get('p90'), 0)}", others, ratio,
                     f"{fmt(kv.get('mean'), 0)} vs {other_means}", f"[`{name}`](benchmarks/results/{name})"])
    return rows


def multi_turn_summary(results: Results) -> list[str]:
    return table(["workload", "kvrelay TTFT p50 / p90 (ms)", "best other p50 / p90 (ms)", "kvrelay vs best other",
                  "mean (ms): kvrelay vs others", "results"], multi_turn_summary_rows(results))


def render_multi_turn(name: str) -> Callable[[Results], list[str]]:
    def render(results: Results) -> list[str]:
        data = results[name]
        config = data.get("config", {})
        lines = [f"{config.get('conversations')} conversations, concurrency {config.get('concurrency')}, think time "
                 f"{config.get('think_time_s')} s, {config.get('rounds')} round(s) per policy, serve mode "
                 f"`{data.get('serve_mode')}`.", ""]
        rows = []
        for policy, p in data["policies"].items():
            t = p["ttft_ms"]
            modes = ", ".join(f"{m} {n}" for m, n in sorted(p.get("modes", {}).items()))
            rows.append([policy, t.get("p50"), t.get("p90"), t.get("p99"), t.get("mean"),
                         p.get("tpot_ms", {}).get("p50"), p.get("requests"), pct(p.get("reused_token_share")),
                         modes, " / ".join(str(n) for n in p.get("requests_per_replica", []))])
        lines += table(["policy", "TTFT p50 (ms)", "p90", "p99", "mean", "TPOT p50 (ms)", "requests",
                        "reused tokens", "modes", "requests per replica"], rows)
        error = data["policies"].get("kvrelay", {}).get("estimate_error_mean")
        if error:
            lines += ["", "kvrelay's mean estimate error per mode: "
                      + ", ".join(f"{mode} {pct(value)}" for mode, value in error.items()) + "."]
        for plot in data.get("plots", []):
            plot_name = Path(plot).name
            if (RESULTS_DIR / plot_name).exists():
                lines += ["", f"![{plot_name}](../benchmarks/results/{plot_name})"]
        return lines
    return render


def render_aiperf(results: Results) -> list[str]:
    data = results["aiperf_multi_turn.json"]
    rows = [[policy, p["ttft_ms"]["p50"], p["ttft_ms"]["p90"], p["ttft_ms"]["p99"], p["ttft_ms"]["mean"],
             p.get("inter_token_latency_ms_p50"), p.get("requests"), p.get("errors")]
            for policy, p in data["policies"].items()]
    return [f"Driven by aiperf {data.get('driver', {}).get('aiperf', '?')}.", ""] + table(
        ["policy", "TTFT p50 (ms)", "p90", "p99", "mean", "inter-token p50 (ms)", "requests", "errors"], rows)


def render_external(results: Results) -> list[str]:
    data = results["multi_turn_external.json"]
    config = data.get("config", {})
    rows = []
    for policy, p in data["policies"].items():
        rows += [[policy, f"run {r['run']}", r["p50"], r["p90"], r.get("requests"), r.get("errors"),
                  ", ".join(f"{mode} {n}" for mode, n in r.get("modes", {}).items()),
                  " / ".join(str(n) for n in r.get("requests_per_replica", []))] for r in p["runs"]]
        rows.append([policy, "median", p["ttft_ms"]["p50"], p["ttft_ms"]["p90"], None, None, "", ""])
    lines = [f"{config.get('conversations')} conversations, concurrency {config.get('concurrency')}, driven by aiperf "
             f"{data.get('driver', {}).get('aiperf', '?')}; each policy's p50 and p90 are medians over its runs.",
             ""]
    lines += table(["policy", "run", "TTFT p50 (ms)", "p90", "requests", "errors", "modes", "requests per replica"],
                   rows, right_from=2)
    ratio = data.get("ratio_vs_prefix_affinity")
    if ratio:
        lines += ["", f"Prefix affinity's TTFT over kvrelay's: p50 {fmt(ratio['p50'])}x, p90 {fmt(ratio['p90'])}x "
                      f"(target at least 0.97x: {'met' if data.get('target_met') else 'not met'})."]
    keys = ("turns", "kvrelay_ttft_ms_sum", "prefix_affinity_ttft_ms_sum", "kvrelay_slower_by_10pct")
    for grouping, label, header in (("by_kvrelay_mode", "the mode it chose", "kvrelay's mode"),
                                    ("by_kvrelay_replica", "its replica", "kvrelay's replica (busiest first)")):
        totals: dict[str, list[float]] = {}
        for run in data.get("paired_turns", {}).get("runs", []):
            for group, m in run.get(grouping, {}).items():
                totals[group] = [a + m[k] for a, k in zip(totals.get(group, [0] * len(keys)), keys, strict=True)]
        if totals:
            lines += ["", f"kvrelay's turns by {label}, against prefix affinity's TTFT on the same turn, all runs:", ""]
            lines += table([header, "turns", "kvrelay TTFT sum (s)", "prefix affinity's (s)",
                            "kvrelay >10% slower"], [[group, t[0], t[1] / 1e3, t[2] / 1e3, t[3]]
                                                     for group, t in sorted(totals.items())])
    return lines


# --- single-mechanism benchmarks ---------------------------------------------------------------------------------

def render_lone(results: Results) -> list[str]:
    data = results["lone_conversation.json"]
    rows = [[t["turn"], t["mode"], t.get("reused_tokens"), t.get("predicted_ms"), t.get("ttft_ms")]
            for t in data["turns"]]
    return [f"{len(data['turns'])} turns, {data['pulls']} pulls, replicas used: {len(data['replicas_used'])}; mean "
            f"estimate error {pct(data.get('mean_abs_error_vs_measured'))}.", ""] + table(
        ["turn", "mode", "reused tokens", "estimated TTFT (ms)", "measured TTFT (ms)"], rows)


def render_crossover(results: Results) -> list[str]:
    lines = []
    if "crossover.json" in results:
        lines += [f"In sample: the planner's largest regret against the measured best option was "
                  f"{pct(results['crossover.json'].get('max_regret'))}.", ""]
    if "crossover_out_of_sample.json" in results:
        summary = results["crossover_out_of_sample.json"]["out_of_sample"]["summary"]
        lines += ["Out of sample (history/delta pairs the calibration never ran, holder idle and busy):", ""]
        lines += table(["rule", "mean regret", "max regret"],
                       [[rule, pct(s["mean_regret"]), pct(s["max_regret"])] for rule, s in summary.items()])
    if (RESULTS_DIR / "crossover.png").exists():
        lines += ["", "![crossover](../benchmarks/results/crossover.png)"]
    return lines


def render_pd(results: Results) -> list[str]:
    data = results["pd_pullback.json"]
    rows = [[mode, m["ttft_ms"]["p50"], m["ttft_ms"].get("mean"), m.get("tpot_ms", {}).get("p50"), m.get("requests"),
             ", ".join(f"{k} {v}" for k, v in sorted(m.get("modes", {}).items()))]
            for mode, m in data["modes"].items()]
    ratios = ", ".join(f"{k} {v}x" for k, v in data.get("ratios_p50", {}).items())
    return table(["mode", "TTFT p50 (ms)", "mean", "TPOT p50 (ms)", "turns", "how turns ran"], rows) + [
        "", f"p50 ratios: {ratios}."]


def render_two_nodes(results: Results) -> list[str]:
    data = results["two_nodes.json"]
    within, across = data["within_node"], data["across_nodes"]
    return table(["", "within one node", "across the link (UCX TCP)"], [
        ["pull bandwidth (GB/s, fit)", f"{within['pull_fit']['bandwidth_gb_s']:.2f}",
         f"{across['pull_fit']['bandwidth_gb_s']:.2f}"],
        ["pull fixed cost (ms, fit)", within["pull_fit"]["fixed_ms"], across["pull_fit"]["fixed_ms"]],
        ["first pull between two engines (ms)", within["handshake_ms"], across["handshake_ms"]],
        ["shortest history where pulling wins (tokens)", within["crossover_history"], across["crossover_history"]],
    ])


def render_contention(results: Results) -> list[str]:
    data = results["contention.json"]
    rows = [[f"{streams.split('_')[-1]} stream(s)",
             *[f"{v:.2f}x" for _, v in sorted(by_len.items(), key=lambda x: int(x[0]))]]
            for streams, by_len in data["slowdown"].items()]
    return table(["peer decoding", "256-token prefill", "1024-token prefill"], rows) + [
        "", f"Slowdown per busy peer: {fmt(data['calibrated']['slowdown_per_busy_peer'], 2)} at start-up calibration, "
        f"{fmt(data['fit_after']['slowdown_per_busy_peer'], 2)} fitted from {data['fit_after']['samples']} turns."]


def render_overhead(results: Results) -> list[str]:
    keys = ["ingress_added_ms_p50", "ingress_added_ms_p99", "serve_noop_http_ms_p50", "per_chunk_added_ms_p50",
            "plan_ms_p50", "plan_ms_p99", "ingress_own_before_engine_ms_p50", "ingress_own_after_engine_ms_p50"]
    names = [n for n in ("overhead.json", "overhead_default_serve.json") if n in results]
    header = ["figure (ms)"] + [f"`{n}` ({results[n].get('serve_mode', 'throughput_optimized')})" for n in names]
    return table(header, [[k] + [results[n].get(k) for n in names] for k in keys])


def render_scaling(results: Results) -> list[str]:
    data = results["scaling.json"]
    return table(["figure", "value"], [
        ["8 requests on 2 engines vs on 1", f"{data['scaling_2_vs_1']}x"],
        ["the most that spread could give (2 x one engine with 4 vs with 8)", f"{data['scaling_2_vs_1_ceiling']}x"],
        ["8 per engine on 2 engines vs 8 on 1", f"{data['scaling_2_vs_1_same_load_per_replica']}x"],
        ["idle replica, no holds (cores)", data["idle_cores_per_replica_detail"]["no_holds"]],
        ["idle replica, holds pending (cores)", data["idle_cores_per_replica_detail"]["holds_pending"]],
        ["one engine, 8 requests (tok/s)", data["throughput_1_tok_s"]],
    ])


def render_engine_priority(results: Results) -> list[str]:
    data = results["engine_priority.json"]
    arms = data["arms"]
    return table(["engines at nice", "GET /v1/models p50 (ms)", "1-token completion p50 (ms)"],
                 [[nice, arm["models_ms"]["p50"], arm["completion_ms"]["p50"]] for nice, arm in arms.items()])


def render_progress_delay(results: Results) -> list[str]:
    summary = results["progress_delay.json"]["summary"]
    rows = []
    for delay, s in summary.items():
        ttft = s["ttft_ms_median_of_apps"]
        rows.append([f"{delay} us", s["idle_cores_per_engine"],
                     *[ttft[h]["pull"] for h in sorted(ttft, key=int)]])
    return table(["NIXL progress timeout", "idle cores per engine", "pull TTFT, 256-token history (ms)",
                  "1024-token history (ms)"], rows)


def render_two_cores(results: Results) -> list[str]:
    kernels = results["two_cores.json"]["kernels"]
    return table(["kernel", "two processes at once vs one alone"],
                 [[kind, f"{k['two_vs_one']}x"] for kind, k in kernels.items()])


def render_engine(results: Results) -> list[str]:
    data = results["engine.json"]
    rows = [[tokens, v["on"], v["off"], f"{data['fast_prefill_ttft_ratio'][tokens]}x"]
            for tokens, v in data["fast_prefill_ttft_ms"].items()]
    return [f"Start {data['start_s']} s, RSS {fmt(data['rss_mib'], 0)} MiB, prefill {data['prefill_tok_s']} tok/s, "
            f"decode {data['decode_tok_s']} tok/s.", ""] + table(
        ["prompt tokens", "fast prefill on: TTFT (ms)", "off", "speed-up"], rows)


def render_cpu_dtype(results: Results) -> list[str]:
    data = results["cpu_dtype.json"]
    lengths = sorted(data["float32"]["prefill_ms"], key=int)
    return table(["dtype", *[f"prefill {n} tokens (ms)" for n in lengths], "decode (ms/token)"],
                 [[dtype, *[data[dtype]["prefill_ms"][n] for n in lengths], data[dtype]["decode_ms_per_token"]]
                  for dtype in ("float32", "bfloat16")])


def render_directory(results: Results) -> list[str]:
    data = results["directory.json"]
    keys = ["entries", "holds", "accounted_bytes_per_entry", "lookup_inproc_ops_s", "lookup_inproc_us_p50",
            "lookup_inproc_us_p99", "record_inproc_ops_s", "lookup_ray_ms_p50"]
    return table(["figure", "value"], [[f"`{k}`", data.get(k)] for k in keys if k in data])


def render_faults(results: Results) -> list[str]:
    data = results["faults.json"]
    rows = [[name.replace("_", " "), f["runs"], f["failed_turns"], f["wrong_turns"], f.get("recovery_s_max")]
            for name, f in data["faults"].items()]
    return table(["fault", "runs", "failed turns", "wrong turns", "recovery, max (s)"], rows) + [
        "", f"Background turns {fmt(data['background_turns'])}, failed {data['background_failed_turns']}, retried "
        f"{data['background_retries']}; engine processes left after shutdown: {data['leaked_processes']}."]


def render_fault_races(results: Results) -> list[str]:
    data = results["fault_races.json"]
    rows = [[name.replace("_", " "), f["runs"], f.get("plans_pull"), f.get("pulls_verified"), f.get("pulls_refused"),
             f.get("pull_failures"), f["failed_turns"], f["wrong_turns"]] for name, f in data["faults"].items()]
    usage = ", ".join(f"{v:.3f}" for v in data["kv_cache_usage_after"].values())
    return table(["race", "runs", "pulls planned", "verified", "refused", "failed pulls", "failed turns",
                  "wrong turns"], rows) + [
        "", f"Background turns {fmt(data['background_turns'])}, failed {data['background_failed_turns']}; KV cache "
        f"use per replica once the leases were over: {usage} (holds leaked: {fmt(data['leaked_holds'])})."]


def render_pull_verify(results: Results) -> list[str]:
    data = results["pull_verify.json"]
    rows = [[fmt(r["history_tokens"]), r["pulled_mib"], r["holder_digest_ms"], r["pull_ttft_ms_unchecked"],
             r["pull_ttft_ms_checked"], r["holder_ms_per_mib"], r["reader_ms_per_mib"]] for r in data["lengths"]]
    return table(["history (tokens)", "pulled (MiB)", "holder's digests (ms)", "pull TTFT unchecked (ms)",
                  "pull TTFT checked (ms)", "holder ms/MiB", "reader ms/MiB"], rows) + [
        "", f"Together {data['ms_per_pulled_mib']} ms per pulled MiB (median over pulls of 40 MiB and more), "
        f"model `{data['model']}` in {data['dtype']}."]


def render_log_budget(results: Results) -> list[str]:
    data = results["log_budget.json"]
    allowed = sum(data["allowed_warnings"].values())
    return [f"{data['requests']} multi-turn chat requests ({data['counters'].get('plans_pull', 0)} pulled) and a "
            f"SIGTERM: {fmt(data['lines_read'])} log lines, {len(data['errors'])} ERROR lines, "
            f"{len(data['unexplained_warnings'])} unexplained warnings, {allowed} allowed ones "
            f"({len(data['allowed_warnings'])} kinds, each with why in `benchmarks/log_budget.py`); within budget: "
            f"{fmt(data['within_budget'])}."]


def render_idle(results: Results) -> list[str]:
    data = results["idle.json"]
    healthy, ready = data["after_healthy"]["verdict_from_healthy"], data["after_healthy"]["verdict_from_ready"]
    burst = data["after_burst"]["verdict"]
    target = data["target"]["kvrelay_cores_at_most"]
    return table(["from", "windows", "kvrelay's processes, worst 10 s (cores)", f"at most {target}"], [
        [f"{data['target']['within_s']:g} s after healthy", healthy["windows_judged"], healthy["worst_kvrelay_cores"],
         fmt(healthy["met"])],
        [f"ready ({data['ready_after_healthy_s']:g} s after healthy: calibration done)", ready["windows_judged"],
         ready["worst_kvrelay_cores"], fmt(ready["met"])],
        [f"the last of {data['burst']['requests']} chat requests ({data['burst']['pulls']} pulled)",
         burst["windows_judged"], burst["worst_kvrelay_cores"], fmt(burst["met"])],
    ])


def render_soak(results: Results) -> list[str]:
    data = results["soak.json"]
    growth = data["growth_pct_second_half"]
    return [f"{data['minutes']:g} minutes, {data['clients']} clients, model `{data['model']}`: "
            f"{fmt(data['turns'])} turns, {data['errors']} errors. Memory growth over the second half:", ""] + table(
        ["process kind", "growth (%)"], [[k.removeprefix("rss_"), v] for k, v in growth.items()])


def render_fuzz(results: Results) -> list[str]:
    data = results["fuzz.json"]
    return [f"{fmt(data['requests'])} property-based requests to model `{data['model']}`: statuses "
            f"{', '.join(f'{k}: {v}' for k, v in data['statuses'].items())}; server errors {data['server_errors']}, "
            f"non-JSON answers {data['not_json']}; healthy with the same answer afterwards: "
            f"{fmt(data.get('healthy_and_same_answer_after'))}."]


def render_frontend(results: Results) -> list[str]:
    data = results["frontend.json"]
    history = data["long_history_render_ms_p50"]
    return table(["figure (ms, p50)", "value"], [
        ["render a 376-token chat request" if data.get("prompt_tokens") == 376 else "render a chat request",
         data["render_ms_p50"]],
        ["derender a whole short answer", data["derender_answer_ms_p50"]],
        ["derender a streamed chunk", data["derender_chunk_ms_p50"]],
        [f"render a later turn of a {fmt(data['long_history_prompt_tokens_last'])}-token conversation, reusing "
         "earlier tokens", history["reuse"]],
        ["the same, tokenizing the whole prompt", history["whole"]],
    ])


SECTIONS: list[Section] = [
    Section("Fleet simulation", ("fleet.json",),
            "Policies compared on a simulated fleet (`kvtransfer/sim`), per workload.", render_fleet),
    Section("Fleet simulation: P/D pull-back", ("fleet_pd_pr32553.json", "fleet_pd.json"),
            "Disaggregated prefill/decode on a simulated fleet: each turn's history pulled back from its decode "
            "replica (`kvrelay`) against recomputing it on the prefill side (`recompute`).", render_fleet_pd),
    Section("Fleet simulation: where pulling pays", ("fleet_sensitivity.json",),
            "The same comparison across link and compute speeds (`python -m benchmarks.fleet --sensitivity`).",
            render_sensitivity),
    Section("Simulator fidelity", ("sim_fidelity.json",),
            "How closely the fleet simulator reproduces measured runs.", generic("sim_fidelity.json")),
    Section("Control plane", ("control_plane.json",),
            "The directory's and the planner's own costs at fleet scale.", generic("control_plane.json")),
    *[Section(f"Multi-turn routing: {label}", (name,),
              "kvrelay against the routers users would otherwise run, every policy on the same two engines "
              "(`benchmarks.multi_turn`).", render_multi_turn(name)) for name, label in MULTI_TURN.items()],
    Section("Multi-turn routing driven by aiperf", ("aiperf_multi_turn.json",),
            "The quick workload's conversations sent by NVIDIA's aiperf, which times the first token itself.",
            render_aiperf),
    Section("Multi-turn routing, external-style: a fresh app per policy", ("multi_turn_external.json",),
            "kvrelay against prefix affinity as an outside user measures them: aiperf's multi-turn mode against the "
            "app as `make serve` starts it, a fresh one per policy and run (`benchmarks.multi_turn_external`).",
            render_external),
    Section("A lone conversation", ("lone_conversation.json",),
            "One conversation on an idle fleet: whether it stays with its KV, and how close the estimates are.",
            render_lone),
    Section("Pull, recompute or stay: the planner's regret", ("crossover.json", "crossover_out_of_sample.json"),
            "Every option forced on the same turns, against the one the planner picks.", render_crossover),
    Section("Prefill/decode disaggregated: pulling the history back", ("pd_pullback.json",),
            "One prefill and one decode replica; each mode of getting a turn's history to the prefill replica.",
            render_pd),
    Section("Pulls across two Ray nodes", ("two_nodes.json",),
            "Two Ray nodes joined by a veth link (UCX over TCP) against two replicas on one node.", render_two_nodes),
    Section("A prefill beside a decoding engine", ("contention.json",),
            "TTFT of forced prefills while the other engine of the node decodes, over the same prefill alone.",
            render_contention),
    Section("What the ingress adds", ("overhead.json", "overhead_default_serve.json"),
            "The same request over HTTP through the ingress and straight to an engine replica's handle, paired.",
            render_overhead),
    Section("The OpenAI front end", ("frontend.json",),
            "vLLM's parse, render and derender as the ingress runs them, in one process.", render_frontend),
    Section("What a replica costs", ("scaling.json",),
            "One replica against two under the same load, and the cores an idle replica uses.", render_scaling),
    Section("Engines below the request path", ("engine_priority.json",),
            "The request path's latency beside two busy engines at its priority and at nice 19.",
            render_engine_priority),
    Section("NIXL's progress thread", ("progress_delay.json",),
            "An idle engine's CPU and pull TTFT with NIXL's progress poll timing out after 200 us and 10 ms.",
            render_progress_delay),
    Section("Do this machine's cores share work?", ("two_cores.json",),
            "Two processes pinned to two cores against one alone, on compute-, weight- and memory-bound kernels.",
            render_two_cores),
    Section("One engine", ("engine.json",),
            "Start-up, memory and token rates of one engine replica, and fast prefill on and off.", render_engine),
    Section("bf16 or fp32 on a CPU without native bf16", ("cpu_dtype.json",),
            "One engine at a time in each dtype: prefill and decode.", render_cpu_dtype),
    Section("The KV directory", ("directory.json",),
            "Lookups and records against a directory of 10,000 conversations.", render_directory),
    Section("Faults under load", ("faults.json",),
            "Scripted faults, each three times, under two background conversations; every turn checked token for "
            "token against a recompute.", render_faults),
    Section("Races around a pull's read", ("fault_races.json",),
            "Faults timed against a pull's read on an app with 10 s leases, every pull verified against its holder's "
            "digests and every answer checked token for token against a recompute (`benchmarks.faults --races`). A "
            "failed turn is one whose forced pull could not be planned (its error, recorded in the file: the hold was "
            "not offered), not one the app answered wrongly.", render_fault_races),
    Section("What pull verification costs", ("pull_verify.json",),
            "CRC32 of every held block at export and of every received block before use (`nixl.verify_pulls`), "
            "on two replicas of the default model (`benchmarks.pull_verify`).", render_pull_verify),
    Section("Log budget", ("log_budget.json",),
            "The app as `make serve` starts it, a multi-turn load, SIGTERM: every line its processes logged "
            "(`benchmarks.log_budget`).", render_log_budget),
    Section("An idle app", ("idle.json",),
            "Cores used by kvrelay's processes (engine replicas and their engines, ingress, directory) of the app "
            "as `make serve` starts it, in 10 s windows (`benchmarks.idle`).", render_idle),
    Section("Soak", ("soak.json",), "Steady load for half an hour: errors, memory and directory growth.",
            render_soak),
    Section("Fuzz", ("fuzz.json",), "Property-based requests of every shape against a live app.", render_fuzz),
]


def render_section(section: Section, results: Results) -> list[str]:
    lines = [f"## {section.title}", "", section.about, ""]
    present = [name for name in section.files if name in results]
    if not present:
        names = ", ".join(f"`benchmarks/results/{name}`" for name in section.files)
        return lines + [f"Not measured yet: no {names}.", ""]
    try:
        lines += section.render(results)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
        lines += [f"_{', '.join(present)} does not have the fields this section reads ({error!r})._"]
    lines.append("")
    lines += [provenance_line(name, results[name]) + "\n" for name in present]
    return lines


def render_doc(results: Results) -> str:
    lines = [
        "# Benchmarks",
        "",
        f"<!-- Generated by `{COMMAND}` from benchmarks/results/*.json; edit benchmarks/report.py, not this file. -->",
        "",
        "Every figure here is read from a results file in `benchmarks/results/`, named under its table with the "
        "commit, command, date and machine it came from. Figures compare only between runs on the same kind of "
        "machine: the same benchmark runs about 10x slower on an AVX2-only CPU than on one with AMX. A section "
        "whose file is missing says so. Regenerate with `" + COMMAND + "`.",
        "",
    ]
    lines += ["Contents: " + ", ".join(f"[{s.title}](#{anchor(s.title)})" for s in SECTIONS) + ".", ""]
    for section in SECTIONS:
        lines += render_section(section, results)
    return "\n".join(lines).rstrip() + "\n"


def anchor(title: str) -> str:
    kept = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


README_BEGIN = "<!-- BEGIN multi-turn results: generated by `python -m benchmarks.report` -->"
README_END = "<!-- END multi-turn results -->"


FLEET_BEGIN = "<!-- BEGIN fleet results: generated by `python -m benchmarks.report` -->"
FLEET_END = "<!-- END fleet results -->"


def readme_block(results: Results) -> str:
    rows = multi_turn_summary_rows(results)
    body = multi_turn_summary(results) if rows else ["No multi-turn results in benchmarks/results/ yet."]
    return "\n".join([README_BEGIN, *body, README_END])


def with_readme_block(readme: str, results: Results) -> str:
    """`readme` with its generated results tables replaced; unchanged where it has no markers."""
    for begin, end_marker, block in ((README_BEGIN, README_END, lambda: readme_block(results)),
                                     (FLEET_BEGIN, FLEET_END,
                                      lambda: "\n".join([FLEET_BEGIN, *fleet_summary(results), FLEET_END]))):
        start, end = readme.find(begin), readme.find(end_marker)
        if start >= 0 and end >= start:
            readme = readme[:start] + block() + readme[end + len(end_marker):]
    return readme


def main() -> None:
    results = load()
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(render_doc(results))
    if README.exists():
        readme = README.read_text()
        updated = with_readme_block(readme, results)
        if updated != readme:
            README.write_text(updated)
    print(f"written {DOC.relative_to(REPO_ROOT)} from {len(results)} results files")


if __name__ == "__main__":
    main()
