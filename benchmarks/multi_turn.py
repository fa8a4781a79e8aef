"""Multi-turn conversations over HTTP: kvrelay's planner against the routers users would run instead, in one run.

    python -m benchmarks.multi_turn --out benchmarks/results/multi_turn.json [--quick] [--config FILE]
                                    [--base-url URL] [--sharegpt FILE]

Synthetic conversations in the shape of vLLM's benchmarks/multi_turn: a system prefix shared by all, a prefix
of each conversation's own (the document it is about), then turns whose user and output token counts are drawn
from distributions; every turn resends the whole history, as OpenAI clients do. Clients run conversations
with a fixed concurrency, or start them as a Poisson process. Every policy (`kvtransfer/policies/`, chosen
per request by the `x-kvrelay-policy` header) serves the same conversations on the same engines; each policy
runs under its own API key, so no policy reuses KV another one left behind. Measured per request as the
client sees it: TTFT, TPOT, latency, reused tokens, plan mode.

Writes the JSON to --out, a markdown table next to it (.md), and two plots (TTFT distribution per policy,
TTFT by turn index). Without --base-url it starts its own app with the default model on two replicas.
The workload is `multi_turn_workload`'s, the requests `multi_turn_client`'s, the summaries `multi_turn_results`'.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from benchmarks.common import machine
from benchmarks.multi_turn_client import RequestRecord, run_policy
from benchmarks.multi_turn_results import markdown_table, plot, summarize, targets, write_results
from benchmarks.multi_turn_workload import (
    FULL,
    POLICIES,
    QUICK,
    BenchConfig,
    Conversation,
    sharegpt_conversations,
    synthetic_conversations,
    word_pool,
)


def load_config(args: argparse.Namespace) -> BenchConfig:
    if args.config:
        config = BenchConfig.model_validate_json(args.config.read_text())
    else:
        config = QUICK if args.quick else FULL
    if args.policies:
        config = config.model_copy(update={"policies": args.policies.split(",")})
    if args.rounds:
        config = config.model_copy(update={"rounds": args.rounds})
    return BenchConfig.model_validate(config.model_dump())


async def warm_up(base_url: str, model: str, conversations: list[Conversation], config: BenchConfig,
                  run_id: str) -> None:
    """Two short conversations under a tenant of their own, so engines, NIXL handshakes and the ingress's cost
    model see traffic before anything is measured; then the configured settle time."""
    warm = [c.model_copy(update={"user_messages": c.user_messages[:2]}) for c in conversations[:2]]
    for policy in ("round_robin", "kvrelay"):
        await run_policy(base_url, model, policy, warm, config.model_copy(update={"concurrency": 2}),
                         f"{run_id}-warmup")
    await asyncio.sleep(config.settle_s)


async def benchmark(base_url: str, model: str, rounds: list[list[Conversation]], config: BenchConfig,
                    run_id: str) -> tuple[dict[str, dict[str, Any]], list[RequestRecord]]:
    """Every policy over each round's conversations (see `BenchConfig.rounds`); summaries pool the rounds."""
    await warm_up(base_url, model, rounds[0], config, run_id)
    records_of: dict[str, list[RequestRecord]] = {p: [] for p in config.policies}
    wall_of: dict[str, float] = dict.fromkeys(config.policies, 0.0)
    for number, conversations in enumerate(rounds):
        order = config.policies if number % 2 == 0 else config.policies[::-1]
        for policy in order:
            print(f"round {number} policy {policy}: {len(conversations)} conversations", flush=True)
            records, wall = await run_policy(base_url, model, policy, conversations, config, f"{run_id}-r{number}")
            for r in records:
                r.round = number
            records_of[policy].extend(records)
            wall_of[policy] += wall
            ttft = summarize(records, wall)["ttft_ms"]
            print(f"round {number} policy {policy}: {json.dumps(ttft)}", flush=True)
            await asyncio.sleep(config.settle_s)
    summaries = {p: summarize(records_of[p], wall_of[p]) for p in config.policies}
    return summaries, [r for p in config.policies for r in records_of[p]]


def workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that choose the workload and where results go (`load_config` reads them)."""
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="the CPU default (finishes in under 15 minutes)")
    parser.add_argument("--config", type=Path, help="a BenchConfig as JSON (see benchmarks/configs/)")
    parser.add_argument("--base-url", help="a running kvrelay app (default: start one here)")
    parser.add_argument("--policies", help="comma-separated subset of " + ",".join(POLICIES))
    parser.add_argument("--rounds", type=int, help="runs of every policy, in alternating order (default: config's)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    workload_arguments(parser)
    parser.add_argument("--sharegpt", type=Path, help="ShareGPT-style JSON instead of synthetic conversations")
    parser.add_argument("--serve-mode", choices=["default", "throughput_optimized"], default="throughput_optimized",
                        help="Ray Serve's request path when starting the app here (as `make serve` runs it)")
    args = parser.parse_args()
    config = load_config(args)

    from transformers import AutoTokenizer

    from benchmarks.common import start_app, stop_app
    from configs.models import DEFAULT_MODEL
    from model_prep.store import model_path

    model = config.model or DEFAULT_MODEL
    tokenizer = AutoTokenizer.from_pretrained(model_path(model))
    if args.sharegpt:  # the same conversations every round (each round runs under its own tenants)
        rounds = [sharegpt_conversations(args.sharegpt, config, tokenizer)] * config.rounds
    else:
        words = word_pool(tokenizer)
        rounds = [synthetic_conversations(config, words, config.seed + r) for r in range(config.rounds)]
    app = None
    base_url = args.base_url
    started = time.time()
    if base_url is None:
        print(f"starting kvrelay: {model} on {config.num_replicas} replicas", flush=True)
        app = start_app(model, config.num_replicas, config.pool,
                        throughput_optimized=args.serve_mode == "throughput_optimized", **config.engine)
        base_url = app.direct_url or app.base_url
        print("cost model after start-up calibration:", json.dumps(app.ingress.calibrated.remote().result()),
              flush=True)
    try:
        summaries, records = asyncio.run(benchmark(base_url, model, rounds, config, f"{started:.0f}"))
        ingress_stats = app.ingress.stats.remote().result() if app else None
    finally:
        if app is not None:
            stop_app(app)
    result = {
        "config": config.model_dump() | {"model": model, "sharegpt": str(args.sharegpt) if args.sharegpt else None},
        "policies": summaries,
        "targets": targets(summaries),
        "cost_model": ingress_stats and ingress_stats["cost_model"],
        "planner_counters": ingress_stats and ingress_stats["counters"],
        "machine": machine(),
        "serve_mode": args.serve_mode if app is not None else None,
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "seconds": round(time.time() - started, 1),
        "requests": [r.model_dump() for r in records],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result["plots"] = plot(records, config.policies, args.out.with_suffix(""))
    write_results(args.out, result, markdown_table(summaries))



if __name__ == "__main__":
    main()
