"""What NIXL's progress-thread delay (`nixl.progress_delay_us`) costs a pull and saves an idle engine, side by side.

    python -m benchmarks.progress_delay --out benchmarks/results/progress_delay.json [--delays 200 10000] [--apps 2]

NIXL's UCX progress thread waits in poll() on its workers' event fds with the delay as timeout (rounded up to
whole milliseconds), then progresses every worker: data arriving on a socket wakes it at once, the timeout only
bounds how late it notices progress that no fd signals. So the delay sets how often an idle engine wakes, and
should not lengthen a pull over TCP. For each delay in turn (`--apps` rounds, alternating, one fresh app each) this
measures the engine processes' cores used while idle, and the TTFT of forced pulls and forced local turns of the
default model (histories of 256 and 1024 tokens, a 32-token new turn, both replicas taking each role).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from benchmarks.common import start_app, stop_app, write_result
from benchmarks.crossover import GREEDY_ONE
from benchmarks.scaling import CoreMeter, process_kinds

HISTORIES = (256, 1024)
DELTA = 32
IDLE_S = 20.0


def idle_cores_per_engine(seconds: float) -> float:
    """Cores used per engine process over `seconds` with nothing to do."""
    from ray import serve

    directory = serve.get_deployment_handle("kv_directory", app_name="bench")
    engines = process_kinds(directory.replica_identities.remote().result())["engine_core"]
    meter = CoreMeter({"engine_core": engines})
    meter.start()
    time.sleep(seconds)
    return meter.stop()["engine_core"] / len(engines)


def turn_ttfts(app, reps: int, rng: random.Random) -> dict[str, dict[str, float]]:
    """Median TTFT (ms) per history length of forced local turns and forced pulls onto the other replica."""
    replicas = app.replica_ids(2)
    found: dict[str, dict[str, list[float]]] = {str(h): {"local": [], "pull": []} for h in HISTORIES}
    for rep in range(reps):
        holder, other = replicas[rep % 2], replicas[(rep + 1) % 2]
        order = [("local", holder), ("pull", other)]
        for history in HISTORIES:
            for mode, target in order[::-1] if rep % 2 else order:
                prompt = [rng.randrange(100, app.vocab_size) for _ in range(history)]
                first = app.ingress.turn.remote(prompt, GREEDY_ONE, ("recompute", holder)).result()
                follow = prompt + first.token_ids + [rng.randrange(100, app.vocab_size) for _ in range(DELTA)]
                found[str(history)][mode].append(app.ingress.turn.remote(follow, GREEDY_ONE, (mode, target)).result()
                                                 .ttft_ms)
    return {h: {m: round(statistics.median(v), 1) for m, v in modes.items()} for h, modes in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--delays", type=int, nargs="+", default=[200, 10000], help="microseconds, one app each")
    parser.add_argument("--apps", type=int, default=2, help="rounds over the delays (alternating)")
    parser.add_argument("--reps", type=int, default=6, help="turns per mode and history in each app")
    args = parser.parse_args()
    runs = []
    for round_ in range(args.apps):
        for delay in args.delays:
            app = start_app(nixl={"progress_delay_us": delay})
            try:
                app.ingress.calibrated.remote().result()
                rng = random.Random(round_)
                turn_ttfts(app, 1, rng)  # first pulls each way (handshakes) and warm-up, outside the figures
                time.sleep(5)
                idle = idle_cores_per_engine(IDLE_S)
                ttft = turn_ttfts(app, args.reps, rng)
                pull_fit = app.ingress.stats.remote().result()["cost_model"].get("pull")
            finally:
                stop_app(app)
            run = {"delay_us": delay, "round": round_, "idle_cores_per_engine": round(idle, 4), "ttft_ms": ttft,
                   "cost_model_pull": pull_fit}
            runs.append(run)
            print(json.dumps(run), flush=True)
    summary = {}
    for delay in args.delays:
        mine = [r for r in runs if r["delay_us"] == delay]
        summary[str(delay)] = {
            "idle_cores_per_engine": round(statistics.fmean(r["idle_cores_per_engine"] for r in mine), 4),
            "ttft_ms_median_of_apps": {h: {m: round(statistics.median(r["ttft_ms"][h][m] for r in mine), 1)
                                           for m in ("local", "pull")} for h in map(str, HISTORIES)},
        }
    result = {"runs": runs, "summary": summary, "histories": HISTORIES, "delta": DELTA, "reps": args.reps,
              "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(json.dumps(summary, indent=2))
    write_result(args.out, result)


if __name__ == "__main__":
    main()
