"""docs/benchmarks.md's multi-turn routing sections and the README's multi-turn table, from the results of
`python -m benchmarks.multi_turn` and `python -m benchmarks.aiperf_multi_turn`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR
from benchmarks.report_format import Results, best_other, fmt, pct, table

# The multi-turn results files, each with the workload label its section title and README row use.
MULTI_TURN = {
    "multi_turn.json": "quick (`--quick`)",
    "multi_turn_saturating.json": "saturating",
    "multi_turn_long_history.json": "long histories",
    "multi_turn_think_time.json": "12 s think time",
}


def multi_turn_summary_rows(results: Results) -> list[list[Any]]:
    rows = []
    for name, label in MULTI_TURN.items():
        if name not in results:
            continue
        policies = results[name]["policies"]
        kv = policies.get("kvrelay", {}).get("ttft_ms", {})
        b50, b90 = best_other(policies, "p50"), best_other(policies, "p90")
        # As the fleet table: the best other's TTFT over kvrelay's (above 1, kvrelay is faster).
        ratio = (f"{b50[1] / kv['p50']:.2f}x / {b90[1] / kv['p90']:.2f}x" if kv and b50 and b90 else "—")
        others = f"{fmt(b50[1], 0)} / {fmt(b90[1], 0)} ({b50[0]}{'' if b90[0] == b50[0] else ', ' + b90[0]})" \
            if b50 and b90 else "—"
        other_means = ", ".join(f"{fmt(p['ttft_ms']['mean'], 0)} ({n})" for n, p in policies.items() if n != "kvrelay")
        machine = ((results[name].get("provenance") or {}).get("machine") or {}).get("cpu", "—")
        rows.append([label, f"{fmt(kv.get('p50'), 0)} / {fmt(kv.get('p90'), 0)}", others, ratio,
                     f"{fmt(kv.get('mean'), 0)} vs {other_means}", machine, f"[`{name}`](benchmarks/results/{name})"])
    return rows


def multi_turn_summary(results: Results) -> list[str]:
    return table(["workload", "kvrelay TTFT p50 / p90 (ms)", "best other p50 / p90 (ms)", "kvrelay's gain p50 / p90",
                  "mean (ms): kvrelay vs others", "machine", "results"], multi_turn_summary_rows(results))


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


def render_external(name: str) -> Callable[[Results], list[str]]:
    """`benchmarks.multi_turn_external`'s result `name`: closed loop (aiperf's concurrency mode) or open loop."""
    return lambda results: external_lines(results[name])


def external_lines(data: dict[str, Any]) -> list[str]:
    config, driver = data.get("config", {}), data.get("driver", {})
    rows = []
    for policy, p in data["policies"].items():
        rows += [[policy, f"run {r['run']}", r["p50"], r["p90"], r.get("request_throughput_rps"),
                  r.get("inter_token_latency_ms_p50"), r.get("requests"), r.get("errors"),
                  ", ".join(f"{mode} {n}" for mode, n in r.get("modes", {}).items()),
                  " / ".join(str(n) for n in r.get("requests_per_replica", []))] for r in p["runs"]]
        rows.append([policy, "median", p["ttft_ms"]["p50"], p["ttft_ms"]["p90"], p.get("request_throughput_rps"),
                     p.get("inter_token_latency_ms_p50"), None, None, "", ""])
    if driver.get("request_rate"):
        pacing = f"open loop: turns sent at {fmt(driver['request_rate'])} a second (Poisson), the same for every policy"
    else:
        pacing = (f"closed loop: {config.get('concurrency')} conversations at a time, each turn sent when the one "
                  "before it is answered (a policy that answers sooner is sent more a second)")
    lines = [f"{config.get('conversations')} conversations, {pacing}; driven by aiperf {driver.get('aiperf', '?')}; "
             "each policy's figures are medians over its runs.", ""]
    lines += table(["policy", "run", "TTFT p50 (ms)", "p90", "requests/s", "inter-token p50 (ms)", "requests",
                    "errors", "modes", "requests per replica"], rows, right_from=2)
    ratio = data.get("ratio_vs_prefix_affinity")
    if ratio:
        throughput = (f"; kvrelay's request throughput over prefix affinity's: {ratio['request_throughput']:.2f}x"
                      if ratio.get("request_throughput") else "")
        lines += ["", f"Prefix affinity's TTFT over kvrelay's: p50 {ratio['p50']:.3f}x, p90 {ratio['p90']:.3f}x "
                      f"(target at least 0.97x: {'met' if data.get('target_met') else 'not met'}){throughput}."]
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
