"""How much slower a prefill runs while another engine of the node decodes: the figure the planner's slowdown per
busy peer stands for, measured directly beside what the cost model learned.

    python -m benchmarks.contention --out benchmarks/results/contention.json [--repeats 2]

On the default app: forced recomputes of 256 and 1024 random tokens on one replica through the ingress's `turn`
handle (one output token, so the time to first token is the prefill and the request path), four of each, while
the other replica decodes 0, 1 or 4 streams of 400 tokens, started a second before. Those turns also teach the
cost model (they have their engine to itself), so `fit_after` shows what these samples alone make of it.
Keys: `ttft_ms` (median per case), `slowdown` (per length and streams: median TTFT over the idle-peer median),
`calibrated` (the cost model's contention fit after the start-up calibration), `fit_after`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
from pathlib import Path
from typing import Any

from actors.replica_api import Sampling
from benchmarks.common import start_app, stop_app, write_result

LENGTHS = (256, 1024)
PEER_STREAMS = (0, 1, 4)
PER_CASE = 4


async def run(app: Any, measured: str, busy: str, repeats: int) -> dict[str, Any]:
    calibrated = (await app.ingress.calibrated.remote())["contention"]
    rng = random.Random(1)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, app.vocab_size) for _ in range(n)]

    one = Sampling(max_tokens=1, temperature=0.0, ignore_eos=True)
    long = Sampling(max_tokens=400, temperature=0.0, ignore_eos=True)
    times: dict[str, list[float]] = {}
    for _ in range(repeats):
        for streams in PEER_STREAMS:
            background = [app.ingress.turn.remote(tokens(64), long, ("recompute", busy), tenant="peer")
                          for _ in range(streams)]
            if streams:
                await asyncio.sleep(1.0)  # the peer's prefills are done: it decodes
            for n in LENGTHS:
                for _ in range(PER_CASE):
                    result = await app.ingress.turn.remote(tokens(n), one, ("recompute", measured), tenant="probe")
                    times.setdefault(f"{streams}_{n}", []).append(result.ttft_ms)
            for handle in background:
                await handle
    medians = {key: round(statistics.median(v), 1) for key, v in times.items()}
    return {
        "measured_replica": measured,
        "busy_replica": busy,
        "ttft_ms": {f"peer_streams_{s}": {str(n): medians[f"{s}_{n}"] for n in LENGTHS} for s in PEER_STREAMS},
        "slowdown": {f"peer_streams_{s}": {str(n): round(medians[f"{s}_{n}"] / medians[f"0_{n}"], 3) for n in LENGTHS}
                     for s in PEER_STREAMS if s},
        "calibrated": calibrated,
        "fit_after": (await app.ingress.stats.remote())["cost_model"]["contention"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    app = start_app()
    try:
        measured, busy = app.replica_ids(2)[:2]
        figures = asyncio.run(run(app, measured, busy, args.repeats))
    finally:
        stop_app(app)
    write_result(args.out, figures)
    print(json.dumps({k: v for k, v in figures.items() if k != "fit_after"}, indent=2))
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
