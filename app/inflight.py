"""How busy each replica is as this ingress sees it: the replicas' heartbeats, reconciled with the requests this
ingress has sent since (its own in flight now, and their arrival rates), as the planner's `ReplicaView`s."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

from actors.replica_api import ReplicaStats
from kvtransfer.load import ReplicaView
from kvtransfer.prefix_key import BlockHash, PrefixKey


class InFlight:
    """This ingress's own requests per replica, reconciled with the replicas' heartbeats.

    A heartbeat is up to half a second old: it still counts requests that have ended since, and misses those
    sent since. This keeps each own request's start and end (wall clock, the heartbeat's clock too) so a view
    counts what the heartbeat saw of others, plus what this ingress has in flight now. Not thread-safe.
    """

    RETAIN_S = 5.0  # ended requests are kept this long, longer than any heartbeat is old
    RATE_WINDOW_S = 10.0  # arrival rates count the requests sent this long ago at most

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        # replica -> request id -> [started_at, ended_at or None, prompt tokens still to prefill or None]
        self._requests: dict[str, dict[str, list]] = {}
        # replica -> (start time, where its prompt ended: `PrefixKey.prompt_end`) of requests within the rate window
        self._arrivals: dict[str, deque[tuple[float, BlockHash | None]]] = {}
        # replica -> when its latest first token came (its engine then moved on to the next prefill in line)
        self._first_token_at: dict[str, float] = {}

    def started(self, replica_id: str, request_id: str, new_tokens: int, prompt_end: BlockHash | None = None) -> None:
        now = self._clock()
        self._requests.setdefault(replica_id, {})[request_id] = [now, None, new_tokens]
        self._arrivals.setdefault(replica_id, deque()).append((now, prompt_end))

    def now(self) -> float:
        return self._clock()

    def busy_share(self, replica_id: str, since: float, until: float) -> float:
        """The share of [since, until] (this clock) during which this ingress had a request in flight on the
        replica; ended requests are kept RETAIN_S, so `since` should be more recent than that."""
        if until <= since:
            return 0.0
        spans = sorted((max(start, since), min(until, ended if ended is not None else until))
                       for start, ended, _ in self._requests.get(replica_id, {}).values())
        covered, reached = 0.0, since
        for start, end in spans:
            start = max(start, reached)
            if end > start:
                covered += end - start
                reached = end
        return covered / (until - since)

    def moved(self, from_replica: str, to_replica: str, request_id: str) -> None:
        """The request runs on `to_replica`, not where it was accounted (Serve chose: a P/D decode stage, or a
        target Serve no longer routes to): count it there from now on, so the replica's heartbeats are reconciled
        with it and its end is seen."""
        entry = self._requests.get(from_replica, {}).pop(request_id, None)
        if entry is not None:
            self._requests.setdefault(to_replica, {})[request_id] = entry

    def first_token(self, replica_id: str, request_id: str) -> None:
        entry = self._requests.get(replica_id, {}).get(request_id)
        if entry is not None:
            entry[2] = None
            self._first_token_at[replica_id] = self._clock()

    def ended(self, replica_id: str, request_id: str) -> None:
        now = self._clock()
        mine = self._requests.get(replica_id, {})
        if request_id in mine:
            mine[request_id][1] = now
        for rid in [rid for rid, (_, ended, _) in mine.items() if ended is not None and now - ended > self.RETAIN_S]:
            del mine[rid]

    def views(self, beats: Sequence[ReplicaStats], conversation: PrefixKey | None = None) -> list[ReplicaView]:
        """The planner's view of each replica for a turn whose prompt is `conversation`: others' requests as of its
        heartbeat, and this ingress's now; its arrival rate without the conversation's own turns. Built for every live
        replica on each turn, so the conversation's block hashes are collected once and a replica this ingress has
        sent nothing to lately costs one view."""
        now = self._clock()
        own = frozenset(conversation.block_hashes) if conversation is not None else frozenset()
        return [self._view(beat, own, now) for beat in beats]

    def _view(self, beat: ReplicaStats, own: frozenset[BlockHash], now: float) -> ReplicaView:
        rate = self._arrival_rate(beat.replica_id, own, now)
        mine = self._requests.get(beat.replica_id)
        if not mine:
            return ReplicaView(beat.replica_id, running=beat.running + beat.waiting, decode_tok_s=beat.decode_tok_s,
                               arrival_rate=rate)
        seen_by_heartbeat = live = prefill_tokens = prefilling = 0
        oldest = now
        for started, ended, pending in mine.values():
            if started <= beat.at and (ended is None or ended > beat.at):
                seen_by_heartbeat += 1
            if ended is None:
                live += 1
                if pending is not None:
                    prefilling += 1
                    prefill_tokens += pending
                    oldest = min(oldest, started)
        elapsed_ms = 0.0
        if prefilling:
            # The engine has worked on these prefills since the oldest was sent, or since the prefill before it in
            # line gave its first token: that part of them is done.
            began = max(oldest, self._first_token_at.get(beat.replica_id, oldest))
            elapsed_ms = max(0.0, now - began) * 1e3
        others = max(0, beat.running + beat.waiting - seen_by_heartbeat)
        return ReplicaView(
            beat.replica_id,
            running=others + live - prefilling,
            waiting=0,
            decode_tok_s=beat.decode_tok_s,
            prefill_tokens=prefill_tokens,
            prefilling=prefilling,
            arrival_rate=rate,
            prefill_elapsed_ms=elapsed_ms,
        )

    def _arrival_rate(self, replica_id: str, own: frozenset[BlockHash], now: float) -> float:
        """Requests per second this ingress sent to the replica over the last RATE_WINDOW_S, not counting those
        whose prompt ended at one of `own`'s blocks (the earlier turns of the planned turn's conversation): the traffic
        a placement of its next turn would slow is the other conversations'. Counted with its own, a conversation
        living on the quieter of two busy engines saw its own turns there as traffic its stay elsewhere would slow,
        and two engines holding two conversations each priced staying and moving alike: both stayed busy side by
        side for the rest of those conversations."""
        arrivals = self._arrivals.get(replica_id)
        if not arrivals:
            return 0.0
        since = now - self.RATE_WINDOW_S
        while arrivals and arrivals[0][0] < since:
            arrivals.popleft()
        count = len(arrivals)
        if own:
            count -= sum(1 for _, end in arrivals if end in own)
        return count / self.RATE_WINDOW_S
