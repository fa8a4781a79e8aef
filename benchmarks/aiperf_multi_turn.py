"""The multi-turn benchmark driven by NVIDIA's `aiperf` (PyPI) instead of kvrelay's own client.

    make aiperf        # once: aiperf in a virtual environment of its own (.venv-aiperf)
    python -m benchmarks.aiperf_multi_turn --out benchmarks/results/aiperf_multi_turn.json [--quick]
                                           [--config FILE] [--policies a,b] [--base-url URL]

The conversations are `benchmarks.multi_turn`'s (same config files, same seed), written as an aiperf
`multi_turn` dataset: the shared system prompt, each conversation's opening document and user messages, the
think time as each later turn's delay. aiperf sends every turn with the whole history, the replies it
captured included (its multi-turn mode), streams, and measures time to first token itself; this script only
starts the app, runs aiperf once per policy (policy header, an API key per policy so no policy reuses KV
another left behind, the conversation id as `x-session-id`) and reads aiperf's own JSON export.
Output lengths are aiperf's: its mean and standard deviation are set from the config's output span.

aiperf lives in its own environment because its dependencies (dash, kubernetes, optuna, ...) are not kvrelay's;
`--aiperf PATH` points at another installation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT, machine
from benchmarks.multi_turn import load_config, warm_up, workload_arguments
from benchmarks.multi_turn_results import percentile, targets, write_results
from benchmarks.multi_turn_workload import BenchConfig, Conversation, synthetic_conversations, word_pool

DEFAULT_AIPERF = REPO_ROOT / ".venv-aiperf" / "bin" / "aiperf"
SLOT_CHECKS_PER_S = 100


def dataset_lines(conversations: list[Conversation], config: BenchConfig) -> list[str]:
    """aiperf's multi_turn JSONL: one line per conversation; a leading system turn becomes its system message."""
    lines = []
    for conv in conversations:
        turns: list[dict[str, Any]] = [{"role": "system", "text": conv.system}] if conv.system else []
        for i, user in enumerate(conv.user_messages):
            turn: dict[str, Any] = {"text": user}
            if i and config.think_time_s:
                turn["delay"] = round(config.think_time_s * 1e3)
            turns.append(turn)
        lines.append(json.dumps({"session_id": conv.conv_id, "turns": turns}))
    return lines


def write_dataset(path: Path, conversations: list[Conversation], config: BenchConfig) -> Path:
    path.write_text("\n".join(dataset_lines(conversations, config)) + "\n")
    return path


def aiperf_command(aiperf: Path, base_url: str, model: str, tokenizer_dir: Path, dataset: Path, artifacts: Path,
                   policy: str, api_key: str, config: BenchConfig, conversations: int, seed: int,
                   request_rate: float | None = None) -> list[str]:
    """aiperf's command line for one run. Closed loop by default: `config.concurrency` conversations at a time, each
    turn sent as the one before it ends. `request_rate`: open loop instead, turns sent at that many per second on
    average (Poisson arrivals; a conversation's next turn waits for its answer and then for a slot in the schedule),
    so every policy serves the same offered load; in the closed loop a policy that answers sooner is sent more."""
    if request_rate is None:
        # Without a rate, aiperf's timing process busy-waits for a free concurrency slot: a whole core here, taken
        # from the engines. A slot check every 10 ms costs nothing measurable and delays a turn's send by <= 10 ms
        # (TTFT is timed from the send).
        pacing = ["--concurrency", str(config.concurrency), "--request-rate", str(SLOT_CHECKS_PER_S),
                  "--arrival-pattern", "constant"]
    else:
        pacing = ["--concurrency", str(conversations), "--request-rate", f"{request_rate:g}",
                  "--arrival-pattern", "poisson"]
    osl_mean = (config.output_tokens.min + config.output_tokens.max) / 2
    # The standard deviation of the uniform span the built-in client draws from.
    osl_stddev = (config.output_tokens.max - config.output_tokens.min) / math.sqrt(12)
    return [
        str(aiperf), "profile",
        "--model", model, "--tokenizer", str(tokenizer_dir),
        "--url", base_url, "--endpoint-type", "chat", "--streaming",
        "--api-key", api_key, "--header", f"x-kvrelay-policy:{policy}", "--session-header", "x-session-id",
        "--input-file", str(dataset), "--custom-dataset-type", "multi_turn",
        "--conversation-num", str(conversations), *pacing,
        "--output-tokens-mean", f"{osl_mean:g}", "--output-tokens-stddev", f"{osl_stddev:.2f}",
        "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
        "--request-timeout-seconds", f"{config.request_timeout_s:g}",
        # No scraping of the app's /metrics (3 a second, each asking every replica) or of GPU telemetry.
        "--no-server-metrics", "--no-gpu-telemetry",
        "--random-seed", str(seed), "--artifact-dir", str(artifacts), "--ui-type", "none", "--no-auto-plot",
    ]


