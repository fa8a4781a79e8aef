"""The multi-turn benchmark's results: per-policy summaries of the measured requests, the targets kvrelay is held
to, the markdown table and plots written beside the JSON."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks.common import write_result
from benchmarks.multi_turn_client import RequestRecord


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return round(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo), 2)


def summarize(records: list[RequestRecord], wall_s: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    tpot = [r.tpot_ms for r in ok if r.tpot_ms is not None]
    latency = [r.latency_ms for r in ok if r.latency_ms is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    by_turn: dict[int, list[float]] = {}
    for r in ok:
        by_turn.setdefault(r.turn, []).append(r.ttft_ms)
    modes: dict[str, int] = {}
    placement: dict[str, int] = {}
    for r in ok:
        modes[r.mode or "?"] = modes.get(r.mode or "?", 0) + 1
        placement[r.replica or "?"] = placement.get(r.replica or "?", 0) + 1
    return {
        "ttft_ms": {"p50": percentile(ttft, 0.5), "p90": percentile(ttft, 0.9), "p99": percentile(ttft, 0.99),
                    "mean": round(statistics.fmean(ttft), 2) if ttft else None},
        "tpot_ms": {"p50": percentile(tpot, 0.5)},
        "latency_ms": {"p50": percentile(latency, 0.5), "p90": percentile(latency, 0.9)},
        "requests": len(records),
        "errors": len(records) - len(ok),
        "reused_token_share": round(sum(r.reused_tokens for r in ok) / prompt, 4) if prompt else 0.0,
        "modes": modes,
        # Requests per replica, busiest first: how evenly the policy spread the load.
        "requests_per_replica": sorted(placement.values(), reverse=True),
        "ttft_ms_p50_by_turn": {str(t): percentile(v, 0.5) for t, v in sorted(by_turn.items())},
        # Measured over estimated TTFT of the option run, per mode (the estimate is the mode's best option).
        "measured_over_estimate_p50": {
            m: percentile([r.ttft_ms / r.estimate_ms for r in ok if r.mode == m and r.estimate_ms], 0.5)
            for m in sorted(modes) if any(r.mode == m and r.estimate_ms for r in ok)},
        # Mean |estimated - measured| / measured TTFT per mode: how far off the planner's estimates were.
        "estimate_error_mean": {
            m: round(statistics.fmean(abs(r.estimate_ms - r.ttft_ms) / r.ttft_ms
                                      for r in ok if r.mode == m and r.estimate_ms), 3)
            for m in sorted(modes) if any(r.mode == m and r.estimate_ms for r in ok)},
        "wall_s": round(wall_s, 1),
    }


def markdown_table(policies: dict[str, dict[str, Any]]) -> str:
    lines = ["| policy | TTFT p50 (ms) | TTFT p90 (ms) | TTFT p99 (ms) | TTFT mean (ms) | TPOT p50 (ms) | requests | "
             "errors | reused token share | modes | requests per replica |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for name, s in policies.items():
        t = s["ttft_ms"]
        modes = ", ".join(f"{m} {n}" for m, n in sorted(s["modes"].items()))
        lines.append(f"| {name} | {t['p50']} | {t['p90']} | {t['p99']} | {t['mean']} | {s['tpot_ms']['p50']} | "
                     f"{s['requests']} | {s['errors']} | {s['reused_token_share']:.1%} | {modes} | "
                     f"{' / '.join(map(str, s['requests_per_replica']))} |")
    return "\n".join(lines) + "\n"


def targets(policies: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets: kvrelay p50 at least 2x lower than round robin; within 5% of the best other
    policy at p50 and p90; no errors."""
    if "kvrelay" not in policies:
        return {}
    k = policies["kvrelay"]["ttft_ms"]
    out: dict[str, Any] = {"errors_total": sum(s["errors"] for s in policies.values())}
    if "round_robin" in policies:
        out["p50_speedup_vs_round_robin"] = round(policies["round_robin"]["ttft_ms"]["p50"] / k["p50"], 3)
    others = {n: s["ttft_ms"] for n, s in policies.items() if n != "kvrelay"}
    for q in ("p50", "p90"):
        if others:
            best_name, best = min(others.items(), key=lambda kv: kv[1][q])
            out[f"{q}_vs_best_other"] = {"best_other": best_name, "ratio": round(k[q] / best[q], 3)}
    out["met"] = {
        "p50_2x_below_round_robin": out.get("p50_speedup_vs_round_robin", 0) >= 2.0,
        "p50_within_5pct_of_best_other": out.get("p50_vs_best_other", {}).get("ratio", 9) <= 1.05,
        "p90_within_5pct_of_best_other": out.get("p90_vs_best_other", {}).get("ratio", 9) <= 1.05,
        "no_errors": out["errors_total"] == 0,
    }
    return out


def plot(records: list[RequestRecord], policies: list[str], stem: Path) -> list[str]:
    """Two PNGs next to the JSON: TTFT distribution per policy, and median TTFT by turn index."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def save(fig, ax, title: str, xlabel: str, ylabel: str, suffix: str) -> str:
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = stem.with_name(stem.name + suffix)
        fig.savefig(path, dpi=110)
        return str(path)

    ok = [r for r in records if r.ok]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in policies:
        values = sorted(r.ttft_ms for r in ok if r.policy == policy)
        if values:
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=policy)
    ax.set_xscale("log")
    cdf = save(fig, ax, "TTFT distribution per policy", "time to first token (ms, log scale)",
               "fraction of requests", "_ttft_cdf.png")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in policies:
        turns: dict[int, list[float]] = {}
        for r in ok:
            if r.policy == policy:
                turns.setdefault(r.turn, []).append(r.ttft_ms)
        xs = sorted(turns)
        ax.plot([x + 1 for x in xs], [statistics.median(turns[x]) for x in xs], "o-", label=policy)
    by_turn = save(fig, ax, "TTFT by turn index", "turn of the conversation", "median TTFT (ms)",
                   "_ttft_by_turn.png")
    plt.close("all")
    return [cdf, by_turn]



def write_results(out: Path, result: dict[str, Any], table: str) -> None:
    """The JSON at `out` and the markdown table beside it (.md); prints the table and the targets."""
    write_result(out, result)
    out.with_suffix(".md").write_text(table)
    print(table)
    print(json.dumps(result["targets"], indent=2))
    print("written", out)

