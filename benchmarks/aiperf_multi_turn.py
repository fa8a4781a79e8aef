"""The multi-turn comparison driven by an external load generator: NVIDIA's aiperf (PyPI), one run per policy.

    python -m benchmarks.aiperf_multi_turn --out benchmarks/results/aiperf_multi_turn.json [--config FILE]
                                           [--base-url URL] [--policies P,Q]

aiperf runs from its own virtual environment (`--aiperf-venv`, default `.venv-aiperf`, made with aiperf==0.13.0 on
first use): it pins packages of its own, and a client that shares nothing with the server is the point. Its
multi-turn mode resends the whole history each turn. Every policy runs the same aiperf workload (same seed) under
its own API key, so no policy reuses KV another left, with the `x-kvrelay-policy` header choosing the policy. The
workload comes from a multi_turn `BenchConfig` (conversations, turns, tokens, concurrency); aiperf draws token
counts from normal distributions with those ranges' means and spreads, and shares one system prefix of
`system_prefix_tokens` across conversations. Writes aiperf's TTFT statistics per policy as JSON and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT
from benchmarks.multi_turn import QUICK, BenchConfig

AIPERF = "aiperf==0.13.0"


def aiperf_binary(venv: Path) -> Path:
    """aiperf's command in `venv`, installing it there first if needed."""
    binary = venv / "bin" / "aiperf"
    if not binary.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", AIPERF], check=True)
    return binary


def aiperf_command(binary: Path, base_url: str, model: str, tokenizer: str, config: BenchConfig, policy: str,
                   run_id: str, artifacts: Path) -> list[str]:
    turns, user, out = config.turns, config.user_tokens, config.output_tokens
    return [
        str(binary), "profile",
        "--model", model, "--tokenizer", tokenizer, "--url", base_url,
        "--endpoint-type", "chat", "--streaming",
        "--conversation-num", str(config.conversations),
        "--conversation-turn-mean", str((turns.min + turns.max) / 2),
        "--conversation-turn-stddev", str((turns.max - turns.min) / 4),
        "--synthetic-input-tokens-mean", str((user.min + user.max) // 2),
        "--synthetic-input-tokens-stddev", str((user.max - user.min) // 4),
        "--output-tokens-mean", str((out.min + out.max) // 2),
        "--output-tokens-stddev", str((out.max - out.min) // 4),
        "--prefix-prompt-length", str(config.system_prefix_tokens), "--prefix-prompt-pool-size", "1",
        "--extra-inputs", "ignore_eos:true",
        "--concurrency", str(config.concurrency),
        "--random-seed", str(config.seed),
        "--header", f"x-kvrelay-policy:{policy}",
        "--api-key", f"aiperf-{run_id}-{policy}",
        "--artifact-dir", str(artifacts),
        "--ui-type", "none",
    ]


def ttft_of(artifacts: Path) -> dict[str, Any]:
    """aiperf's time-to-first-token statistics from its JSON export (milliseconds)."""
    export = next(artifacts.rglob("profile_export_aiperf.json"))
    data = json.loads(export.read_text())
    records = data.get("records", data)
    ttft = records.get("time_to_first_token") or records.get("ttft")
    if ttft is None:
        raise RuntimeError(f"no time_to_first_token in {export}")
    keep = ("avg", "p50", "p90", "p99", "min", "max", "unit")
    requests = records.get("request_count", {})
    return {k: ttft[k] for k in keep if k in ttft} | {
        "requests": requests.get("avg") if isinstance(requests, dict) else requests}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--config", type=Path, help="a multi_turn BenchConfig as JSON (default: the quick workload)")
    parser.add_argument("--base-url", help="a running kvrelay app (default: start one here)")
    parser.add_argument("--policies", help="comma-separated policies (default: the config's)")
    parser.add_argument("--aiperf-venv", type=Path, default=REPO_ROOT / ".venv-aiperf")
    args = parser.parse_args()
    config = BenchConfig.model_validate_json(args.config.read_text()) if args.config else QUICK
    policies = args.policies.split(",") if args.policies else config.policies
    binary = aiperf_binary(args.aiperf_venv)

    from benchmarks.common import start_app, stop_app
    from configs.models import DEFAULT_MODEL
    from model_prep.store import ensure_model

    model = config.model or DEFAULT_MODEL
    tokenizer = str(ensure_model(model))
    app = None
    base_url = args.base_url
    if base_url is None:
        app = start_app(model, config.num_replicas, config.pool, throughput_optimized=True, **config.engine)
        base_url = app.direct_url
        app.ingress.calibrated.remote().result()
    run_id = f"{time.time():.0f}"
    results: dict[str, Any] = {}
    try:
        for policy in policies:
            with tempfile.TemporaryDirectory(prefix="aiperf") as tmp:
                command = aiperf_command(binary, base_url, model, tokenizer, config, policy, run_id, Path(tmp))
                print(f"policy {policy}: {' '.join(command)}", flush=True)
                env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
                subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
                results[policy] = ttft_of(Path(tmp))
            print(f"policy {policy}: TTFT {json.dumps(results[policy])}", flush=True)
            time.sleep(config.settle_s)
    finally:
        if app is not None:
            stop_app(app)
    out = {"tool": AIPERF, "config": config.model_dump() | {"model": model}, "policies": results,
           "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    lines = ["| policy | TTFT p50 (ms) | TTFT p90 (ms) | TTFT p99 (ms) | TTFT mean (ms) | requests |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {p} | {r.get('p50')} | {r.get('p90')} | {r.get('p99')} | {r.get('avg')} | {r.get('requests')} |"
              for p, r in results.items()]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
