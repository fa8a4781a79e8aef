"""How many streamed tokens per second one ingress replica carries, at GPU decode speed: simulated H100 replicas at
their modelled speed (time dilation 1) behind one ingress replica, then behind two (each with its own mirror).

    python -m benchmarks.ingress_capacity --out benchmarks/results/ingress_capacity.json

Streams are OpenAI completions through the ingress's handle API with `stream: true` (the chunks SSE would carry,
without the HTTP proxy's hop), many at once, each a fresh prompt and a long reply. The engines could decode far more
than this machine's two cores can forward, so what is measured is the ingress side: tokens and chunks delivered per
second, and the ingress replicas' CPU seconds over the window, whose ratio is the capacity of one ingress core.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from pathlib import Path
from typing import Any

from benchmarks.common import start_app, stop_app, write_result
from benchmarks.control_plane import MemoryGuard, actor_pids, cpu_s, exit_on_sigterm

SIM_PROFILE = "h100-llama-3.1-8b"
MODEL = "tiny-llama"


async def stream(app: Any, prompt: list[int], max_tokens: int, window: dict[str, float], counts: dict[str, float]) \
        -> None:
    """One streamed completion; counts its chunks inside the window, and its tokens there (its usage's tokens shared
    evenly over its chunks: a chunk carries what the replica generated since the last one, almost always one)."""
    request = {"model": app.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
               "temperature": 0.0, "stream_options": {"include_usage": True}}
    chunks, inside, tokens = 0, 0, 0
    async for chunk in app.ingress.options(stream=True).completions.remote(request):
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        if not chunk.get("choices"):
            continue
        chunks += 1
        inside += window["start"] <= time.monotonic() < window["end"]
    counts["chunks"] += inside
    counts["tokens"] += tokens * inside / chunks if chunks else 0


async def drive(app: Any, args: argparse.Namespace, ingress_pids: list[int]) -> dict[str, Any]:
    rng = random.Random(args.seed)
    now = time.monotonic()
    window = {"start": now + args.warmup_s, "end": now + args.warmup_s + args.window_s}
    counts = {"chunks": 0.0, "tokens": 0.0, "requests": 0.0}
    cpu: dict[str, float] = {}

    async def client() -> None:
        while time.monotonic() < window["end"]:
            prompt = [rng.randrange(40, 1000) for _ in range(args.prompt_tokens)]
            await stream(app, prompt, args.max_tokens, window, counts)
            counts["requests"] += 1

    engine_pids = actor_pids("engines")

    def cpu_now() -> dict[str, float]:
        return {"ingress": sum(cpu_s(p) for p in ingress_pids), "engines": sum(cpu_s(p) for p in engine_pids),
                "driver": time.process_time()}

    async def sample_cpu() -> None:
        await asyncio.sleep(max(0.0, window["start"] - time.monotonic()))
        start = cpu_now()
        await asyncio.sleep(max(0.0, window["end"] - time.monotonic()))
        cpu.update({k: v - start[k] for k, v in cpu_now().items()})

    await asyncio.gather(sample_cpu(), *(client() for _ in range(args.streams)))
    ingress_cpu_s = cpu["ingress"]
    return {"tokens_per_s": round(counts["tokens"] / args.window_s), "chunks_per_s": round(counts["chunks"] /
                                                                                           args.window_s),
            "ingress_cpu_s_per_s": round(ingress_cpu_s / args.window_s, 2),
            # Where the machine's other cores went: the simulated replicas (a delta per token each) and this driver.
            "engines_cpu_s_per_s": round(cpu["engines"] / args.window_s, 2),
            "driver_cpu_s_per_s": round(cpu["driver"] / args.window_s, 2),
            "tokens_per_ingress_cpu_s": round(counts["tokens"] / ingress_cpu_s) if ingress_cpu_s > 0 else None,
            "requests_finished": int(counts["requests"])}


def measure(ingress_replicas: int, args: argparse.Namespace, guard: MemoryGuard) -> dict[str, Any]:
    engine = {"kind": "sim", "sim_profile": SIM_PROFILE, "sim_dilation": 1.0, "max_model_len": 4096}
    app = start_app(model=MODEL, num_replicas=args.replicas, pool={"num_cpus": 0.05, "engine": engine},
                    app={"ingress_num_cpus": 0.1, "ingress_max_turns": 4 * args.streams},
                    ingress_replicas=ingress_replicas)
    try:
        app.ingress.calibrated.remote().result(timeout_s=300)
        guard.check()
        pids = actor_pids("ingress")
        if len(pids) != ingress_replicas:
            raise RuntimeError(f"{len(pids)} ingress replicas running, {ingress_replicas} asked")
        figures = asyncio.run(drive(app, args, pids))
    finally:
        stop_app(app)
    figures["tokens_per_s_per_ingress_replica"] = round(figures["tokens_per_s"] / ingress_replicas)
    print(f"{ingress_replicas} ingress replica(s): {figures}", flush=True)
    return {"ingress_replicas": ingress_replicas, **figures}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--ingress-replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--streams", type=int, default=64, help="streams in flight at once")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--warmup-s", type=float, default=5)
    parser.add_argument("--window-s", type=float, default=20)
    parser.add_argument("--min-free-gib", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/ingress_capacity.json"))
    args = parser.parse_args(argv)
    exit_on_sigterm()
    guard = MemoryGuard(int(args.min_free_gib * 2**30))
    try:
        runs = [measure(n, args, guard) for n in args.ingress_replicas]
    finally:
        guard.stop()
    result = {
        "runs": runs,
        "setup": {"profile": SIM_PROFILE, "time_dilation": 1.0, "engine_replicas": args.replicas,
                  "streams": args.streams, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                  "window_s": args.window_s, "warmup_s": args.warmup_s, "seed": args.seed,
                  "path": "Ingress.completions over a Serve handle with stream=true (no HTTP proxy)"},
        "machine_memory_gib": {"peak_used": round(guard.peak_used / 2**30, 2)},
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
