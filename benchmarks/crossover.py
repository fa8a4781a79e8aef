"""Where pulling a conversation's KV beats recomputing it, measured on the real default model, and the planner's regret.

    python -m benchmarks.crossover --out benchmarks/results/crossover.json [--quick]

For each history length and new-turn delta, one run measures time to first token (through the ingress's
turn path) of the same turn three ways, each on fresh conversations:
  local     - on the replica that ran the previous turn (its prefix cache holds the history),
  pull      - on the other replica, pulling the history's KV over NIXL from the holder,
  recompute - on the other replica, computing everything.
It records what the planner chooses for the turn (`chosen`), and what it chooses when the turn must run
off the holder (`chosen_off_holder`, pull vs recompute), each with its regret against the measured best.

Those points share their history lengths with the start-up calibration, so their regret is in-sample. The
out-of-sample score (`out_of_sample`) uses history lengths and deltas the calibration never ran, half of them
with the holder busy on another request (a background turn started just before), asks the planner before the
point's own turns run, and scores beside it the fixed rules on the same measurements: always stay on the
holder (`always_local`), always move off it and pull (`always_pull`), and vLLM's rule off the holder (pull
when the hold has at least 64 tokens, else recompute: `vllm_threshold`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from benchmarks.common import machine, start_app, stop_app, write_result

GREEDY_ONE = {"max_tokens": 1, "temperature": 0.0, "ignore_eos": True}


def turns(ingress, vocab: int, history: int, delta: int, reps: int, replicas: list[str], rng: random.Random):
    """Yields (mode, target, holder, other, follow-up turn) for each repetition and mode, after the holder has run
    the history. The replicas swap roles every repetition and the modes rotate their order, so neither a slower
    core nor drift over the run lands on one mode: use an even number of repetitions."""
    for rep in range(reps):
        holder, other = replicas[rep % 2], replicas[(rep + 1) % 2]
        order = [("local", holder), ("pull", other), ("recompute", other)]
        for mode, target in order[rep % 3:] + order[:rep % 3]:
            prompt = [rng.randrange(100, vocab) for _ in range(history)]
            first = ingress.turn.remote(prompt, GREEDY_ONE, ("recompute", holder)).result()
            yield mode, target, holder, other, prompt + first.token_ids + [rng.randrange(100, vocab)
                                                                            for _ in range(delta)]


def measure(ingress, vocab: int, history: int, delta: int, reps: int, replicas: list[str], rng: random.Random):
    """Median TTFT per mode, and the planner's last (any target, off the holder) plans."""
    ttft: dict[str, list[float]] = {"local": [], "pull": [], "recompute": []}
    plans: list[tuple[dict, dict]] = []
    for mode, target, _, other, follow in turns(ingress, vocab, history, delta, reps, replicas, rng):
        if mode == "local":  # ask the planner before the turn consumes anything
            plans.append((ingress.plan.remote(follow).result(), ingress.plan.remote(follow, [other]).result()))
        ttft[mode].append(ingress.turn.remote(follow, GREEDY_ONE, (mode, target)).result().ttft_ms)
    return {m: statistics.median(v) for m, v in ttft.items()}, plans[-1]


# (history, delta) pairs none of the calibration's lengths (64, 256, 1024, 2048 + 32) match.
OUT_OF_SAMPLE = [(40, 48), (160, 96), (640, 48), (1536, 160), (3072, 48)]
RULES = ("planner", "always_local", "always_pull", "vllm_threshold")


def measure_busy(ingress, vocab: int, history: int, delta: int, reps: int, replicas: list[str],
                 rng: random.Random, busy: bool) -> tuple[dict[str, float], str]:
    """Median TTFT per mode with the holder idle or busy (a 64-token decode started just before each turn), and
    the mode the planner chose on the first repetition, asked before any of this point's turns ran."""
    ttft: dict[str, list[float]] = {"local": [], "pull": [], "recompute": []}
    chosen = ""
    background_sampling = {"max_tokens": 64, "temperature": 0.0, "ignore_eos": True}
    for mode, target, holder, _, follow in turns(ingress, vocab, history, delta, reps, replicas, rng):
        background = None
        if busy:
            noise = [rng.randrange(100, vocab) for _ in range(128)]
            background = ingress.turn.remote(noise, background_sampling, ("recompute", holder))
            time.sleep(0.3)  # in flight, and seen by the planner, before the turn is planned
        if not chosen:
            plan = ingress.plan.remote(follow).result()
            chosen = "local" if plan["replica"] == holder else plan["mode"]
        ttft[mode].append(ingress.turn.remote(follow, GREEDY_ONE, (mode, target)).result().ttft_ms)
        if background is not None:
            background.result()
    return {m: statistics.median(v) for m, v in ttft.items()}, chosen


