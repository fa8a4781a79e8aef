"""A steady multi-turn load for a long while: does anything grow that should not?

    python -m benchmarks.soak --minutes 30 --out benchmarks/results/soak.json [--clients 3] [--model tiny-llama]

Client threads hold conversations over HTTP (a 200-token opening, then each reply and 30 new tokens, a new
conversation past 1,500 tokens), with the planner choosing every turn. Once a minute it records the resident memory
of every process of the app (Serve replicas by deployment, vLLM engine processes, Ray's own), the KV directory's
entries and bytes, and each replica's KV cache use; vLLM's engine processes' memory also by what backs it
(anonymous, library file pages, shared memory). After a warm-up of a fifth of the run it fits a line to each
series: `growth_pct` is that line's rise over the rest of the run, relative to its mean. Errors are any turn without
a correct-looking answer (a status other than 200, or fewer tokens than asked).
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import httpx
import psutil

from benchmarks.common import BenchApp, start_app, stop_app, write_result

TOKENS = 32


def process_kind(proc: psutil.Process) -> str | None:
    """Which part of the app a process is, by the names Ray and vLLM give them; None if none."""
    try:
        name, cmdline = proc.name(), " ".join(proc.cmdline())
    except psutil.Error:
        return None
    if name.startswith("VLLM::"):
        return "vllm_engine"
    for deployment in ("ingress", "kv_directory", "engines"):
        if f"ServeReplica:bench:{deployment}" in cmdline:
            return f"serve_{deployment}"
    if "ServeController" in cmdline or "ProxyActor" in cmdline:
        return "serve_system"
    if "gcs_server" in cmdline or "raylet" in cmdline:
        return "ray_system"
    return None


def resident_split_mib(pid: int) -> dict[str, float]:
    """A process's resident MiB by what backs it (/proc/PID/status): anonymous memory (heaps, tensors), file
    pages (code and data of the libraries it has touched) and shared memory."""
    split = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            for kind in ("anon", "file", "shmem"):
                if line.startswith(f"Rss{kind.capitalize()}:"):
                    split[kind] = int(line.split()[1]) / 1024
    return split


def memory_by_kind() -> tuple[dict[str, float], dict[str, float]]:
    """Resident MiB summed per kind of process, and vLLM's engine processes' resident MiB by what backs it."""
    totals: dict[str, float] = defaultdict(float)
    engine_split: dict[str, float] = defaultdict(float)
    for proc in psutil.Process().children(recursive=True):  # this run's cluster only, not another one beside it
        kind = process_kind(proc)
        if kind is not None:
            try:
                totals[kind] += proc.memory_info().rss / 2**20
                if kind == "vllm_engine":
                    for backing, mib in resident_split_mib(proc.pid).items():
                        engine_split[backing] += mib
            except (psutil.Error, OSError):
                pass
    return dict(totals), dict(engine_split)


def growth_pct(values: list[float]) -> float | None:
    """The least-squares line's rise from the first to the last sample, as % of the mean."""
    n = len(values)
    if n < 3:
        return None
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    sxx = sum((x - mean_x) ** 2 for x in range(n))
    slope = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values)) / sxx
    return round(100 * slope * (n - 1) / mean_y, 2) if mean_y else None


def growth_by_series(samples: list[dict[str, Any]]) -> dict[str, float | None]:
    """growth_pct of each process kind's RSS, of their total, and of the directory's bytes over `samples`."""
    kinds = sorted({k for s in samples for k in s["rss_mib"]})
    growth = {f"rss_{k}": growth_pct([s["rss_mib"].get(k, 0.0) for s in samples]) for k in kinds}
    growth["rss_total"] = growth_pct([sum(s["rss_mib"].values()) for s in samples])
    for backing in sorted({k for s in samples for k in s.get("vllm_engine_rss_by_backing_mib", {})}):
        growth[f"rss_vllm_engine_{backing}"] = growth_pct(
            [s["vllm_engine_rss_by_backing_mib"].get(backing, 0.0) for s in samples])
    growth["directory_bytes"] = growth_pct([float(s["directory_bytes"]) for s in samples])
    return growth


def growth_figures(samples: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Growth after a warm-up of a fifth of the run, and over its second half: a cache that fills once (vLLM's
    prefix cache reaching its size, the directory following it) is a step inside the first, not in the second."""
    return {"growth_pct_after_warmup": growth_by_series(samples[max(1, len(samples) // 5):]),
            "growth_pct_second_half": growth_by_series(samples[len(samples) // 2:])}


def soak(app: BenchApp, minutes: float, clients: int) -> dict[str, Any]:
    stop = threading.Event()
    counts: Counter = Counter()
    rng_lock = threading.Lock()
    rng = random.Random(11)

    def tokens(n: int) -> list[int]:
        with rng_lock:
            return [rng.randrange(100, app.vocab_size) for _ in range(n)]

    def converse() -> None:
        history = tokens(200)
        with httpx.Client(base_url=app.base_url, timeout=120) as client:
            while not stop.is_set():
                body = {"model": app.model, "prompt": history, "max_tokens": TOKENS, "temperature": 0,
                        "ignore_eos": True, "return_token_ids": True}
                try:
                    resp = client.post("/v1/completions", json=body)
                    reply = resp.json()["choices"][0]["token_ids"] if resp.status_code == 200 else []
                except (httpx.HTTPError, ValueError, KeyError):
                    reply = []
                if len(reply) != TOKENS:
                    counts["errors"] += 1
                    time.sleep(1.0)
                    continue
                counts["turns"] += 1
                history = history + reply + tokens(30)
                if len(history) > 1500:
                    history = tokens(200)

    threads = [threading.Thread(target=converse, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    samples = []
    started = time.monotonic()
    try:
        for minute in range(int(minutes) + 1):
            time.sleep(max(0.0, started + 60 * minute - time.monotonic()))
            stats = app.ingress.stats.remote().result(timeout_s=60)
            rss, engine_split = memory_by_kind()
            sample = {"minute": minute, "turns": counts["turns"], "errors": counts["errors"],
                      "rss_mib": {k: round(v, 1) for k, v in sorted(rss.items())},
                      "vllm_engine_rss_by_backing_mib": {k: round(v, 1) for k, v in sorted(engine_split.items())},
                      "directory_entries": stats["directory"]["entries"],
                      "directory_bytes": stats["directory"]["bytes"],
                      "directory_holds": stats["directory"]["holds"],
                      "kv_cache_usage": {r["replica_id"]: round(r["kv_cache_usage"], 3) for r in stats["replicas"]}}
            samples.append(sample)
            print(json.dumps(sample), flush=True)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=150)
    return {"minutes": minutes, "clients": clients, "model": app.model, "turns": counts["turns"],
            "errors": counts["errors"], **growth_figures(samples), "samples": samples}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    app = start_app(args.model, dtype="float32", max_model_len=2048, kv_cache_memory_bytes=64 * 1024**2)
    try:
        app.ingress.calibrated.remote().result(timeout_s=300)
        figures = soak(app, args.minutes, args.clients)
    finally:
        stop_app(app)
    write_result(args.out, figures)
    print(json.dumps({k: v for k, v in figures.items() if k != "samples"}, indent=2))


if __name__ == "__main__":
    main()
