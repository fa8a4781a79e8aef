"""Engine replica benchmark: start time, memory and token rates of the default model, and fast-prefill TTFT.

    python -m benchmarks.engine --out benchmarks/results/engine.json [--quick]

Fast prefill is measured on a Gemma3n-shaped model (random weights; speed does not depend on them) with
the flag on and off, both engines alive, requests alternating, prefix caching off, in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
import uuid
from pathlib import Path

import psutil

from actors.engine_replica import EngineReplica
from actors.replica_api import GenerateRequest, Sampling
from benchmarks.common import write_result
from configs.engine import EngineConfig, NixlSettings
from configs.models import DEFAULT_MODEL, get_preset

MiB = 1024**2


def tree_rss_mib(baseline_self: int) -> float:
    """RSS of the engine's processes: this process's growth plus every child vLLM started."""
    me = psutil.Process()
    children = sum(p.memory_info().rss for p in me.children(recursive=True))
    return (me.memory_info().rss - baseline_self + children) / MiB


async def run_once(replica: EngineReplica, prompt_ids: list[int], max_tokens: int) -> tuple[float, float, int]:
    """(seconds to first token, seconds from first to last token, completion tokens)."""
    request = GenerateRequest(
        request_id=uuid.uuid4().hex,
        prompt_token_ids=prompt_ids,
        params=Sampling(max_tokens=max_tokens, ignore_eos=True).to_params(),
    )
    start = time.perf_counter()
    first = None
    tokens = 0
    async for delta in replica.generate(request):
        if first is None and delta.token_ids:
            first = time.perf_counter()
        tokens += len(delta.token_ids)
    end = time.perf_counter()
    return first - start, end - first, tokens


def random_prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    # Skip the lowest ids, where tokenizers keep special tokens.
    return [rng.randrange(16, vocab) for _ in range(n)]


async def default_model_figures(reps: int) -> dict:
    baseline = psutil.Process().memory_info().rss
    start = time.perf_counter()
    replica = EngineReplica(
        EngineConfig(model=DEFAULT_MODEL, max_model_len=4096, nixl=NixlSettings(enabled=True))
    )
    start_s = time.perf_counter() - start
    try:
        vocab = replica.engine.get_tokenizer().vocab_size
        rng = random.Random(0)
        await run_once(replica, random_prompt(rng, vocab, 64), 4)  # warm-up
        prefill, decode = [], []
        for _ in range(reps):
            n = 1024
            ttft, _, _ = await run_once(replica, random_prompt(rng, vocab, n), 1)
            prefill.append(n / ttft)
            _, decode_s, tokens = await run_once(replica, random_prompt(rng, vocab, 32), 129)
            decode.append((tokens - 1) / decode_s)
        rss = tree_rss_mib(baseline)
    finally:
        replica.engine.shutdown()
    return {
        "start_s": round(start_s, 2),
        "rss_mib": round(rss, 1),
        "prefill_tok_s": round(statistics.median(prefill), 1),
        "decode_tok_s": round(statistics.median(decode), 1),
        "prefill_prompt_tokens": 1024,
        "decode_tokens": 128,
    }


async def fast_prefill_figures(lengths: list[int], reps: int) -> dict:
    def config(fast: bool, core: int) -> EngineConfig:
        return EngineConfig(
            model="gemma3n-bench",
            dtype="float32",
            max_model_len=max(lengths) + 64,
            kv_cache_memory_bytes=512 * MiB,
            enable_prefix_caching=False,
            kv_sharing_fast_prefill=fast,
            max_num_batched_tokens=max(lengths) + 64,
            nixl=NixlSettings(enabled=False),
            cpu_core_offset=core,
        )

    on = EngineReplica(config(True, 0))
    off = EngineReplica(config(False, 1))
    try:
        vocab = on.engine.get_tokenizer().vocab_size
        rng = random.Random(1)
        for replica in (on, off):
            await run_once(replica, random_prompt(rng, vocab, 128), 1)
        ttft: dict[int, dict[str, list[float]]] = {n: {"on": [], "off": []} for n in lengths}
        for n in lengths:
            for _ in range(reps):
                prompt = random_prompt(rng, vocab, n)
                # The same prompt on both, in alternating order, so drift on the shared box cancels out.
                pair = [("on", on), ("off", off)] if len(ttft[n]["on"]) % 2 == 0 else [("off", off), ("on", on)]
                for name, replica in pair:
                    ttft[n][name].append((await run_once(replica, prompt, 1))[0])
            print(f"  fast prefill, {n} tokens: on {statistics.median(ttft[n]['on']) * 1e3:.0f} ms, "
                  f"off {statistics.median(ttft[n]['off']) * 1e3:.0f} ms", flush=True)
    finally:
        on.engine.shutdown()
        off.engine.shutdown()
    return {
        "fast_prefill_ttft_ms": {
            str(n): {k: round(statistics.median(v) * 1e3, 1) for k, v in ttft[n].items()} for n in lengths
        },
        "fast_prefill_ttft_ratio": {
            str(n): round(statistics.median(ttft[n]["off"]) / statistics.median(ttft[n]["on"]), 3)
            for n in lengths
        },
    }


async def main_async(args: argparse.Namespace) -> dict:
    reps = 2 if args.quick else 5
    print(f"default model {DEFAULT_MODEL}: start, memory, prefill and decode rates", flush=True)
    figures = {"model": DEFAULT_MODEL, "cpu_count": os.cpu_count()}
    figures |= await default_model_figures(reps)
    print(json.dumps(figures), flush=True)
    print(f"fast prefill on vs off on gemma3n-bench ({get_preset('gemma3n-bench').description})", flush=True)
    figures |= await fast_prefill_figures([512, 1024, 2048, 4096], reps)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    figures = asyncio.run(main_async(args))
    write_result(args.out, figures)
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
