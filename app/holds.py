"""The hold lifecycle a turn runner drives: take the hold a plan reads from the directory, record the hold a
replica leaves for the next turn, and release the holds a turn made redundant (now, rather than at lease end)."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from actors.replica_api import GenerateDelta, HoldRelease, ReplicaStats
from app.directory_mirror import DirectoryMirror
from app.turn_types import Turn
from kvtransfer.planner import Plan
from kvtransfer.prefix_key import PrefixKey, Scope
from kvtransfer.types import Hold, HoldOffer

logger = logging.getLogger(__name__)


class Holds:
    """Holds as one ingress handles them, through its directory mirror and the engine pool whose replicas hold
    them. Counts "holds_gone" and "holds_released" in the runner's `counters`."""

    def __init__(self, directory: DirectoryMirror, engines: Any, replicas: Callable[[], list[ReplicaStats]],
                 counters: Counter, model: str, block_size: int, hold_ttl_s: float, release_pool: str,
                 record_after_s: float) -> None:
        self.directory = directory
        self.engines = engines
        self.replicas = replicas
        self.counters = counters
        self.model = model
        self.block_size = block_size
        self.hold_ttl_s = hold_ttl_s
        # The pool whose replicas send releases; each hold's record reaches the directory actor this long after
        # the turn's last token (when its response has left).
        self.release_pool = release_pool
        self.record_after_s = record_after_s

    async def take(self, turn: Turn, plan: Plan) -> Hold | None:
        """The planned hold, taken from the directory; None if it is gone (another turn took it, it expired)."""
        hold = await self.directory.consume_hold(plan.hold.hold_id)
        if hold is not None and hold.num_tokens <= len(turn.token_ids) - 1:
            return hold
        # Raced with another turn or expired in between: compute on the same target instead.
        self.counters["holds_gone"] += 1
        return None

    def record(self, turn: Turn, key_tokens: list[int], last: GenerateDelta) -> None:
        """Record the hold the replica left (if any) in the directory, for the next turn to find."""
        if last.hold is not None:
            logger.debug("%s left hold %s on %s", turn.request_id, last.hold.request_id, last.replica_id)
            key = PrefixKey.build(key_tokens, Scope(self.model, turn.tenant), self.block_size)
            self.directory.record_hold(last.replica_id, key, last.hold, time.time() + self.hold_ttl_s,
                                       at_actor_after_s=self.record_after_s, prompt_tokens=len(turn.token_ids))

    async def release(self, holds: Sequence[HoldOffer]) -> None:
        """Take holds out of the directory and free their blocks on their replicas, now rather than at expiry.

        A pending hold pins KV blocks (and keeps its engine stepping now and then to free them).
        """
        pool = {r.replica_id: r.pool for r in self.replicas()}
        for offer in holds:
            # Any replica of the engine pool but the holder can send the release (a holder cannot release its own).
            sender = next((rid for rid, p in sorted(pool.items()) if p == self.release_pool
                           and rid != offer.replica_id), None)
            if sender is None:
                continue  # a lone replica: the hold lasts until its lease ends
            try:
                hold = await self.directory.consume_hold(offer.hold_id)
                if hold is not None:  # None: pulled, expired or released already
                    self.counters["holds_released"] += 1
                    logger.debug("releasing hold %s of %s through %s", hold.request_id, offer.replica_id, sender)
                    await self.engines.release_hold.remote(HoldRelease(hold=hold, target_replica=sender))
            except Exception as exc:  # the hold then lasts until its lease ends: slower, never wrong
                logger.warning("could not release hold %s on %s: %s", offer.hold_id, offer.replica_id, exc)
