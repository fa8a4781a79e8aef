"""The KV directory's change feed: every update the directory actor applies, in order, for its mirrors.

Each ingress keeps a mirror of the directory (`app/directory_mirror.py`) so that planning a turn makes no
remote call; the actor stays the record (a restarted ingress resyncs from it) and the only place a hold is
consumed. A mirror long-polls `changes(epoch, since)`: the updates after sequence number `since`, or, when it
is new, behind the log's window, or the directory restarted (another epoch), a snapshot to start from (fetched
in parts with `snapshot_part`).

Updates are plain tuples whose first field names them:
    ("beat", identity, stats)        a replica's heartbeat (the log keeps ("beat", replica_id); an answer brings the
                                     replica's latest report, once, at its last beat in the answer)
    ("leave", replica_id)            a replica left, was swept or failed a pull: forget all it holds
    ("hold", replica_id, held, hold, expires_at)   a recorded hold (named by `hold.hold_id`; `held`: a `HeldPrefix`)
    ("consume", hold_id)             a hold was pulled or released
    ("resident", replica_id, ops)    prefix-cache events applied for a replica

A hold keeps the id its replica minted (`kvtransfer.types.HoldId`) in the actor, in the feed and in every mirror.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from typing import Any, NamedTuple

# Bound every message of the feed well below the 4 MB that Ray Serve's gRPC transport (its throughput-optimized
# mode) carries between deployments: updates come in batches, a snapshot in parts.
MAX_UPDATES = 500
SNAPSHOT_PART_BYTES = 2 * 1024**2


class Changes(NamedTuple):
    """What a mirror must apply to reach sequence number `seq` of directory `epoch`."""

    epoch: str
    seq: int
    updates: list[tuple]
    # Set when the mirror must start over from the snapshot taken at `seq`: how many parts to fetch
    # (`snapshot_part`), and the live replicas' (identity, stats).
    snapshot_parts: int = 0
    live: list[tuple[Any, Any]] | None = None
    # When the actor logged the first of `updates` (its wall clock; None if there are none): a mirror's lag behind it.
    first_at: float | None = None


class Snapshot(NamedTuple):
    """A pickled directory cut into parts; parts are fetched by (epoch, seq, index)."""

    epoch: str
    seq: int
    parts: list[bytes]

    @classmethod
    def of(cls, epoch: str, seq: int, blob: bytes) -> Snapshot:
        cut = SNAPSHOT_PART_BYTES
        return cls(epoch, seq, [blob[i : i + cut] for i in range(0, len(blob), cut)] or [b""])


class ChangeLog:
    """The last `limit` updates with their sequence numbers, and a way to wait for the next one.

    Not thread-safe: the directory actor's event loop owns it. `append` never awaits.
    """

    # Mirrors long-poll without pause, so the log only has to cover a mirror's brief lag; one that falls further
    # behind starts over from a snapshot. What it keeps counts in the directory actor's memory: under
    # `benchmarks.control_plane`'s load (3,840-token first turns on 64 replicas) a full log added about 60 bytes per
    # directory block while each hold carried its key's token ids, 25 with the hold's block hashes only (a hold of a
    # long history still brings a few KB).
    def __init__(self, limit: int = 10_000) -> None:
        self.seq = 0
        self._entries: deque[tuple[int, float, tuple]] = deque(maxlen=limit)  # (seq, when appended, update)
        self._next: asyncio.Future | None = None

    def append(self, update: tuple) -> int:
        self.seq += 1
        self._entries.append((self.seq, time.time(), update))
        if self._next is not None and not self._next.done():
            self._next.set_result(None)
        return self.seq

    def covers(self, since: int) -> bool:
        """Whether every update after `since` is still in the log."""
        first = self._entries[0][0] if self._entries else self.seq + 1
        return since <= self.seq and since >= first - 1

    def after(self, since: int, limit: int = MAX_UPDATES) -> tuple[list[tuple], float | None]:
        """Updates with sequence numbers in (since, since + limit], and when the first was appended (None if there
        are none); `covers(since)` must hold."""
        newer = list(itertools.islice(reversed(self._entries), self.seq - since))[-limit:]
        return [update for _, _, update in reversed(newer)], newer[-1][1] if newer else None

    async def wait(self, since: int, timeout_s: float) -> None:
        """Return once there is an update after `since`, or after `timeout_s`."""
        if self.seq > since:
            return
        if self._next is None or self._next.done():
            self._next = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(self._next), timeout_s)
        except TimeoutError:
            pass
