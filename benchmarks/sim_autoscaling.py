"""Autoscaling of the engine pool under a load ramp, on simulated replicas: from 2 replicas to 8 and back.

    python -m benchmarks.sim_autoscaling --out benchmarks/results/sim_autoscaling.json

kvrelay's autoscaling policy (`app/autoscaling.py`, run by Serve's controller on the replicas' reported ongoing
requests, KV cache usage and TTFT) scales a pool of simulated H100 replicas (`--dilation` real seconds per modelled
second) while closed-loop clients run turns of a fixed length through the real ingress: a few clients, then many
(more than 8 replicas at the target would take), then a few again. The schedule, prompts and reply lengths are fixed
by the seed; the pool's size is sampled from Serve every half second, beside the replicas the ingress's mirror sees.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from pathlib import Path
from typing import Any

from benchmarks.common import start_app, stop_app, write_result
from benchmarks.control_plane import MemoryGuard, exit_on_sigterm

SIM_PROFILE = "h100-llama-3.1-8b"
MODEL = "tiny-llama"
MIN_REPLICAS, MAX_REPLICAS = 2, 8
TARGET_ONGOING = 4.0
# (seconds, clients): the ramp. The last phase ends early once the pool is back at its minimum for a while.
RAMP = ((20.0, 4), (45.0, 48), (90.0, 4))


def running_replicas() -> int:
    from ray import serve

    states = serve.status().applications["bench"].deployments["engines"].replica_states
    return int(states.get("RUNNING", 0))


async def ramp(app: Any, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    reply = {"max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True}
    phase = {"clients": 0, "index": 0}
    counts = {"turns": 0, "errors": 0}
    timeline: list[tuple[float, int, int, int]] = []
    started = time.monotonic()
    done = asyncio.Event()

    async def client(k: int) -> None:
        while not done.is_set():
            if k >= phase["clients"]:
                await asyncio.sleep(0.2)
                continue
            prompt = [rng.randrange(40, 1000) for _ in range(args.prompt_tokens)]
            try:
                await app.ingress.turn.remote(prompt, reply)
                counts["turns"] += 1
            except Exception as exc:  # a turn lost to a scale-down is what this run watches for
                counts["errors"] += 1
                print(f"turn failed: {exc!r}"[:300], flush=True)

    async def sample() -> None:
        settled_since = None
        for index, (seconds, clients) in enumerate(RAMP):
            phase.update(clients=clients, index=index)
            phase_end = time.monotonic() + seconds
            while time.monotonic() < phase_end:
                seen = len((await app.ingress.stats.remote())["replicas"])
                running = running_replicas()
                timeline.append((round(time.monotonic() - started, 1), index, running, seen))
                last = index == len(RAMP) - 1
                if last and running == MIN_REPLICAS and timeline[-1][0] > 15 + phase_start(timeline, index):
                    settled_since = settled_since or time.monotonic()
                    if time.monotonic() - settled_since > 3:
                        break
                await asyncio.sleep(0.5)
        done.set()

    await asyncio.gather(sample(), *(client(k) for k in range(max(c for _, c in RAMP))))
    return {"timeline": timeline, **counts, "seconds": round(time.monotonic() - started, 1)}


def phase_start(timeline: list[tuple[float, int, int, int]], index: int) -> float:
    return next(t for t, i, _, _ in timeline if i == index)


def summary(timeline: list[tuple[float, int, int, int]]) -> dict[str, Any]:
    """When the pool reached its maximum after the ramp up, and its minimum after the ramp down."""
    up, down = phase_start(timeline, 1), phase_start(timeline, 2)
    reached_max = next((t for t, i, n, _ in timeline if i >= 1 and n >= MAX_REPLICAS), None)
    back_to_min = next((t for t, i, n, _ in timeline if i == 2 and n <= MIN_REPLICAS), None)
    return {"replicas_before_ramp": max(n for _, i, n, _ in timeline if i == 0),
            "max_replicas_seen": max(n for _, _, n, _ in timeline),
            "s_to_max_after_ramp_up": round(reached_max - up, 1) if reached_max is not None else None,
            "s_to_min_after_ramp_down": round(back_to_min - down, 1) if back_to_min is not None else None,
            "final_replicas": timeline[-1][2]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dilation", type=float, default=1.0)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=600, help="each turn's reply: ~4 s at H100 decode speed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-free-gib", type=float, default=3.0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/sim_autoscaling.json"))
    args = parser.parse_args(argv)
    exit_on_sigterm()
    scaling = {"min_replicas": MIN_REPLICAS, "max_replicas": MAX_REPLICAS, "target_ongoing_requests": TARGET_ONGOING,
               "upscale_delay_s": 2.0, "downscale_delay_s": 10.0, "metrics_interval_s": 0.5,
               "look_back_period_s": 3.0}
    engine = {"kind": "sim", "sim_profile": SIM_PROFILE, "sim_dilation": args.dilation, "max_model_len": 4096}
    guard = MemoryGuard(int(args.min_free_gib * 2**30))
    app = start_app(model=MODEL, num_replicas=MIN_REPLICAS,
                    pool={"num_cpus": 0.05, "autoscaling": scaling, "engine": engine}, app={"ingress_num_cpus": 0.1})
    try:
        app.ingress.calibrated.remote().result(timeout_s=300)
        run = asyncio.run(ramp(app, args))
    finally:
        guard.stop()
        stop_app(app)
    result = {
        **summary(run["timeline"]),
        "turns": run["turns"], "turn_errors": run["errors"], "seconds": run["seconds"],
        "setup": {"profile": SIM_PROFILE, "time_dilation": args.dilation, "ramp_s_clients": RAMP,
                  "autoscaling": scaling, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                  "seed": args.seed},
        "timeline_columns": ["s", "phase", "serve_running_replicas", "replicas_in_ingress_mirror"],
        "timeline": run["timeline"],
        "machine_memory_gib": {"peak_used": round(guard.peak_used / 2**30, 2)},
    }
    print({k: v for k, v in result.items() if k not in ("timeline", "setup")}, flush=True)
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