def out_of_sample(ingress, vocab: int, replicas: list[str], rng: random.Random, reps: int) -> dict:
    """Regret of the planner and of the fixed rules at points the calibration never measured."""
    points = []
    for busy in (False, True):
        for history, delta in OUT_OF_SAMPLE:
            ttft, chosen = measure_busy(ingress, vocab, history, delta, reps, replicas, rng, busy)
            modes = {"planner": chosen, "always_local": "local", "always_pull": "pull",
                     "vllm_threshold": "pull" if history >= 64 else "recompute"}
            point = {"history": history, "delta": delta, "holder_busy": busy, "reps": reps,
                     "ttft_ms": {m: round(v, 1) for m, v in ttft.items()}, "modes": modes,
                     "regret": {rule: regret(ttft, mode, ("local", "pull", "recompute"))
                                for rule, mode in modes.items()}}
            points.append(point)
            print(json.dumps(point), flush=True)
    summary = {rule: {"mean_regret": round(statistics.fmean(p["regret"][rule] for p in points), 4),
                      "max_regret": max(p["regret"][rule] for p in points)} for rule in RULES}
    return {"points": points, "summary": summary}


def regret(ttft: dict[str, float], chosen: str, among: tuple[str, ...]) -> float:
    best = min(ttft[m] for m in among)
    return round((ttft[chosen] - best) / best, 4)


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len({p["delta"] for p in points}), figsize=(11, 4), squeeze=False)
    for ax, delta in zip(axes[0], sorted({p["delta"] for p in points}), strict=True):
        pts = [p for p in points if p["delta"] == delta]
        xs = [p["history"] for p in pts]
        for mode, style in (("recompute", "o-"), ("pull", "s-"), ("local", "^-")):
            ax.plot(xs, [p["ttft_ms"][mode] for p in pts], style, label=mode)
        for p in pts:
            ax.annotate(p["chosen_off_holder"][0], (p["history"], p["ttft_ms"][p["chosen_off_holder"]]),
                        textcoords="offset points", xytext=(0, 8), ha="center", fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("history tokens")
        ax.set_ylabel("TTFT (ms, log scale)")
        ax.set_title(f"new-turn delta {delta} tokens\n(letter: the planner's choice off the holder)", fontsize=10)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="histories 64, 1024, 4096 and 2 repetitions (4 without)")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--out-of-sample-only", action="store_true",
                        help="skip the in-sample points (calibration lengths); score only out of sample")
    args = parser.parse_args()
    histories = [] if args.out_of_sample_only else [64, 1024, 4096] if args.quick else [64, 256, 1024, 2048, 4096]
    reps = args.reps or (2 if args.quick else 4)
    deltas = [32, 256]

    app = start_app(max_model_len=4096 + 256 + 64, kv_cache_memory_bytes=768 * 1024**2)
    try:
        ingress = app.ingress
        print("cost model after start-up calibration:", json.dumps(ingress.calibrated.remote().result()), flush=True)
        replicas = app.replica_ids(2)
        vocab = app.vocab_size
        rng = random.Random(0)
        # Warm both replicas and their NIXL handshakes, outside the measurement.
        measure(ingress, vocab, 256, 32, 1, replicas, rng)
        points = []
        for history in histories:
            for delta in deltas:
                # Short histories are cheap and their options differ by milliseconds: measure them more often.
                point_reps = reps * max(1, 1024 // max(history, 256))
                ttft, (plan_any, plan_off) = measure(ingress, vocab, history, delta, point_reps, replicas, rng)
                point = {
                    "history": history,
                    "delta": delta,
                    "reps": point_reps,
                    "ttft_ms": {m: round(v, 1) for m, v in ttft.items()},
                    "chosen": plan_any["mode"],
                    "regret": regret(ttft, plan_any["mode"], ("local", "pull", "recompute")),
                    "chosen_off_holder": plan_off["mode"],
                    "regret_off_holder": regret(ttft, plan_off["mode"], ("pull", "recompute")),
                    "estimates_ms": plan_any["estimates_ms"],
                }
                points.append(point)
                print(json.dumps(point), flush=True)
        scored = out_of_sample(ingress, vocab, replicas, rng, reps)
        print("out of sample:", json.dumps(scored["summary"]), flush=True)
        cost = ingress.stats.remote().result()["cost_model"]
    finally:
        stop_app(app)
    result = {
        "model": app.model,
        "machine": machine(),
        "reps": reps,
        "points": points,
        "max_regret": max((max(p["regret"], p["regret_off_holder"]) for p in points), default=None),
        "out_of_sample": scored,
        "cost_model": cost,
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    write_result(args.out, result)
    if points:
        plot(points, args.out.with_suffix(".png"))
    print(json.dumps({k: result[k] for k in ("max_regret",)}), "written", args.out)


if __name__ == "__main__":
    main()