def aiperf_env() -> dict[str, str]:
    """This process's environment for aiperf: its offline mode takes a tokenizer path for a hub repo id and fails; a
    local folder needs no network anyway (aiperf resolves no alias for a path)."""
    return {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}


def aiperf_version(aiperf: Path) -> str:
    return subprocess.run([str(aiperf), "--version"], capture_output=True, text=True).stdout.strip() or str(aiperf)


def run_aiperf(command: list[str], artifacts: Path, label: str) -> dict[str, Any]:
    """One aiperf run (its console output in `artifacts`.log): aiperf's summary and the median TTFT per turn."""
    done = subprocess.run(command, cwd=artifacts.parent, env=aiperf_env(), capture_output=True, text=True)
    log = artifacts.with_suffix(".log")
    log.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"aiperf failed ({done.returncode}) for {label}; see {log}:\n"
                           f"{(done.stdout + done.stderr)[-2000:]}")
    return summary_of(read_export(artifacts)) | {"ttft_ms_p50_by_turn": ttft_by_turn(artifacts)}


def read_export(artifacts: Path) -> dict[str, Any]:
    """aiperf's summary: the metric records of its JSON export, keyed by tag."""
    exports = sorted(artifacts.rglob("profile_export_aiperf.json"))
    if not exports:
        raise RuntimeError(f"aiperf wrote no profile_export_aiperf.json under {artifacts}")
    return json.loads(exports[-1].read_text())


