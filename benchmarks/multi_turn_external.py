"""kvrelay against prefix affinity as an outside user measures them: aiperf's multi-turn mode, a fresh app per run.

NVIDIA's aiperf drives each policy against an app of its own, started as `make serve` starts it.

    make aiperf   # once: aiperf in .venv-aiperf
    python -m benchmarks.multi_turn_external --out benchmarks/results/multi_turn_external.json [--quick]
        [--config FILE] [--policies prefix_affinity,kvrelay] [--runs 2] [--conversations N] [--aiperf PATH]
        [--request-rate R]

For each run r and each policy (forward order on even runs, reversed on odd ones): start the app
(`benchmarks.served`: the committed serve_config.yaml with the Makefile's environment), wait for `make serve`'s
"ready" line (healthy and calibrated) and the workload's settle time, run aiperf once over run r's conversations
with the policy's `x-kvrelay-policy` header, read the app's planner counters, stop the app. The conversations and
aiperf's settings are `benchmarks.aiperf_multi_turn`'s (run r: the workload's seed + r, the same for every policy);
no warm-up beyond the app's own start-up calibration. Each policy's TTFT p50 and p90 is the median over its runs of
aiperf's own per-run figures. aiperf's raw export gives each turn's plan (the last chunk's `kvrelay` object), so
kvrelay's turns are compared with prefix affinity's on the same conversation and turn, by the mode kvrelay chose.

Closed loop by default (aiperf's concurrency mode: `concurrency` conversations at a time, each turn sent when the one
before it is answered), where a policy that answers sooner is sent more requests a second, so its TTFT is measured
under more load; each run's request throughput is recorded beside it. `--request-rate R`: open loop, turns sent at
R a second on average (Poisson), the same offered load for every policy, as serving benchmarks compare systems.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks.aiperf_multi_turn import (
    DEFAULT_AIPERF,
    aiperf_command,
    aiperf_version,
    run_aiperf,
    write_dataset,
)
from benchmarks.common import REPO_ROOT, write_result
from benchmarks.idle import session_pids
from benchmarks.multi_turn import load_config
from benchmarks.multi_turn_results import percentile
from benchmarks.multi_turn_workload import POLICIES, synthetic_conversations, word_pool
from benchmarks.served import REPLICAS, healthy, ready, start_served, stop_served, wait_for

BASELINE = "prefix_affinity"
TARGET_RATIO = 0.97  # issue 37: kvrelay's TTFT p50 and p90 at least 0.97x of prefix affinity's
RATIO_MEANS = ("prefix affinity's TTFT / kvrelay's, each the median over runs: above 1 kvrelay is faster; "
               f"the target is >= {TARGET_RATIO}")


def served_model() -> str:
    """The model the committed serve_config.yaml serves (its name is also the tokenizer's preset)."""
    config = yaml.safe_load((REPO_ROOT / "serve_config.yaml").read_text())
    return config["applications"][0]["args"]["pool"]["engine"]["model"]


def turn_plans(artifacts: Path) -> dict[tuple[str, int], dict[str, Any]]:
    """(conversation, turn) -> TTFT and how kvrelay served the turn, from aiperf's per-request and raw exports."""
    turns: dict[tuple[str, int], dict[str, Any]] = {}
    for path in artifacts.rglob("profile_export.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            meta = record.get("metadata") or {}
            ttft = ((record.get("metrics") or {}).get("time_to_first_token") or {}).get("value")
            if ttft is not None and meta.get("turn_index") is not None:
                turns[(str(meta.get("conversation_id")), meta["turn_index"])] = {"ttft_ms": ttft}
    for path in artifacts.rglob("profile_export_raw.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            meta = record.get("metadata") or {}
            key = (str(meta.get("conversation_id")), meta.get("turn_index"))
            if key in turns and (plan := last_plan(record)):
                turns[key] |= {k: plan.get(k) for k in ("mode", "replica", "holder", "reused_tokens")}
    return turns


def last_plan(raw: dict[str, Any]) -> dict[str, Any] | None:
    """The `kvrelay` object of a streamed answer's last chunk, else the `x-kvrelay-plan` header."""
    for response in reversed(raw.get("responses") or []):
        for packet in reversed(response.get("packets") or []):
            value = packet.get("value") or ""
            if '"kvrelay"' in value:
                try:
                    return json.loads(value)["kvrelay"]
                except (ValueError, KeyError, TypeError):
                    continue
    header = {k.lower(): v for k, v in (raw.get("response_headers") or {}).items()}.get("x-kvrelay-plan")
    return json.loads(header) if header else None


def count(turns: dict[tuple[str, int], dict[str, Any]], field: str) -> Counter[str]:
    return Counter(turn.get(field) or "?" for turn in turns.values())


def paired(kvrelay: dict[tuple[str, int], dict[str, Any]],
           baseline: dict[tuple[str, int], dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """kvrelay's turns grouped by the mode it chose and by its replica (busiest first), each against prefix
    affinity's TTFT on the same conversation and turn of the same run: where kvrelay's choices gain and lose."""
    rank = {replica: n for n, (replica, _) in enumerate(count(kvrelay, "replica").most_common(), 1)}
    return {"by_kvrelay_mode": paired_groups(kvrelay, baseline, lambda turn: turn.get("mode") or "?"),
            "by_kvrelay_replica": paired_groups(kvrelay, baseline,
                                                lambda turn: f"replica {rank[turn.get('replica') or '?']}")}


def paired_groups(kvrelay: dict[tuple[str, int], dict[str, Any]], baseline: dict[tuple[str, int], dict[str, Any]],
                  group_of: Callable[[dict[str, Any]], str]) -> dict[str, dict[str, Any]]:
    groups: dict[str, list[tuple[float, float, int]]] = {}
    for key, turn in kvrelay.items():
        if key in baseline:
            groups.setdefault(group_of(turn), []).append((turn["ttft_ms"], baseline[key]["ttft_ms"], key[1]))
    out = {}
    for group, pairs in sorted(groups.items()):
        ours, theirs = [p[0] for p in pairs], [p[1] for p in pairs]
        out[group] = {
            "turns": len(pairs),
            "kvrelay_ttft_ms_p50": percentile(ours, 0.5),
            "prefix_affinity_ttft_ms_p50": percentile(theirs, 0.5),
            "kvrelay_ttft_ms_sum": round(sum(ours), 1),
            "prefix_affinity_ttft_ms_sum": round(sum(theirs), 1),
            # Turns kvrelay answered more than 10% later than prefix affinity did, and their turn indexes.
            "kvrelay_slower_by_10pct": sum(o > 1.1 * t for o, t, _ in pairs),
            "slower_turn_indexes": sorted(i for o, t, i in pairs if o > 1.1 * t),
        }
    return out


def wait_until_gone(sid: int, timeout_s: float = 60) -> list[int]:
    """Waits for every process of the app's session to end; returns those still there after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (left := session_pids(sid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def one_run(args: argparse.Namespace, config: Any, model: str, tokenizer_dir: Path, dataset: Path, folder: Path,
            run: int, policy: str, conversations: int) -> tuple[dict[str, Any], dict[tuple[str, int], dict]]:
    """A fresh app, one aiperf run of `policy` against it, the app stopped: the run's figures and its turns."""
    folder.mkdir(parents=True)
    started = time.monotonic()
    served = start_served(folder)
    try:
        wait_for(served, lambda: ready(served), "ready")
        if not healthy(served):
            raise RuntimeError(f"the app said ready without {REPLICAS} replicas reporting: {served.stages}")
        ready_s = time.monotonic() - started
        time.sleep(config.settle_s)
        artifacts = folder / "aiperf"
        command = aiperf_command(args.aiperf, served.base, model, tokenizer_dir, dataset, artifacts, policy,
                                 f"external-r{run}-{policy}", config, conversations, config.seed + run,
                                 args.request_rate)
        print(f"run {run} {policy}: app ready in {ready_s:.0f} s; aiperf over {conversations} conversations",
              flush=True)
        aiperf_started = time.monotonic()
        summary = run_aiperf(command + ["--export-level", "raw"], artifacts, f"run {run} {policy}")
        aiperf_s = time.monotonic() - aiperf_started
        stats = httpx.get(f"{served.base}/kvrelay/stats", timeout=30).json()
    finally:
        stop_served(served)
    left = wait_until_gone(served.proc.pid)
    if left:
        print(f"run {run} {policy}: processes of the app still running after its stop: {left}", flush=True)
    turns = turn_plans(artifacts)
    figures = {
        "run": run, "policy": policy, **summary, "modes": dict(sorted(count(turns, "mode").items())),
        # Turns per replica, busiest first: prefix affinity keeps every conversation that shares a system prompt
        # where that prompt was first cached.
        "requests_per_replica": sorted(count(turns, "replica").values(), reverse=True),
        "app_ready_s": round(ready_s, 1), "aiperf_s": round(aiperf_s, 1),
        "planner_counters": stats.get("counters"), "cost_model": stats.get("cost_model"),
        "processes_left_after_stop": len(left), "artifacts": str(folder),
    }
    t = summary["ttft_ms"]
    print(f"run {run} {policy}: TTFT p50 {t['p50']:.1f} ms, p90 {t['p90']:.1f} ms, {summary['requests']} requests "
          f"at {summary['request_throughput_rps'] or 0:.3f}/s, "
          f"{summary['errors']} errors, modes {figures['modes']}, per replica {figures['requests_per_replica']}, "
          f"aiperf {aiperf_s:.0f} s", flush=True)
    return figures, turns


def ratio(baseline: float | None, ours: float | None) -> float | None:
    return round(baseline / ours, 3) if baseline and ours else None


def summarize(policies: list[str], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per policy: the median over runs of each run's p50 and p90; the ratios against prefix affinity."""
    by_policy: dict[str, Any] = {}
    for policy in policies:
        mine = [r for r in runs if r["policy"] == policy]
        by_policy[policy] = {
            "ttft_ms": {q: percentile([r["ttft_ms"][q] for r in mine], 0.5) for q in ("p50", "p90")},
            # What the TTFT was measured under: in the closed loop, each policy's own pace.
            "request_throughput_rps": percentile([r.get("request_throughput_rps") or 0.0 for r in mine], 0.5),
            "inter_token_latency_ms_p50": percentile([r.get("inter_token_latency_ms_p50") or 0.0 for r in mine], 0.5),
            "runs": [{"run": r["run"], **{q: round(r["ttft_ms"][q], 2) for q in ("p50", "p90", "p99", "mean")},
                      "requests": r["requests"], "errors": r["errors"], "modes": r["modes"],
                      "request_throughput_rps": r.get("request_throughput_rps"),
                      "inter_token_latency_ms_p50": r.get("inter_token_latency_ms_p50"),
                      "requests_per_replica": r["requests_per_replica"]} for r in mine],
        }
    result: dict[str, Any] = {"policies": by_policy}
    if BASELINE in by_policy and "kvrelay" in by_policy:
        base, ours = by_policy[BASELINE]["ttft_ms"], by_policy["kvrelay"]["ttft_ms"]
        per_run = []
        for number in sorted({r["run"] for r in runs}):
            of = {r["policy"]: r["ttft_ms"] for r in runs if r["run"] == number}
            per_run.append({"run": number, **{q: ratio(of[BASELINE][q], of["kvrelay"][q]) for q in ("p50", "p90")}})
        result["ratio_vs_prefix_affinity"] = {q: ratio(base[q], ours[q]) for q in ("p50", "p90")} | {
            "means": RATIO_MEANS, "per_run": per_run,
            # kvrelay's request throughput over prefix affinity's (above 1: kvrelay served more a second).
            "request_throughput": ratio(by_policy["kvrelay"]["request_throughput_rps"],
                                        by_policy[BASELINE]["request_throughput_rps"])}
        result["target_met"] = all((result["ratio_vs_prefix_affinity"][q] or 0) >= TARGET_RATIO for q in ("p50", "p90"))
    return result


def table(result: dict[str, Any]) -> str:
    lines = ["| policy | run | TTFT p50 (ms) | TTFT p90 (ms) | requests | errors | modes | per replica |",
             "|---|---|---:|---:|---:|---:|---|---|"]
    for policy, p in result["policies"].items():
        for r in p["runs"]:
            modes = ", ".join(f"{m} {n}" for m, n in r["modes"].items())
            lines.append(f"| {policy} | {r['run']} | {r['p50']:.1f} | {r['p90']:.1f} | {r['requests']} | "
                         f"{r['errors']} | {modes} | {' / '.join(map(str, r['requests_per_replica']))} |")
        lines.append(f"| {policy} | median | {p['ttft_ms']['p50']:.1f} | {p['ttft_ms']['p90']:.1f} | | | | |")
    if "ratio_vs_prefix_affinity" in result:
        r = result["ratio_vs_prefix_affinity"]
        lines.append(f"\nprefix affinity / kvrelay: p50 {r['p50']}, p90 {r['p90']} (target >= {TARGET_RATIO}): "
                     f"{'met' if result['target_met'] else 'not met'}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="the quick workload (12 conversations instead of 24)")
    parser.add_argument("--config", type=Path, help="a BenchConfig as JSON (see benchmarks/configs/); the app is "
                        "serve_config.yaml's whatever its model and engine fields say")
    parser.add_argument("--policies", default=f"{BASELINE},kvrelay", help="comma-separated subset of "
                        + ",".join(POLICIES))
    parser.add_argument("--runs", dest="rounds", type=int, default=2, metavar="N",
                        help="fresh apps per policy (default 2)")
    parser.add_argument("--conversations", type=int, help="fewer conversations than the workload's (a trial)")
    parser.add_argument("--aiperf", type=Path, default=DEFAULT_AIPERF, help="the aiperf executable")
    parser.add_argument("--request-rate", type=float, help="open loop: turns a second (Poisson), the same for every "
                        "policy (default: closed loop at the workload's concurrency)")
    parser.add_argument("--artifacts", type=Path, help="where each app's logs and aiperf's artifacts go "
                        "(default: a new temp dir)")
    args = parser.parse_args()
    config = load_config(args)
    if args.conversations:
        config = config.model_copy(update={"conversations": args.conversations})
    if not args.aiperf.exists():
        parser.error(f"aiperf not found at {args.aiperf}: run `make aiperf` (or pass --aiperf)")

    from transformers import AutoTokenizer

    from model_prep.store import model_path

    model = served_model()
    tokenizer_dir = Path(model_path(model))
    words = word_pool(AutoTokenizer.from_pretrained(tokenizer_dir))
    work = Path(tempfile.mkdtemp(prefix="kvrelay-external-")) if args.artifacts is None else args.artifacts.resolve()
    work.mkdir(parents=True, exist_ok=True)
    print(f"apps' logs and aiperf's artifacts: {work}", flush=True)
    started = time.time()
    runs: list[dict[str, Any]] = []
    pairs: list[dict[str, Any]] = []
    for run in range(config.rounds):
        conversations = synthetic_conversations(config, words, config.seed + run)
        dataset = write_dataset(work / f"run{run}.jsonl", conversations, config)
        turns_of = {}
        for policy in config.policies if run % 2 == 0 else config.policies[::-1]:
            folder = work / f"run{run}_{policy}"
            figures, turns_of[policy] = one_run(args, config, model, tokenizer_dir, dataset, folder, run, policy,
                                                len(conversations))
            runs.append(figures)
        if BASELINE in turns_of and "kvrelay" in turns_of:
            pairs.append({"run": run, **paired(turns_of["kvrelay"], turns_of[BASELINE])})
    result = {
        "what": "TTFT as aiperf measures it in its multi-turn mode, a fresh app (`make serve`'s) per policy and run; "
                "each policy's ttft_ms p50 and p90 are the medians over its runs of each run's own p50 and p90",
        "driver": {"aiperf": aiperf_version(args.aiperf), "export_level": "raw",
                   "arrival": "closed loop" if args.request_rate is None else "open loop",
                   "request_rate": args.request_rate},
        "app": {"config": "serve_config.yaml", "model": model, "replicas": REPLICAS},
        "config": config.model_dump(exclude={"model", "num_replicas", "pool", "engine"}),
        **summarize(config.policies, runs),
        "paired_turns": {"what": "kvrelay's turns by the mode it chose and by its replica (busiest first), against "
                                 "prefix affinity's TTFT on the same conversation and turn of the same run",
                         "runs": pairs},
        "run_details": runs,
        "artifacts": str(work),
        "seconds": round(time.time() - started, 1),
    }
    write_result(args.out, result)
    print(table(result))
    print("written", args.out)


if __name__ == "__main__":
    main()
