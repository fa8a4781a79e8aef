"""The KV directory as a Ray actor: the record of holdings and live replicas that every ingress's mirror follows."""

from __future__ import annotations

import logging
import pickle
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from actors.replica_api import ReplicaIdentity, ReplicaStats
from actors.replica_registry import DEFAULT_DEAD_AFTER_S, ReplicaRegistry
from kvtransfer.directory_index.changes import ChangeLog, Changes, Snapshot
from kvtransfer.directory_index.index import KVDirectory
from kvtransfer.directory_index.results import DirectoryStats, RecordResult, ResidentOp, ResidentResult
from kvtransfer.prefix_key import PrefixKey, Scope
from kvtransfer.types import Hold, HoldId, LookupResult

logger = logging.getLogger(__name__)


class KVDirectoryActor:
    """Ray actor owning one `KVDirectory` and the live-replica registry: the record every mirror follows.

    Methods are `async` and, but for `changes`, never await, so each runs atomically on the actor's event
    loop; callers `await handle.method.remote(...)` and never block theirs. Every update is also appended to
    a change feed (`kvtransfer/directory_index/changes.py`) that each ingress's mirror follows. After a crash the
    actor comes back empty with a new epoch; event forwarders re-report their replicas' caches and mirrors
    resync.
    """

    DEPARTED_KEPT = 1024

    def __init__(self, dead_after_s: float = DEFAULT_DEAD_AFTER_S, **directory_kwargs: Any) -> None:
        self._directory = KVDirectory(**directory_kwargs)
        self._replicas = ReplicaRegistry(dead_after_s)
        self._log = ChangeLog()
        self._snapshot: Snapshot | None = None
        self._left = self._silent = 0
        # Replicas that left, newest last: a hold a late turn records on one of them is refused (it would be offered
        # for pulls that fail). A heartbeat takes a replica off (one deregistered after a misrouted pull lives on).
        self._departed: OrderedDict[str, None] = OrderedDict()

    # ----- live replicas (heartbeats)

    async def heartbeat(self, identity: ReplicaIdentity, stats: ReplicaStats) -> bool:
        """A replica's periodic report of its identity and load; True when the replica was not registered
        (first beat, or the directory restarted or dropped it): it should re-report what it holds."""
        self._sweep()
        self._departed.pop(identity.replica_id, None)
        new = self._replicas.heartbeat(identity, stats)
        self._log.append(("beat", identity.replica_id))  # an answer brings the replica's latest report (`changes`)
        return new

    async def deregister(self, replica_id: str) -> None:
        """A replica leaves (scale-down, shutdown, a failed pull from it): forget it and all it holds, at once."""
        if self._replicas.remove(replica_id):
            self._left += 1
        self._depart(replica_id)

    def _sweep(self) -> None:
        for replica_id in self._replicas.sweep():
            logger.warning("replica %s stopped reporting; dropping its directory entries", replica_id)
            self._silent += 1
            self._depart(replica_id)

    def _depart(self, replica_id: str) -> None:
        self._directory.drop_replica(replica_id)
        self._log.append(("leave", replica_id))
        self._departed[replica_id] = None
        self._departed.move_to_end(replica_id)
        while len(self._departed) > self.DEPARTED_KEPT:
            self._departed.popitem(last=False)

    async def replica_identities(self) -> list[ReplicaIdentity]:
        self._sweep()
        return self._replicas.identities()

    # ----- holdings

    async def lookup(self, query: PrefixKey | Sequence[int], scope: Scope | None = None) -> LookupResult:
        return self._directory.lookup(query, scope)

    async def record_hold(
        self, replica_id: str, key: PrefixKey | Sequence[int], hold: Hold, expires_at: float,
        scope: Scope | None = None, prompt_tokens: int = 0,
    ) -> RecordResult:
        if replica_id in self._departed:
            return RecordResult(kept=False, new_entries=0, evicted_chains=0)
        # The feed carries what the directory keeps of the hold's tokens, not the key: a few KB less per hold that
        # the log holds (a long history's token ids are 4 bytes each).
        held = self._directory.held_prefix(key, hold.num_tokens, scope=scope, prompt_tokens=prompt_tokens)
        result = self._directory.record_held(replica_id, held, hold, expires_at)
        if result.kept:
            self._log.append(("hold", replica_id, held, hold, expires_at))
        return result

    async def consume_hold(self, hold_id: HoldId) -> Hold | None:
        """The hold named `hold_id` (the id its replica minted), once; None if it is gone or was never kept."""
        hold = self._directory.consume_hold(hold_id)
        if hold is not None:
            self._log.append(("consume", hold_id))
        return hold

    async def apply_resident(self, replica_id: str, ops: list[ResidentOp]) -> ResidentResult:
        result = self._directory.apply_resident(replica_id, ops)
        self._log.append(("resident", replica_id, ops))
        return result

    # ----- mirrors

    async def changes(self, epoch: str | None, since: int, wait_s: float = 2.0) -> Changes:
        """The updates after `since` (waiting up to `wait_s` for one), or, when `epoch` is not this directory's
        or `since` fell out of the log, a snapshot to fetch with `snapshot_part` and the live replicas."""
        if epoch != self._directory.epoch or not self._log.covers(since):
            self._sweep()
            seq = self._log.seq
            if self._snapshot is None or self._snapshot.seq != seq or self._snapshot.epoch != self._directory.epoch:
                self._snapshot = Snapshot.of(self._directory.epoch, seq, pickle.dumps(self._directory))
            live = list(zip(self._replicas.identities(), self._replicas.live(), strict=True))
            return Changes(self._directory.epoch, seq, [], len(self._snapshot.parts), live)
        await self._log.wait(since, wait_s)
        updates, first_at = self._log.after(since)
        return Changes(self._directory.epoch, since + len(updates), self._with_reports(updates), first_at=first_at)

    def _with_reports(self, updates: list[tuple]) -> list[tuple]:
        """`updates` with each replica's beats as one ("beat", identity, stats) of its latest report, where its last
        beat among them is; a replica that has left since brings none (its "leave" follows). The log keeps only which
        replica beat: a report is a few KB, and beats are most of the log under load."""
        last = {update[1]: i for i, update in enumerate(updates) if update[0] == "beat"}
        answer = []
        for i, update in enumerate(updates):
            if update[0] != "beat":
                answer.append(update)
            elif last[update[1]] == i and (report := self._replicas.report(update[1])) is not None:
                answer.append(("beat", *report))
        return answer

    async def snapshot_part(self, epoch: str, seq: int, index: int) -> bytes | None:
        """Part `index` of the snapshot taken at (`epoch`, `seq`); None once a newer one replaced it."""
        snap = self._snapshot
        if snap is None or (snap.epoch, snap.seq) != (epoch, seq):
            return None
        return snap.parts[index]

    async def stats(self) -> DirectoryStats:
        return self._directory.stats()._replace(replicas_left=self._left, replicas_silent=self._silent,
                                                feed_seq=self._log.seq)

    async def check_integrity(self) -> None:
        self._directory.check_integrity()
