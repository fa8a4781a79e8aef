"""docs/benchmarks.md's sections on single mechanisms measured one at a time: the planner's choices, pulls, the
ingress's and the front end's costs, engines and the KV directory."""

from __future__ import annotations

from benchmarks.common import RESULTS_DIR
from benchmarks.report_format import Results, fmt, pct, table


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

