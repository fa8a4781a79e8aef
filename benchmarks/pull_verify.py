"""What pull verification (`nixl.verify_pulls`, kvtransfer/kv_digest.py) costs per pulled MiB, on the default model.

    python -m benchmarks.pull_verify --out benchmarks/results/pull_verify.json [--reps 5]

Two engine replicas in this process, verification on. For each history length: the holder's cost, timed around the
digest call its replica makes at export (a CRC32 of every held block); and the reader's, as the difference in time
to first token between pulls of a hold that carries digests (checked) and of the same kind of hold without them
(not checked: the reader verifies only what a hold carries), alternating, on the same two engines.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.common import loopback_ray_env, write_result

KEY = "bench-hold-key"
MODEL = "smollm2-135m-instruct"
LENGTHS = (256, 1024, 2048, 3072)


def replica(core: int) -> Any:
    from actors.engine_replica import EngineReplica
    from configs.engine import EngineConfig, NixlSettings

    return EngineReplica(EngineConfig(
        model=MODEL, dtype="float32", max_model_len=4096, kv_cache_memory_bytes=1024**3,
        nixl=NixlSettings(hold_ttl_s=60, verify_pulls=True), cpu_core_offset=core), hold_key=KEY)


async def run(holder: Any, reader: Any, reps: int, rng: random.Random) -> list[dict[str, Any]]:
    from actors.replica_api import GenerateRequest, Sampling
    from kvtransfer.kv_digest import DIGESTS_KEY
    from kvtransfer.kv_shape import KVShape
    from model_prep.store import model_path

    shape = KVShape.from_model_dir(model_path(MODEL), "float32", holder.config.block_size)
    greedy = Sampling(max_tokens=1, temperature=0.0, ignore_eos=True).to_params()

    async def generate(replica: Any, ids: list[int], pull: Any = None) -> tuple[list[Any], float]:
        request = GenerateRequest(request_id=uuid.uuid4().hex, prompt_token_ids=ids, params=greedy, pull=pull)
        started, first, deltas = time.perf_counter(), None, []
        async for delta in replica.generate(request):
            if first is None and delta.token_ids:
                first = time.perf_counter()
            deltas.append(delta)
        return deltas, ((first or time.perf_counter()) - started) * 1e3

    async def hold_of(n: int) -> tuple[Any, list[int]]:
        prompt = [rng.randrange(100, 40000) for _ in range(n)]
        deltas, _ = await generate(holder, prompt)
        follow_up = prompt + [t for d in deltas for t in d.token_ids] + [rng.randrange(100, 40000) for _ in range(16)]
        return deltas[-1].hold, follow_up

    rows = []
    await hold_of(64)  # NIXL's handshake, outside the timings
    for n in LENGTHS:
        holder_ms, checked_ms, unchecked_ms = [], [], []
        for _ in range(reps):
            hold, follow_up = await hold_of(n)
            started = time.perf_counter()
            await holder.engine.collective_rpc("kvrelay_hold_digests", args=(hold.block_ids,))
            holder_ms.append((time.perf_counter() - started) * 1e3)
            deltas, ttft = await generate(reader, follow_up, pull=hold)
            assert deltas[-1].read_check == "verified", deltas[-1]
            checked_ms.append(ttft)
            plain, follow_plain = await hold_of(n)
            plain = replace(plain, extra={k: v for k, v in plain.extra.items() if k != DIGESTS_KEY}, seal=None)
            deltas, ttft = await generate(reader, follow_plain, pull=plain.sealed(KEY.encode(), follow_plain))
            assert deltas[-1].read_check is None and deltas[-1].num_cached_tokens == plain.num_tokens, deltas[-1]
            unchecked_ms.append(ttft)
        mib = shape.kv_bytes(n) / 2**20
        reader_ms = statistics.median(checked_ms) - statistics.median(unchecked_ms)
        holder_median = statistics.median(holder_ms)
        rows.append({
            "history_tokens": n, "pulled_mib": round(mib, 2),
            "holder_digest_ms": round(holder_median, 2),
            "pull_ttft_ms_checked": round(statistics.median(checked_ms), 2),
            "pull_ttft_ms_unchecked": round(statistics.median(unchecked_ms), 2),
            "reader_check_ms": round(reader_ms, 2),
            "holder_ms_per_mib": round(holder_median / mib, 3),
            "reader_ms_per_mib": round(reader_ms / mib, 3),
        })
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    loopback_ray_env()
    holder, reader = replica(0), replica(1)
    try:
        rows = asyncio.run(run(holder, reader, args.reps, random.Random(0)))
    finally:
        holder.engine.shutdown()
        reader.engine.shutdown()
    per_mib = [r["holder_ms_per_mib"] + r["reader_ms_per_mib"] for r in rows if r["pulled_mib"] >= 40]
    write_result(args.out, {"model": MODEL, "dtype": "float32", "reps": args.reps, "lengths": rows,
                            "ms_per_pulled_mib": round(statistics.median(per_mib), 3) if per_mib else None})


if __name__ == "__main__":
    main()
