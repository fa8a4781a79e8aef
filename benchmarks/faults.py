"""Scripted faults under a multi-turn load: does every turn still get the right answer, how long does the app take to
recover, and is any engine process left behind?

    python -m benchmarks.faults --out benchmarks/results/faults.json [--reps 3]

A tiny-llama app (two replicas, fp32, greedy, so every answer can be checked token for token) serves background
conversations from two client threads for the whole run, while each fault is played `--reps` times on a
conversation of its own: its first turn runs, the fault strikes, its next turn runs, and that turn's tokens are
compared with a recompute of the same history on a live replica. The faults:

- `holder_killed_between_turns`: SIGKILL of the process tree of the replica holding the conversation's KV;
- `serving_replica_killed_mid_stream`: the same for the replica streaming the turn, after its 10th token (HTTP);
- `directory_killed`: SIGKILL of the KV directory's replica (Serve restarts it empty; replicas re-report);
- `ingress_killed`: SIGKILL of the ingress replica; the client retries as OpenAI's SDK does (HTTP, 1-8 s apart);
- `holder_stopped_during_pull`: the holder's processes SIGSTOPped while another replica pulls from it, resumed 3 s on;
- `pull_at_the_end_of_the_offer`: the pull sent just before the directory stops offering the hold (its lease ends
  `expiry_margin_s` later).

Races around a pull's read (`--races N`, N pulls each, on an app of their own with the default 10 s lease, every pull
verified against its holder's digests; results in their own file):

- `lease_ends_during_pull`: the pull sent at the end of the offer, the reader's processes SIGSTOPped for 1-3.5 s
  right after, so that its read starts or finishes around the end of the hold's lease;
- `release_racing_a_read`: a release of the very hold the pull reads, sent through the reader 0-50 ms after the pull
  (kvrelay never does this: a hold is taken from the directory once; the race is forced from outside);
- `holder_paused_through_lease`: the holder's processes SIGSTOPped from just after the pull is sent until a second
  after the lease has ended;
- `reader_killed_mid_read`: the reader's processes SIGKILLed 20-150 ms after the pull is sent (the turn moves on).

Every answer is compared with a recompute; at the end, with the load stopped and the leases over, every replica's
KV cache must be empty again (no hold leaked).

A turn has failed if the client got no answer after its retries (HTTP: for 90 s; the background clients of the Python
handle API: twice, as OpenAI's SDK retries); recovery is the time from
the fault until both replicas (and for the ingress fault, HTTP) answer again. Leaked processes are the engine
processes the app's replicas reported that are still alive 15 s after the app is shut down.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.common import start_app, stop_app, write_result
from benchmarks.fault_campaign import HOLD_TTL_S, MODEL, RACES, Campaign
from benchmarks.fault_processes import app_engine_processes, kill

RACE_TTL_S = 10.0  # the default lease (configs/engine.py)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--races", type=int, help="instead of the faults: this many pulls of each race around a read")
    parser.add_argument("--kill-reps", type=int, default=10,
                        help="of those, how many kill the reader (each waits for Serve to replace it)")
    args = parser.parse_args()
    ttl = HOLD_TTL_S if args.races is None else RACE_TTL_S
    app = start_app(MODEL, dtype="float32", max_model_len=2048, kv_cache_memory_bytes=64 * 1024**2,
                    nixl={"hold_ttl_s": ttl, "verify_pulls": True})
    try:
        app.ingress.calibrated.remote().result(timeout_s=300)
        if args.races is None:
            campaign = Campaign(app, args.reps)
        else:
            campaign = Campaign(app, args.races, RACES, ttl, kill_reps=min(args.kill_reps, args.races))
        figures = campaign.run()
    finally:
        ours = app_engine_processes()  # those of the replicas alive now; the ones killed were checked as they died
        stop_app(app)
    time.sleep(15)
    leaked = [p for p in ours if p.is_running()]
    figures["leaked_processes"] = len(leaked)
    kill(leaked)
    write_result(args.out, figures)
    print(json.dumps({k: v for k, v in figures.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
