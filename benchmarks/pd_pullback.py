"""The seed's experiment (vLLM PR #32553): prefill/decode disaggregated, one prefill and one decode replica,
multi-turn conversations; where does the next turn's history come from?

    python -m benchmarks.pd_pullback --out benchmarks/results/pd_pullback.json [--conversations 8]

(a) pull-back: the prefill replica pulls the history's KV back from the decode replica that holds it (NIXL,
    bidirectional), prefix caching off on the prefill side as in the PR (`fixed_threshold`: vLLM's 64-token rule);
(b) recompute: the prefill replica computes the whole history (vLLM without bidirectional transfer; prefix
    caching off on the prefill side, as in the PR);
(c) kvrelay: the planner chooses per turn between the prefill replica's own cache, a pull and a recompute
    (with prefix caching on, as kvrelay ships; and with it off, the PR's setting);
(d) the prefill replica's own prefix cache only (vLLM's default without pull-back).
Two apps, started one after the other with the same engines: prefill prefix caching off for (a), (b) and
(c, off); on for (c) and (d). The same conversations run under each; the table has the PR's shape (TTFT mean,
p50, p99).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from benchmarks.common import machine, start_app, stop_app, write_result
from benchmarks.multi_turn import benchmark
from benchmarks.multi_turn_workload import QUICK, BenchConfig, synthetic_conversations, word_pool

ENGINE = {"max_model_len": 4096, "kv_cache_memory_bytes": 512 * 1024**2}
# The prefill replica's prefix caching -> (label, the policy the ingress runs) for each mode on that app.
MODES = {
    False: [("a_pull_back", "fixed_threshold"), ("b_recompute", "round_robin"),
            ("c_kvrelay_prefill_cache_off", "kvrelay")],
    True: [("c_kvrelay", "kvrelay"), ("d_prefill_cache_only", "round_robin")],
}


def run_app_modes(prefill_cache: bool, config: BenchConfig, throughput_optimized: bool) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from configs.models import DEFAULT_MODEL
    from model_prep.store import model_path

    model = config.model or DEFAULT_MODEL
    conversations = synthetic_conversations(config, word_pool(AutoTokenizer.from_pretrained(model_path(model))))
    # The decode replica always caches prefixes (it holds the conversations); only the prefill side differs.
    app = start_app(model, 1, throughput_optimized=throughput_optimized, enable_prefix_caching=prefill_cache,
                    decode_pool={"num_replicas": 1, "engine": {"enable_prefix_caching": True}}, **ENGINE)
    try:
        # The start-up calibration times solo prefills on the prefill replica: the first mode's turns must not
        # run beside it (they would slow both, and make its solo samples contended ones).
        print("cost model after start-up calibration:", json.dumps(app.ingress.calibrated.remote().result()),
              flush=True)
        policies = [policy for _, policy in MODES[prefill_cache]]
        summaries, records = asyncio.run(benchmark(app.direct_url or app.base_url, model, [conversations],
                                             config.model_copy(update={"policies": policies}),
                                             f"pd{int(prefill_cache)}-{time.time():.0f}"))
        stats = app.ingress.stats.remote().result()
    finally:
        stop_app(app)
    out = {label: summaries[policy] for label, policy in MODES[prefill_cache]}
    out["_planner"] = {"counters": stats["counters"], "cost_model": stats["cost_model"]}
    label_of = {policy: label for label, policy in MODES[prefill_cache]}
    out["_requests"] = [r.model_dump() | {"label": label_of[r.policy]} for r in records]
    return out


def table(results: dict[str, Any]) -> str:
    rows = ["| mode | TTFT mean (ms) | TTFT p50 (ms) | TTFT p99 (ms) | modes | errors |",
            "|---|---:|---:|---:|---|---:|"]
    for label, s in sorted(results.items()):
        t = s["ttft_ms"]
        modes = ", ".join(f"{m} {n}" for m, n in sorted(s["modes"].items()))
        rows.append(f"| {label} | {t['mean']} | {t['p50']} | {t['p99']} | {modes} | {s['errors']} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--serve-mode", choices=["default", "throughput_optimized"], default="throughput_optimized")
    args = parser.parse_args()
    config = QUICK.model_copy(update={"conversations": args.conversations})
    started = time.time()
    results: dict[str, Any] = {}
    planner: dict[str, Any] = {}
    requests: list[dict[str, Any]] = []
    for prefill_cache in (False, True):
        got = run_app_modes(prefill_cache, config, args.serve_mode == "throughput_optimized")
        planner[f"prefill_cache_{'on' if prefill_cache else 'off'}"] = got.pop("_planner")
        requests += got.pop("_requests")
        results |= got
    p50 = {label: s["ttft_ms"]["p50"] for label, s in results.items()}
    figures = {
        "modes": results,
        "ratios_p50": {
            "c_vs_b": round(p50["b_recompute"] / p50["c_kvrelay"], 3),
            "c_vs_d": round(p50["d_prefill_cache_only"] / p50["c_kvrelay"], 3),
            "a_vs_b": round(p50["b_recompute"] / p50["a_pull_back"], 3),
            "c_off_vs_b": round(p50["b_recompute"] / p50["c_kvrelay_prefill_cache_off"], 3),
        },
        "targets": {"c_vs_b": ">= 4.4 (the PR's ratio)", "c_vs_d": ">= 2"},
        "planner": planner,
        "workload": config.model_dump(exclude={"policies"}),
        "serve_mode": args.serve_mode,
        "machine": machine(),
        "seconds": round(time.time() - started),
        # Every turn of every mode (client-side TTFT, the ingress's own, the mode and replica it ran with).
        "requests": requests,
    }
    write_result(args.out, figures)
    args.out.with_suffix(".md").write_text(table(results) + "\n")
    print(table(results))
    print(json.dumps(figures["ratios_p50"], indent=2))


if __name__ == "__main__":
    main()
