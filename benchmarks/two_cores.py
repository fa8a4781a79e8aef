"""What this machine's two cores give two processes at once: the ceiling under `benchmarks.scaling`'s
`scaling_2_vs_1`.

    python -m benchmarks.two_cores --out benchmarks/results/two_cores.json

Three kernels, each run for `--seconds` in one process pinned to core 0, then in two processes pinned to cores 0
and 1 at the same time; the figure is the two processes' work together over one process's alone (2.0: the cores
are independent for that kind of work, 1.0: they share it completely):

- `compute`: fp32 matrix products on 128x128 matrices (fit in the core's own caches);
- `weights`: what a decode step does: a bf16 matrix-vector product of a batch of 8 over a weight matrix of the
  model's size (SmolLM2-135M, about 270 MB in bf16), read once per step;
- `stream`: summing a 1 GiB fp32 tensor (memory bandwidth).

torch runs one thread per process, as a replica's engine does on its core.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from typing import Any

from benchmarks.common import write_result

WEIGHT_PARAMS = 135_000_000
DECODE_BATCH = 8


def _work(kind: str, core: int, seconds: float, start: Any, out: Any) -> None:
    import torch

    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    if kind == "compute":
        a, b = torch.randn(128, 128), torch.randn(128, 128)

        def step() -> None:
            torch.mm(a, b)
    elif kind == "weights":
        rows = 4096
        w = torch.randn(WEIGHT_PARAMS // rows, rows, dtype=torch.bfloat16)
        x = torch.randn(rows, DECODE_BATCH, dtype=torch.bfloat16)

        def step() -> None:
            torch.mm(w, x)
    else:
        t = torch.ones(256 * 1024**2)

        def step() -> None:
            t.sum()
    step()  # warm (allocations, first touch)
    start.wait()
    done, began = 0, time.perf_counter()
    while time.perf_counter() - began < seconds:
        step()
        done += 1
    out.put(done / (time.perf_counter() - began))


def rate(kind: str, cores: list[int], seconds: float) -> list[float]:
    """Steps per second of each process, all started together."""
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_work, args=(kind, c, seconds, start, out)) for c in cores]
    for p in procs:
        p.start()
    time.sleep(5.0)  # every process has built its tensors and warmed up
    start.set()
    rates = [out.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join()
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))[:2]
    result: dict[str, Any] = {"cores": cores, "seconds": args.seconds, "kernels": {}}
    for kind in ("compute", "weights", "stream"):
        alone = rate(kind, cores[:1], args.seconds)[0]
        both = rate(kind, cores, args.seconds)
        result["kernels"][kind] = {
            "alone_steps_s": round(alone, 2), "two_at_once_steps_s": [round(r, 2) for r in both],
            "two_vs_one": round(sum(both) / alone, 3),
        }
        print(f"{kind:8s} one process {alone:9.2f}/s  two at once {both[0]:9.2f} + {both[1]:9.2f}/s  "
              f"together {sum(both) / alone:.2f}x one", flush=True)
    write_result(args.out, result)


if __name__ == "__main__":
    main()
