"""Pulling a conversation's KV across nodes vs within a node: fixed cost, bandwidth and the crossover with recompute.

    python -m benchmarks.two_nodes --out benchmarks/results/two_nodes.json [--quick] [--model NAME]

Two settings, one after the other, each with two engine replicas of the same model (default: the app's default):
  within_node  - one Ray node on loopback: UCX picks its own transports between the two engines (UCX_TLS unset);
  across_nodes - tests/cluster.py's two Ray nodes in two network namespaces joined by a veth link, one replica per
                 node, UCX on TCP over the link (as between two machines without RDMA).
For each history length, on fresh conversations, the holder computes the history (one token out), then the other
replica answers a follow-up of 32 new tokens two ways: pulling the history's KV from the holder, and recomputing
everything. Reported per setting: median TTFT per mode and length, the crossover (the shortest history whose pull
beats its recompute), and the cost model's pull fit (fixed ms + bytes / bandwidth) from the turn path's own timings
(start-up calibration plus these pulls). The worker node is pinned to the last core and the head to the others, so
each node computes on cores of its own, as within a node each engine does on its own core.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Any

from benchmarks.common import machine, write_result

GREEDY_ONE = {"max_tokens": 1, "temperature": 0.0, "ignore_eos": True}
FOLLOW_UP = 32


def sweep(ingress: Any, vocab: int, replicas: list[str], lengths: list[int], reps: int) -> dict[str, Any]:
    """Median TTFT of pull and recompute off the holder per history length; the replicas swap roles every
    repetition and the two modes alternate which runs first."""
    rng = random.Random(0)

    def follow_up(history: int, holder: str) -> list[int]:
        prompt = [rng.randrange(100, vocab) for _ in range(history)]
        first = ingress.turn.remote(prompt, GREEDY_ONE, ("recompute", holder)).result(timeout_s=600)
        return prompt + first.token_ids + [rng.randrange(100, vocab) for _ in range(FOLLOW_UP)]

    # Warm both directions (and their NIXL handshakes) outside the measurement.
    for rep in range(2):
        holder, other = replicas[rep % 2], replicas[(rep + 1) % 2]
        ingress.turn.remote(follow_up(128, holder), GREEDY_ONE, ("pull", other)).result(timeout_s=600)
    points = []
    for history in lengths:
        ttft: dict[str, list[float]] = {"pull": [], "recompute": []}
        for rep in range(reps):
            holder, other = replicas[rep % 2], replicas[(rep + 1) % 2]
            for mode in (("pull", "recompute") if rep % 2 == 0 else ("recompute", "pull")):
                turn = follow_up(history, holder)
                result = ingress.turn.remote(turn, GREEDY_ONE, (mode, other)).result(timeout_s=600)
                if result.kvrelay.mode != mode:
                    raise RuntimeError(f"a forced {mode} ran as {result.kvrelay.mode}: {result.kvrelay.reason}")
                ttft[mode].append(result.ttft_ms)
        point = {"history": history, "reps": reps,
                 "ttft_ms": {mode: round(statistics.median(v), 1) for mode, v in ttft.items()}}
        points.append(point)
        print(json.dumps(point), file=sys.stderr, flush=True)
    crossover = next((p["history"] for p in points if p["ttft_ms"]["pull"] < p["ttft_ms"]["recompute"]), None)
    stats = ingress.stats.remote().result()
    return {"points": points, "crossover_history": crossover, "pull_fit": stats["cost_model"]["pull"],
            "handshake_ms": stats["cost_model"]["handshake_ms"],
            "replicas": [{k: r[k] for k in ("replica_id", "node_id")} for r in stats["replicas"]]}


def within_node(model: str, engine: dict[str, Any], lengths: list[int], reps: int) -> dict[str, Any]:
    from benchmarks.common import start_app, stop_app

    app = start_app(model, **engine)
    try:
        app.ingress.calibrated.remote().result(timeout_s=600)
        return sweep(app.ingress, app.vocab_size, app.replica_ids(2), lengths, reps)
    finally:
        stop_app(app)


def across_nodes(model: str, engine: dict[str, Any], lengths: list[int], reps: int) -> dict[str, Any]:
    from tests.cluster import TwoNodeCluster

    with TwoNodeCluster() as cluster:
        deployed = cluster.driver_json("-m", "tests.two_nodes_driver", "--address", cluster.address, "deploy",
                                       "--http", f"{cluster.ips['head']}:8000",
                                       "--engine", json.dumps(dict(engine, model=model)), timeout=900)
        print("deployed:", json.dumps(deployed), file=sys.stderr, flush=True)
        measured = cluster.driver_json("-m", "benchmarks.two_nodes", "--sweep", cluster.address, "--model", model,
                                       "--lengths", ",".join(map(str, lengths)), "--reps", str(reps),
                                       "--out", "-", timeout=3600)
        measured["link"] = {"transport": "UCX tcp over a veth pair between two network namespaces",
                            "env": {k: v for k, v in cluster.env("head").items() if k.startswith("UCX_")}}
        return measured


def sweep_on_cluster(address: str, model: str, lengths: list[int], reps: int) -> dict[str, Any]:
    """The sweep as a Ray driver on the two-node cluster's head (run inside its namespace by `across_nodes`)."""
    import ray
    from ray import serve
    from transformers import AutoTokenizer

    from model_prep.store import model_path
    from tests.two_nodes_driver import APP, replicas

    ray.init(address=address, namespace="serve", logging_level="ERROR", log_to_driver=False)
    ingress = serve.get_app_handle(APP)
    ids = [r["replica_id"] for r in replicas()]
    ingress.calibrated.remote().result(timeout_s=600)
    return sweep(ingress, len(AutoTokenizer.from_pretrained(model_path(model))), ids, lengths, reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file ('-': print it)")
    parser.add_argument("--quick", action="store_true", help="histories 256 and 1024, 2 repetitions")
    parser.add_argument("--model", default=None)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--lengths", default=None, help="comma-separated history lengths")
    parser.add_argument("--sweep", metavar="ADDRESS", help=argparse.SUPPRESS)  # internal: run on a cluster's head
    args = parser.parse_args()
    from configs.models import DEFAULT_MODEL

    model = args.model or DEFAULT_MODEL
    lengths = [int(n) for n in args.lengths.split(",")] if args.lengths else (
        [256, 1024] if args.quick else [32, 64, 128, 256, 512, 1024, 2048])
    reps = args.reps or (2 if args.quick else 4)
    if args.sweep:
        print(json.dumps(sweep_on_cluster(args.sweep, model, lengths, reps)))
        return
    engine = {"max_model_len": 2048 + 256, "kv_cache_memory_bytes": 512 * 1024**2}
    started = time.monotonic()
    within = within_node(model, engine, lengths, reps)
    across = across_nodes(model, engine, lengths, reps)
    result = {
        "model": model,
        "machine": machine(),
        "follow_up_tokens": FOLLOW_UP,
        "within_node": within,
        "across_nodes": across,
        "pull_fixed_ms": {"within_node": within["pull_fit"]["fixed_ms"],
                          "across_nodes": across["pull_fit"]["fixed_ms"]},
        "pull_bandwidth_gb_s": {"within_node": within["pull_fit"]["bandwidth_gb_s"],
                                "across_nodes": across["pull_fit"]["bandwidth_gb_s"]},
        "crossover_history": {"within_node": within["crossover_history"],
                              "across_nodes": across["crossover_history"]},
        "seconds": round(time.monotonic() - started),
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if args.out == "-":
        print(json.dumps(result, indent=2))
        return
    write_result(args.out, result)
    print(json.dumps({k: result[k] for k in ("pull_fixed_ms", "pull_bandwidth_gb_s", "crossover_history")}),
          "written", args.out)


if __name__ == "__main__":
    main()
