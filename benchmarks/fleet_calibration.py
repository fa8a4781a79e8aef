"""The app's start-up calibration (`kvtransfer.calibration.calibrate`), run on a modelled fleet before it serves.

The same forced turns in the same order: NIXL's first pull each way between two replicas (the handshake, then
forgotten as a transfer sample), a recompute, a pull and a local follow-up per length, then prefills alone and
beside a replica decoding CONTENTION_STREAMS long turns, and short prefills on that replica meanwhile. They seed
the cost model's fits and its estimate error.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from benchmarks.fleet_turns import LiveConversation
from benchmarks.fleet_workloads import Conversation, Turn
from kvtransfer.calibration import (
    CALIBRATION_TENANT,
    CONTENTION_LENGTHS,
    CONTENTION_START_S,
    CONTENTION_STREAMS,
    ON_BUSY_LENGTHS,
)
from kvtransfer.options import Mode

if TYPE_CHECKING:
    from benchmarks.fleet_sim import Fleet

VOCAB = 32000


def calibrate(fleet: Fleet) -> None:
    rng = random.Random(fleet.seed + 7)
    ids = fleet.prefill_pool or [e.replica_id for e in fleet.engines]
    if len(ids) < 2:
        return

    def conversation(n: int, output: int = 1, hold: bool = False) -> LiveConversation:
        def tokens(k: int) -> list[int]:
            return [rng.randrange(100, VOCAB) for _ in range(k)]

        turns = [Turn(user_tokens=[], output_tokens=tokens(output), think_s=0)] + [
            Turn(user_tokens=tokens(32), output_tokens=tokens(1), think_s=0) for _ in range(2)]
        return fleet.new_conversation(Conversation(conv_id=f"calibration-{rng.random()}", tenant=CALIBRATION_TENANT,
                                                   calibration=True, calibration_hold=hold, start_s=0,
                                                   prefix_tokens=tokens(n), turns=turns))

    def forced(live: LiveConversation, mode: Mode, replica: str) -> None:
        finished: list[bool] = []
        fleet.start_turn(live, (mode, replica), "kvrelay", on_done=lambda: finished.append(True))
        fleet.run_until_idle(done=lambda: bool(finished))

    def pull_after_recompute(n: int, holder: str, puller: str, local: bool = True) -> None:
        live = conversation(n, hold=True)
        forced(live, Mode.RECOMPUTE, holder)
        forced(live, Mode.PULL, puller)
        if local and fleet.by_id[holder].prefix_caching:
            forced(live, Mode.LOCAL, holder)

    pull_after_recompute(64, ids[0], ids[1], local=False)
    pull_after_recompute(64, ids[1], ids[0], local=False)
    fleet.cost.learn_handshake()
    for n in (64, 256, 1024, 2048):
        pull_after_recompute(n, ids[0], ids[1])
    lengths = list(CONTENTION_LENGTHS) * 2
    for n in lengths:
        forced(conversation(n), Mode.RECOMPUTE, ids[0])
    streams: list[bool] = []
    for _ in range(CONTENTION_STREAMS):
        fleet.start_turn(conversation(64, output=256), (Mode.RECOMPUTE, ids[1]), "kvrelay",
                         on_done=lambda: streams.append(True))
    fleet.run_until_idle(fleet.now + CONTENTION_START_S)
    for n in lengths:
        forced(conversation(n), Mode.RECOMPUTE, ids[0])
    for n in ON_BUSY_LENGTHS:
        forced(conversation(n), Mode.RECOMPUTE, ids[1])
    fleet.run_until_idle(done=lambda: len(streams) == CONTENTION_STREAMS)
