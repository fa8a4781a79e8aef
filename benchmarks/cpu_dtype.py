"""What the engine dtype costs on this machine's CPU: the default model's prefill and decode in fp32 and in bf16,
one engine at a time, and whether the CPU computes bf16 natively (what `EngineConfig.engine_dtype` decides by).

    python -m benchmarks.cpu_dtype --out benchmarks/results/cpu_dtype.json

Each dtype, in a process of its own: one vLLM engine (eager, prefix caching off, so every prefill computes), a
warm-up prefill, then the median of `--reps` prefills of each length (max_tokens=1 on fresh token ids) and one
`--decode`-token reply of one request (less its own prompt's prefill). bf16 on a CPU without AVX512-BF16 or AMX
converts every operand; there fp32 is the faster choice.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

from benchmarks.common import machine, write_result
from configs.models import DEFAULT_MODEL
from model_prep.store import model_path


def measure(dtype: str, lengths: list[int], reps: int, decode_tokens: int) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model_path(DEFAULT_MODEL)), dtype=dtype, enforce_eager=True, max_model_len=2048,
              kv_cache_memory_bytes=256 * 1024**2, enable_prefix_caching=False)
    first = SamplingParams(max_tokens=1, temperature=0)

    def run(ids: list[int], params: Any) -> float:
        started = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        return (time.perf_counter() - started) * 1e3

    run(list(range(100, 164)), first)  # warm-up
    prefill = {str(n): round(statistics.median(run(list(range(100 + r, 100 + r + n)), first) for r in range(reps)), 1)
               for n in lengths}
    reply = SamplingParams(max_tokens=decode_tokens, temperature=0, ignore_eos=True)
    # The reply's time beyond the same prompt's first token alone (prefix caching is off: both prefill it).
    decode = run(list(range(100, 164)), reply) - run(list(range(100, 164)), first)
    return {"prefill_ms": prefill, "decode_ms_per_token": round(decode / (decode_tokens - 1), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="128,512")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--dtype", help="measure this dtype alone and print its figures (one process per engine)")
    parser.add_argument("--out")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.dtype:
        print(json.dumps(measure(args.dtype, lengths, args.reps, args.decode)))
        return
    if not args.out:
        parser.error("--out is required")
    result: dict[str, Any] = {"model": DEFAULT_MODEL, **machine(),
                              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for dtype in ("float32", "bfloat16"):
        child = subprocess.run([sys.executable, "-m", "benchmarks.cpu_dtype", "--dtype", dtype, "--lengths",
                                args.lengths, "--reps", str(args.reps), "--decode", str(args.decode)],
                               capture_output=True, text=True, check=True)
        # vLLM logs to stdout too: the figures are the last line that is a JSON object.
        result[dtype] = json.loads([line for line in child.stdout.splitlines() if line.startswith("{")][-1])
        print(dtype, json.dumps(result[dtype]), flush=True)
    longest = str(lengths[-1])
    result["bf16_over_fp32_prefill"] = round(result["bfloat16"]["prefill_ms"][longest]
                                             / result["float32"]["prefill_ms"][longest], 2)
    print(json.dumps(result, indent=2))
    write_result(args.out, result)


if __name__ == "__main__":
    main()