def ttft_by_turn(artifacts: Path) -> dict[str, float | None]:
    """Median TTFT per turn index, from aiperf's per-request export (first turns compute a whole document)."""
    by_turn: dict[int, list[float]] = {}
    for path in artifacts.rglob("profile_export.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            ttft = ((record.get("metrics") or {}).get("time_to_first_token") or {}).get("value")
            turn = (record.get("metadata") or {}).get("turn_index")
            if ttft is not None and turn is not None:
                by_turn.setdefault(turn, []).append(ttft)
    return {str(t): percentile(v, 0.5) for t, v in sorted(by_turn.items())}


def summary_of(export: dict[str, Any]) -> dict[str, Any]:
    """The figures this benchmark compares, from aiperf's export (milliseconds as aiperf reports them)."""
    ttft = export.get("time_to_first_token") or {}
    count = (export.get("request_count") or {}).get("avg")
    errors = (export.get("error_request_count") or {}).get("avg", 0)
    return {
        "ttft_ms": {q: ttft.get(q) for q in ("p50", "p90", "p99")} | {"mean": ttft.get("avg")},
        "inter_token_latency_ms_p50": (export.get("inter_token_latency") or {}).get("p50"),
        "request_latency_ms_p50": (export.get("request_latency") or {}).get("p50"),
        "request_throughput_rps": (export.get("request_throughput") or {}).get("avg"),
        "requests": int(count or 0),
        "errors": int(errors or 0),
        "unit": ttft.get("unit"),
    }


def markdown_table(policies: dict[str, dict[str, Any]]) -> str:
    lines = ["| policy | TTFT p50 (ms) | TTFT p90 (ms) | TTFT p99 (ms) | TTFT mean (ms) | ITL p50 (ms) | requests | "
             "errors |", "|---|---:|---:|---:|---:|---:|---:|---:|"]

    def fmt(value: Any) -> str:
        return f"{value:.1f}" if isinstance(value, float) else str(value)

    for name, s in policies.items():
        t = s["ttft_ms"]
        lines.append(f"| {name} | {fmt(t['p50'])} | {fmt(t['p90'])} | {fmt(t['p99'])} | {fmt(t['mean'])} | "
                     f"{fmt(s['inter_token_latency_ms_p50'])} | {fmt(s['requests'])} | {fmt(s['errors'])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    workload_arguments(parser)
    parser.add_argument("--aiperf", type=Path, default=DEFAULT_AIPERF, help="the aiperf executable")
    parser.add_argument("--artifacts", type=Path, help="where aiperf writes its artifacts (default: a new temp dir)")
    args = parser.parse_args()
    config = load_config(args)
    if not args.aiperf.exists():
        sys.exit(f"aiperf not found at {args.aiperf}: run `make aiperf` (or pass --aiperf)")

    from transformers import AutoTokenizer

    from benchmarks.common import start_app, stop_app
    from configs.models import DEFAULT_MODEL
    from model_prep.store import model_path

    model = config.model or DEFAULT_MODEL
    tokenizer_dir = Path(model_path(model))
    words = word_pool(AutoTokenizer.from_pretrained(tokenizer_dir))
    rounds = [synthetic_conversations(config, words, config.seed + r) for r in range(config.rounds)]
    # aiperf's artifacts (every prompt sent, per-request records, logs): kept for inspection, not committed.
    work = Path(tempfile.mkdtemp(prefix="kvrelay-aiperf-")) if args.artifacts is None else args.artifacts.resolve()
    work.mkdir(parents=True, exist_ok=True)
    print(f"aiperf artifacts: {work}", flush=True)
    started = time.time()
    run_id = f"{started:.0f}"
    app = None
    base_url = args.base_url
    if base_url is None:
        print(f"starting kvrelay: {model} on {config.num_replicas} replicas", flush=True)
        app = start_app(model, config.num_replicas, config.pool, throughput_optimized=True, **config.engine)
        base_url = app.direct_url or app.base_url
    runs: list[dict[str, Any]] = []
    try:
        asyncio.run(warm_up(base_url, model, rounds[0], config, run_id))
        for number, conversations in enumerate(rounds):
            dataset = write_dataset(work / f"round{number}.jsonl", conversations, config)
            for policy in config.policies if number % 2 == 0 else config.policies[::-1]:
                artifacts = work / f"round{number}_{policy}"
                command = aiperf_command(args.aiperf, base_url, model, tokenizer_dir, dataset, artifacts, policy,
                                         f"aiperf-{run_id}-r{number}-{policy}", config, len(conversations),
                                         config.seed + number)
                print(f"round {number} policy {policy}: aiperf over {len(conversations)} conversations", flush=True)
                summary = run_aiperf(command, artifacts, policy)
                runs.append({"round": number, "policy": policy, **summary})
                print(f"round {number} policy {policy}: {json.dumps(summary['ttft_ms'])}", flush=True)
                time.sleep(config.settle_s)
    finally:
        if app is not None:
            stop_app(app)
    # One round: aiperf's figures as they are. Several: the median over rounds of each figure.
    policies: dict[str, dict[str, Any]] = {}
    for policy in config.policies:
        mine = [r for r in runs if r["policy"] == policy]
        policies[policy] = mine[0] if len(mine) == 1 else {
            "ttft_ms": {q: percentile([r["ttft_ms"][q] for r in mine], 0.5) for q in ("p50", "p90", "p99", "mean")},
            **{key: percentile([r[key] for r in mine], 0.5)
               for key in ("inter_token_latency_ms_p50", "request_latency_ms_p50")},
            "requests": sum(r["requests"] for r in mine),
            "errors": sum(r["errors"] for r in mine),
            "unit": mine[0]["unit"],
        }
    result = {
        "driver": {"aiperf": aiperf_version(args.aiperf)},
        "config": config.model_dump() | {"model": model},
        "artifacts": str(work),
        "policies": policies,
        "runs": runs,
        "targets": targets(policies),
        "machine": machine(),
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "seconds": round(time.time() - started, 1),
    }
    write_results(args.out, result, markdown_table(policies))


if __name__ == "__main__":
    main()
