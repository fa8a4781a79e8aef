"""An ingress's own copy of the KV directory, so that planning a turn makes no remote call.

The mirror follows the directory actor's change feed (`kvtransfer/directory_index/changes.py`) from a background task
and answers `lookup` and `live` locally, as llm-d's and Dynamo's routers keep their block index in-process.
The actor stays the record and the only place a hold is consumed: `consume_hold` asks it for the hold by its id,
so it uses the hold only if it is the very one this mirror offered. A mirror that lags costs speed (a missed reuse,
a hold already gone), never a wrong answer.

A hold has one id everywhere, the `HoldId` its replica minted at export: the actor, its feed and every mirror
name it by that.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import time
from collections import deque
from typing import Any

from actors.replica_api import ReplicaIdentity, ReplicaStats
from actors.replica_registry import DEFAULT_DEAD_AFTER_S, ReplicaRegistry
from kvtransfer.directory_index.changes import Changes
from kvtransfer.directory_index.index import KVDirectory
from kvtransfer.directory_index.results import HeldPrefix
from kvtransfer.prefix_key import PrefixKey
from kvtransfer.types import Hold, HoldId, LookupResult

logger = logging.getLogger(__name__)


class DirectoryMirror:
    """A follower of one directory actor. Not thread-safe: one event loop (the ingress's) owns it.

    `lookup` and `live` read the copy (`epoch` is None until the first answer arrives); `record_hold`,
    `consume_hold` and `deregister` update the copy and the actor (`record_hold` without waiting for it);
    `follow` (a task started by `start`) applies the actor's updates as they happen.
    """

    POLL_WAIT_S = 2.0

    def __init__(self, directory: Any, block_size: int, dead_after_s: float = DEFAULT_DEAD_AFTER_S) -> None:
        self.directory = directory
        self.block_size = block_size
        self.dead_after_s = dead_after_s
        self.epoch: str | None = None
        self.seq = 0
        self.updates_applied = 0
        self.answers = 0  # of the feed: each is a Serve call this process makes
        self.resyncs = 0
        # Per answer that brought updates: how long after the actor logged the first of them this copy applied it.
        self.lags_ms: deque[float] = deque(maxlen=1024)
        self._copy = KVDirectory(block_size)
        self._replicas = ReplicaRegistry(dead_after_s)
        self._gone: deque[HoldId] = deque(maxlen=4096)  # holds consumed lately (a late copy is skipped)
        self._task: asyncio.Task | None = None
        self._pending: dict[HoldId, asyncio.Task] = {}  # a hold's recording at the actor, until answered
        self._background: set[asyncio.Task] = set()  # asyncio keeps weak references to tasks only

    # ----- following the actor

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.follow())

    async def follow(self) -> None:
        # One method handle for every long poll: a Serve handle builds a new one on each attribute access (a copy of
        # its options, about a sixth of the feed's time on the ingress's loop in a py-spy profile).
        feed = self.directory.changes
        while True:
            try:
                changes: Changes = await feed.remote(self.epoch, self.seq, self.POLL_WAIT_S)
                self.answers += 1
                snapshot = None
                if changes.snapshot_parts:
                    parts = [await self.directory.snapshot_part.remote(changes.epoch, changes.seq, i)
                             for i in range(changes.snapshot_parts)]
                    if any(p is None for p in parts):
                        continue  # a newer snapshot replaced it meanwhile: ask again
                    snapshot = b"".join(parts)
                self.apply(changes, snapshot)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the directory restarts; keep the copy until it answers again
                logger.warning("KV directory feed failed (%s); retrying", exc)
                await asyncio.sleep(0.5)

    def apply(self, changes: Changes, snapshot: bytes | None = None) -> None:
        """Apply one answer of the feed, with its snapshot's bytes if it has one (mutates)."""
        if snapshot is not None:
            self._copy = pickle.loads(snapshot)
            self._replicas = ReplicaRegistry(self.dead_after_s)
            for identity, stats in changes.live or ():
                self._replicas.heartbeat(identity, stats)
            self.resyncs += 1
        for update in changes.updates:
            self._apply(update)
        if changes.first_at is not None:
            self.lags_ms.append((time.time() - changes.first_at) * 1e3)
        self.updates_applied += len(changes.updates)
        self.epoch, self.seq = changes.epoch, changes.seq

    def _apply(self, update: tuple) -> None:
        kind = update[0]
        if kind == "beat":
            self._replicas.heartbeat(update[1], update[2])
        elif kind == "leave":
            self._forget(update[1])
        elif kind == "hold":
            _, replica_id, held, hold, expires_at = update
            self._copy_hold(replica_id, held, hold, expires_at)
        elif kind == "consume":
            self._drop_hold(update[1])
        elif kind == "resident":
            self._copy.apply_resident(update[1], update[2])

    def _copy_hold(self, replica_id: str, held: HeldPrefix, hold: Hold, expires_at: float) -> None:
        """Copy a hold the actor kept, unless taken lately. A hold this copy has already (recorded here before the
        actor answered, or delivered twice) stays as it is: the entry a turn of this ingress may have planned with."""
        if hold.hold_id not in self._gone:
            self._copy.record_held(replica_id, held, hold, expires_at)

    def _drop_hold(self, hold_id: HoldId) -> Hold | None:
        self._gone.append(hold_id)
        return self._copy.consume_hold(hold_id)

    def _forget(self, replica_id: str) -> None:
        self._replicas.remove(replica_id)
        self._copy.drop_replica(replica_id)

    # ----- reads (local)

    def lookup(self, key: PrefixKey) -> LookupResult:
        return self._copy.lookup(key)

    def continues(self, key: PrefixKey) -> bool:
        """Whether `key` starts with the whole prompt of a turn whose hold is pending (`KVDirectory.continues`)."""
        return self._copy.continues(key)

    def cache_turnover(self) -> dict[str, tuple[int, int]]:
        """Per replica, its resident blocks and the blocks its engine evicted so far (`KVDirectory.cache_turnover`)."""
        return self._copy.cache_turnover()

    def live(self) -> list[ReplicaStats]:
        """Replicas whose heartbeats reached this mirror lately (a silent one is dropped with all it holds)."""
        for replica_id in self._replicas.sweep():
            self._copy.drop_replica(replica_id)
        return self._replicas.live()

    def identities(self) -> list[ReplicaIdentity]:
        """How the replicas that reported lately are addressed, their processes included (read only)."""
        return self._replicas.identities()

    # ----- writes (the actor first, then the copy)

    def record_hold(
        self, replica_id: str, key: PrefixKey, hold: Hold, expires_at: float, at_actor_after_s: float = 0.0,
        prompt_tokens: int = 0,
    ) -> asyncio.Task:
        """Record a turn's new hold in this copy at once, so this ingress's next turn sees it, and at the actor in
        the background (`at_actor_after_s` from now), so the turn's last token does not wait for a directory round
        trip. Returns that task.

        Until the actor answers, the hold is offered here but only usable through this mirror: `consume_hold`
        waits for the answer; if the actor refused the hold, the copy drops it too.
        """
        held = self._copy.held_prefix(key, hold.num_tokens, prompt_tokens=prompt_tokens)
        self._copy.record_held(replica_id, held, hold, expires_at)
        task = asyncio.get_running_loop().create_task(
            self._record_at_actor(replica_id, key, held, hold, expires_at, at_actor_after_s, prompt_tokens))
        self._pending[hold.hold_id] = task
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _record_at_actor(
        self, replica_id: str, key: PrefixKey, held: HeldPrefix, hold: Hold, expires_at: float, after_s: float,
        prompt_tokens: int,
    ) -> None:
        try:
            await asyncio.sleep(after_s)
            answer = await self.directory.record_hold.remote(replica_id, key, hold, expires_at,
                                                             prompt_tokens=prompt_tokens)
            kept = answer.kept
        except Exception as exc:  # the directory restarts: the hold is not offered, its lease frees it
            logger.warning("could not record a hold of %s at the KV directory: %s", replica_id, exc)
            kept = False
        finally:
            self._pending.pop(hold.hold_id, None)
        if kept:
            # Follow the answer as the feed will: this copy may lack the hold (a snapshot replaced the copy meanwhile,
            # or it did not keep it), and the feed may have brought it already (a loaded machine: kept as it is).
            self._copy_hold(replica_id, held, hold, expires_at)
        else:  # refused by the actor: nobody can take it
            self._copy.consume_hold(hold.hold_id)

    async def consume_hold(self, hold_id: HoldId) -> Hold | None:
        """Take a hold this mirror offered: once, and only if the actor still has it. None if it is gone, or the actor
        cannot say (it died or is restarting: the turn then computes instead)."""
        try:
            pending = self._pending.get(hold_id)
            if pending is not None:
                await asyncio.shield(pending)
            if self._drop_hold(hold_id) is None:
                return None  # gone from this copy: taken, released, refused or expired meanwhile
            return await self.directory.consume_hold.remote(hold_id)
        except Exception as exc:
            logger.warning("could not take hold %s from the KV directory: %s", hold_id, exc)
            return None

    async def deregister(self, replica_id: str) -> None:
        """Forget a replica here at once, and at the actor (a restarted actor has forgotten it already)."""
        self._forget(replica_id)
        try:
            await self.directory.deregister.remote(replica_id)
        except Exception as exc:
            logger.warning("could not deregister %s at the KV directory: %s", replica_id, exc)

    def stats(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch, "seq": self.seq, "answers": self.answers, "updates_applied": self.updates_applied,
            "resyncs": self.resyncs, "lag_ms": quantiles_ms(self.lags_ms),
            "holds": self._copy.stats().holds, "replicas": len(self._replicas.live()), "at": time.time(),
        }


def quantiles_ms(samples: deque[float]) -> dict[str, float | int] | None:
    """p50, p99 and max of recent lags (None before the first)."""
    if not samples:
        return None
    ordered = sorted(samples)
    return {"p50": round(ordered[len(ordered) // 2], 2), "p99": round(ordered[int(len(ordered) * 0.99)], 2),
            "max": round(ordered[-1], 2), "samples": len(ordered)}
