"""Do replicas scale? The same load on one engine replica, then spread over two, in one run, and the cores every
process kind uses busy, idle, and idle with holds pending.

Also one engine with half the load (4 requests): twice its rate over the 8-request rate is the most spreading the
same load over two engines could give if the two ran as if alone (`scaling_2_vs_1_ceiling`): a step for 4
requests costs most of what one for 8 does here.

    python -m benchmarks.scaling --out benchmarks/results/scaling.json [--quick] [--separate-worker]

The app runs as `serve_config.yaml` runs it (two SmolLM2 replicas, NIXL on); requests go straight to the
engine deployment with a target replica, so only the engines are measured. `--separate-worker` runs vLLM's
stock CPU layout (model in a Worker process beside EngineCore) for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
import uuid
from typing import Any

import psutil

from benchmarks.common import start_app, stop_app, write_result

PROMPT_TOKENS = 256
OUTPUT_TOKENS = 64
CONCURRENCY = 8
REPLICA_KINDS = ("replica_actor", "engine_core", "worker")


def process_kinds(identities: list[Any]) -> dict[str, list[psutil.Process]]:
    """Each replica's actor process, and the vLLM processes it started, by kind; and this driver (the load)."""
    kinds: dict[str, list[psutil.Process]] = {"replica_actor": [], "engine_core": [], "worker": [],
                                              "driver": [psutil.Process()]}
    for identity in identities:
        kinds["replica_actor"].append(psutil.Process(identity.pid))
        for pid in identity.engine_pids:
            engine_core = psutil.Process(pid)
            kinds["engine_core"].append(engine_core)
            kinds["worker"] += [c for c in engine_core.children(recursive=True) if "Worker" in c.name()]
    return kinds


def _cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _machine_busy_seconds() -> float:
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + t.steal


class CoreMeter:
    """Cores used per process kind between `start()` and `stop()` (summed over replicas), and by every process
    on the machine together (`machine`)."""

    def __init__(self, kinds: dict[str, list[psutil.Process]]) -> None:
        self.kinds = kinds

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._cpu0 = {k: _cpu_seconds(v) for k, v in self.kinds.items()}
        self._machine0 = _machine_busy_seconds()

    def stop(self) -> dict[str, float]:
        elapsed = time.monotonic() - self._t0
        used = {k: round((_cpu_seconds(v) - self._cpu0[k]) / elapsed, 3) for k, v in self.kinds.items() if v}
        return used | {"machine": round((_machine_busy_seconds() - self._machine0) / elapsed, 3)}


async def _generate(engines: Any, replica_id: str, prompt: list[int], max_tokens: int, export_hold: bool) -> int:
    from actors.replica_api import GenerateRequest, Sampling

    request = GenerateRequest(
        request_id=uuid.uuid4().hex, prompt_token_ids=prompt, target_replica=replica_id, export_hold=export_hold,
        params=Sampling(max_tokens=max_tokens, ignore_eos=True).to_params(),
    )
    tokens = 0
    async for delta in engines.options(stream=True).generate.remote(request):
        tokens += len(delta.token_ids)
    return tokens


