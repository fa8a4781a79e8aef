"""docs/benchmarks.md's robustness sections: faults and races under load, pull verification's cost, the log budget,
an idle app, soak and fuzz."""

from __future__ import annotations

from benchmarks.report_format import Results, fmt, table


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

