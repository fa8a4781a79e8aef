"""The request path's latency beside two busy engines: engines at the request path's CPU priority, against the lower
one kvrelay gives them (`engine.engine_nice`, 19).

    python -m benchmarks.engine_priority --out benchmarks/results/engine_priority.json [--blocks 12]

The default app in Ray Serve's throughput-optimized mode (as `make serve`). In each block both replicas decode two
200-token streams (started through the ingress's `turn` handle) while this driver sends ten pairs, 50 ms apart:
`GET /v1/models`, answered by the ingress replica itself (no engine work: how soon the request path gets a core),
and a 1-token completion of a cached prompt (the request path plus a wait for a decode step of a busy engine).
Blocks alternate the engines' nice value between the request path's (the replica processes', Ray's worker nice)
and `engine_nice`, so both arms see the same machine. Lowering a nice value back needs root or CAP_SYS_NICE.
Keys: `request_path_nice`, `engine_nice`, `arms` (per nice value: `models_ms` and `completion_ms`, p50 / p90 / n),
`models_p50_ratio` and `completion_p50_ratio` (lower engine priority over equal).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from actors.replica_api import Sampling
from actors.vllm_engine import engine_threads
from benchmarks.common import start_app, stop_app, write_result

PAIRS_PER_BLOCK = 10
STREAMS_PER_ENGINE = 2


def set_nice(pids: list[int], nice: int) -> None:
    """Every thread of the engine processes `pids` at `nice`, up or down."""
    for tid in engine_threads(pids):
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:
            continue


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"p50": round(statistics.median(ordered), 2), "p90": round(ordered[int(0.9 * (len(ordered) - 1))], 2),
            "n": len(ordered)}


async def run(app: Any, identities: list[Any], blocks: int) -> dict[str, Any]:
    engine_pids = [pid for identity in identities for pid in identity.engine_pids]
    low = psutil.Process(engine_pids[0]).nice()  # as the replica started it: kvrelay's engine_nice
    equal = psutil.Process(identities[0].pid).nice()  # the replica actors', the request path's
    rng = random.Random(0)
    decode = Sampling(max_tokens=200, temperature=0.0, ignore_eos=True)
    arms: dict[int, dict[str, list[float]]] = {equal: {"models": [], "completion": []},
                                               low: {"models": [], "completion": []}}
    body = {"model": app.model, "prompt": "Hello there, how are you today? " * 4, "max_tokens": 1}
    async with httpx.AsyncClient(base_url=app.direct_url, timeout=60) as client:
        for _ in range(3):  # the prompt is cached everywhere it lands
            (await client.post("/v1/completions", json=body)).raise_for_status()
        for block in range(blocks):
            nice = equal if block % 2 == 0 else low
            try:
                set_nice(engine_pids, nice)
            except PermissionError as exc:
                raise SystemExit("lowering the engines' nice value back needs root or CAP_SYS_NICE") from exc
            busy = [app.ingress.turn.remote([rng.randrange(100, app.vocab_size) for _ in range(64)], decode,
                                            ("recompute", identity.replica_id), tenant="busy")
                    for identity in identities for _ in range(STREAMS_PER_ENGINE)]
            await asyncio.sleep(1.5)  # their prefills are done: both engines decode
            for _ in range(PAIRS_PER_BLOCK):
                started = time.perf_counter()
                (await client.get("/v1/models")).raise_for_status()
                arms[nice]["models"].append((time.perf_counter() - started) * 1e3)
                await asyncio.sleep(0.05)
                started = time.perf_counter()
                (await client.post("/v1/completions", json=body)).raise_for_status()
                arms[nice]["completion"].append((time.perf_counter() - started) * 1e3)
                await asyncio.sleep(0.05)
            for response in busy:
                await response
    set_nice(engine_pids, low)
    figures = {str(nice): {f"{kind}_ms": summary(values) for kind, values in arm.items()} for nice, arm in arms.items()}
    return {
        "request_path_nice": equal,
        "engine_nice": low,
        "arms": figures,
        "models_p50_ratio": round(figures[str(low)]["models_ms"]["p50"] / figures[str(equal)]["models_ms"]["p50"], 3),
        "completion_p50_ratio": round(
            figures[str(low)]["completion_ms"]["p50"] / figures[str(equal)]["completion_ms"]["p50"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--blocks", type=int, default=12)
    args = parser.parse_args()
    app = start_app(throughput_optimized=True)
    try:
        from ray import serve

        directory = serve.get_deployment_handle("kv_directory", app_name="bench")
        identities = sorted(directory.replica_identities.remote().result(), key=lambda i: i.replica_id)
        figures = asyncio.run(run(app, identities, args.blocks))
    finally:
        stop_app(app)
    write_result(args.out, figures)
    print(json.dumps(figures, indent=2))
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