async def run_load(engines: Any, targets: list[str], concurrency: int, rounds: int, rng: random.Random, vocab: int,
                   meter: CoreMeter) -> tuple[float, dict[str, float]]:
    """`rounds` waves of `concurrency` requests spread evenly over `targets`: (output tok/s, cores by kind)."""
    meter.start()
    started = time.monotonic()
    tokens = 0
    for _ in range(rounds):
        prompts = [[rng.randrange(100, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(concurrency)]
        done = await asyncio.gather(*[
            _generate(engines, targets[i % len(targets)], p, OUTPUT_TOKENS, False) for i, p in enumerate(prompts)
        ])
        tokens += sum(done)
    elapsed = time.monotonic() - started
    return tokens / elapsed, meter.stop()


async def idle_cores(meter: CoreMeter, seconds: float) -> dict[str, float]:
    meter.start()
    await asyncio.sleep(seconds)
    return meter.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true", help="fewer rounds and a shorter idle wait")
    parser.add_argument("--serve-mode", choices=["default", "throughput_optimized"], default="throughput_optimized",
                        help="Ray Serve's request path (as `make serve` runs it by default)")
    parser.add_argument("--separate-worker", action="store_true", help="vLLM's stock CPU layout, for comparison")
    args = parser.parse_args()
    rounds, idle_wait_s, window_s = (2, 15, 5) if args.quick else (5, 60, 10)

    app = start_app(separate_worker_process=args.separate_worker,
                    throughput_optimized=args.serve_mode == "throughput_optimized")
    try:
        from ray import serve

        directory = serve.get_deployment_handle("kv_directory", app_name="bench")
        identities = sorted(directory.replica_identities.remote().result(), key=lambda i: i.replica_id)
        ids = [i.replica_id for i in identities]
        meter = CoreMeter(process_kinds(identities))
        rng = random.Random(0)
        app.ingress.calibrated.remote().result()  # the ingress's start-up measurements use both engines

        async def campaign() -> dict[str, Any]:
            for rid in ids:  # warm both engines (first-request costs stay out of the figures)
                await _generate(app.engines, rid, [rng.randrange(100, app.vocab_size) for _ in range(64)], 4, False)
            one_tok_s, one_cores = await run_load(app.engines, ids[:1], CONCURRENCY, rounds, rng, app.vocab_size, meter)
            # Half the batch on one engine: what each of two engines runs when the same load is spread.
            half_tok_s, _ = await run_load(app.engines, ids[:1], CONCURRENCY // 2, rounds, rng, app.vocab_size, meter)
            two_tok_s, two_cores = await run_load(app.engines, ids, CONCURRENCY, rounds, rng, app.vocab_size, meter)
            # The same load per replica: twice the requests over two (same batch size per engine).
            two_full_tok_s, _ = await run_load(app.engines, ids, 2 * CONCURRENCY, rounds, rng, app.vocab_size, meter)
            await asyncio.sleep(idle_wait_s)
            idle = await idle_cores(meter, window_s)
            for rid in ids:  # one exported hold per replica, pending for its lease (nixl.hold_ttl_s)
                prompt = [rng.randrange(100, app.vocab_size) for _ in range(PROMPT_TOKENS)]
                await _generate(app.engines, rid, prompt, 8, True)
            idle_holds = await idle_cores(meter, min(window_s, 6))
            per_replica = {
                "no_holds": round(sum(idle[k] for k in REPLICA_KINDS if k in idle) / len(ids), 4),
                "holds_pending": round(sum(idle_holds[k] for k in REPLICA_KINDS if k in idle_holds) / len(ids), 4),
            }
            return {
                "layout": "separate worker process (vLLM stock)" if args.separate_worker else "model in engine core",
                "serve_mode": args.serve_mode,
                "load": {"concurrency": CONCURRENCY, "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS,
                         "rounds": rounds},
                "throughput_1_tok_s": round(one_tok_s, 1),
                "throughput_2_tok_s": round(two_tok_s, 1),
                "scaling_2_vs_1": round(two_tok_s / one_tok_s, 3),
                "throughput_1_half_batch_tok_s": round(half_tok_s, 1),
                # Two engines on independent cores, each as fast as one alone with half the batch
                # (benchmarks/two_cores.py measures how independent the cores are).
                "scaling_2_vs_1_ceiling": round(2 * half_tok_s / one_tok_s, 3),
                "throughput_2_same_load_per_replica_tok_s": round(two_full_tok_s, 1),
                "scaling_2_vs_1_same_load_per_replica": round(two_full_tok_s / one_tok_s, 3),
                "idle_cores_per_replica": max(per_replica.values()),
                "idle_cores_per_replica_detail": per_replica,
                "busy_cores_by_process": {"one_replica_loaded": one_cores, "two_replicas_loaded": two_cores},
                "idle_cores_by_process": {f"after_{idle_wait_s}s_idle": idle, "holds_pending": idle_holds},
                "targets": {"scaling_2_vs_1": ">= 1.7", "idle_cores_per_replica": "<= 0.02"},
            }

        result = asyncio.run(campaign())
    finally:
        stop_app(app)
    print(json.dumps(result, indent=2))
    write_result(args.out, result)


if __name__ == "__main__":
    main()
