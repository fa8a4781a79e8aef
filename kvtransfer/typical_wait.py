"""How long a turn typically waits on each replica before its own prefill: the planner's queue estimates, averaged
over time. A turn's wait is the queue it finds on arrival; a conversation's later turns arrive at moments its think
times choose, so they find a replica's queue as it is on average, not as it is now. The first turn decides where
those later turns run (they find their history there), so the planner prices them at this average
(`kvtransfer/planner.py`).

Sampled at every planned turn for every replica it weighed (turns arrive at moments of their own, so the samples
see the queues' time average) and averaged with a time constant: an old average gives way to new samples by how
long ago it was last sampled, not by how many samples came since.
"""

from __future__ import annotations

import math
from collections.abc import Mapping


class TypicalWait:
    """Per replica, an exponential moving average over time of the queue (ms) a turn found there. Not thread-safe."""

    # Time constant (seconds): about a conversation's pause between turns, the horizon at which its later turns run.
    TAU_S = 10.0

    # Weight of each planned turn's compute in the moving average of a turn's service time.
    SERVICE_WEIGHT = 0.05

    def __init__(self) -> None:
        self._ms: dict[str, float] = {}
        self._at: dict[str, float] = {}
        self.service_ms: float | None = None  # a planned turn's compute, on average

    def observe(self, now_s: float, queues_ms: Mapping[str, float], service_ms: float | None = None) -> None:
        """The queue each replica in `queues_ms` had at `now_s` (seconds on the caller's clock), and the planned
        turn's own compute estimate (`service_ms`; mutates)."""
        if service_ms is not None and service_ms > 0:
            self.service_ms = service_ms if self.service_ms is None else (
                self.service_ms + self.SERVICE_WEIGHT * (service_ms - self.service_ms))
        for replica_id, ms in queues_ms.items():
            last = self._at.get(replica_id)
            if last is None:
                self._ms[replica_id] = ms
            else:
                weight = 1.0 - math.exp(-max(0.0, now_s - last) / self.TAU_S)
                self._ms[replica_id] += weight * (ms - self._ms[replica_id])
            self._at[replica_id] = now_s

    def ms(self, replica_id: str) -> float:
        """The replica's typical queue; 0 before it was sampled."""
        return self._ms.get(replica_id, 0.0)

    def marginal_ms(self, replica_id: str) -> float:
        """What one more turn there costs in waits, its own and the others': in a single-server queue (M/M/1) of
        mean wait W and service time S, a request waits W and adds W / (1 - utilization) to the others' waits, and
        W = S u / (1 - u) gives 1 / (1 - u) = 1 + W / S. So W (2 + W / S)."""
        wait = self.ms(replica_id)
        if not self.service_ms:
            return wait
        return wait * (2.0 + wait / self.service_ms)

    def as_dict(self) -> dict[str, float]:
        return {r: round(ms, 2) for r, ms in sorted(self._ms.items())}
