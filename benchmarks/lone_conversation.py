"""One conversation alone on an idle fleet: does the planner keep it where its history is, and how close are its
TTFT estimates to what the turns then take?

    python -m benchmarks.lone_conversation --out benchmarks/results/lone_conversation.json [--turns 6]

Each turn resends the whole history (an 800-token opening, then each reply and 40 new tokens) through the
ingress's `turn` handle, after a second of quiet, and records the plan (mode, replica, every estimate) beside
the measured time to first token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from pathlib import Path
from typing import Any

from actors.replica_api import Sampling
from benchmarks.common import machine, start_app, stop_app, write_result


async def run(app: Any, turns: int) -> dict[str, Any]:
    await app.ingress.calibrated.remote()
    rng = random.Random(3)
    history = [rng.randrange(100, app.vocab_size) for _ in range(800)]
    sampling = Sampling(max_tokens=32, temperature=0.0, ignore_eos=True)
    rows = []
    for turn in range(turns):
        await asyncio.sleep(1.0)
        result = await app.ingress.turn.remote(history, sampling)
        plan = result.kvrelay
        rows.append({"turn": turn, "mode": plan.mode, "replica": plan.replica, "holder": plan.holder,
                     "reused_tokens": plan.reused_tokens, "estimates_ms": plan.estimates_ms,
                     "predicted_ms": plan.estimates_ms.get(plan.mode), "ttft_ms": round(result.ttft_ms, 1)})
        print(json.dumps(rows[-1]), flush=True)
        history = history + result.token_ids + [rng.randrange(100, app.vocab_size) for _ in range(40)]
    later = rows[1:]  # the first turn has nothing to reuse
    errors = [abs(r["predicted_ms"] - r["ttft_ms"]) / r["ttft_ms"] for r in later if r["predicted_ms"]]
    return {
        "turns": rows,
        "pulls": sum(r["mode"] == "pull" for r in later),
        "replicas_used": sorted({r["replica"] for r in later}),
        "mean_abs_error_vs_measured": round(sum(errors) / len(errors), 3) if errors else None,
        "cost_model": (await app.ingress.stats.remote())["cost_model"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--turns", type=int, default=6)
    args = parser.parse_args()
    app = start_app()
    try:
        figures = asyncio.run(run(app, args.turns)) | {"machine": machine()}
    finally:
        stop_app(app)
    write_result(args.out, figures, default=float)
    print(json.dumps({k: v for k, v in figures.items() if k != "turns"}, indent=2, default=float))


if __name__ == "__main__":
    main()
