"""A pulled hold is used only if it was read inside its lease, and a release is sent only while it can still arrive.

A holder frees a hold's blocks at the first engine step after its lease ends (`kv_lease_duration` after the request
finished, later if a reader's heartbeat extended it), whether or not a reader is copying them: NIXL reads are
one-sided, the holder cannot see them. A busy holder then gives the blocks to other requests at once. Nothing in
vLLM stops a read of a P-style hold (the kind kvrelay exports) from starting or finishing after that point: its
`remote_blocks_expiry_time` is None. And a reader's engine may be seconds late: a request queued behind a long
prefill step starts its read, or a release its notice, only when that step ends.

So the holder stamps each hold with the end of its lease, in its own `perf_counter` clock (`LEASE_END_KEY`, carried
to the reader in the hold's params). Before the reader starts a read, and again when the read has finished, it
checks the lease with `margin_s` to spare, translating clocks with the offset vLLM measured at the NIXL handshake:

- a read that cannot start in time is not started, and one that finished too late is refused: either way the
  request fails as a failed pull does, and kvrelay computes the turn instead. A read that finished in time read
  blocks the holder had not freed (it frees only after the lease), so the right ones.
- a release (or a full local hit's notice) that would arrive after the lease is not sent: the lease frees the
  blocks anyway, and a notice the holder no longer recognises is logged by vLLM as an ERROR ("Potentially invalid
  KV blocks for unrecognized request").

The holder's scheduler and its workers share one clock (a replica's engine runs on one node).
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger(__name__)

# In an exported hold's kv_transfer_params: the holder's perf_counter time at which its lease ends.
LEASE_END_KEY = "kvrelay_lease_end"
# kv_connector_extra_config: how long before a lease ends a read must have finished (covers the clock offset's error
# and a notice's trip), in seconds.
LEASE_MARGIN_KEY = "kvrelay_lease_margin_s"
# Attribute of the scheduler's connector metadata: {request id: lease end} for this step's reads and notices.
METADATA_ATTR = "kvrelay_lease_ends"


def stamp_lease(params: dict[str, Any], lease_end: float | None) -> dict[str, Any]:
    """A hold's params with the end of its lease (the holder's scheduler deadline), where the holder keeps one."""
    if lease_end is not None:
        params[LEASE_END_KEY] = lease_end
    return params


def lease_ends(pending_recv: dict[str, tuple[Any, ...]]) -> dict[str, float]:
    """The lease ends of the holds this step's reads and notices name (vLLM's `_reqs_need_recv`, scheduler side)."""
    ends = {}
    for req_id, entry in pending_recv.items():
        params = entry[0].kv_transfer_params or {}
        if params.get(LEASE_END_KEY) is not None:
            ends[req_id] = float(params[LEASE_END_KEY])
    return ends


class LeaseGuard:
    """The reader's side, on vLLM's NIXL worker: which reads and notices may start, and which finished reads count."""

    def __init__(self, worker: Any, margin_s: float) -> None:
        self.worker = worker
        self.margin_s = margin_s
        # (holder engine, lease end) of each read in flight, and of each notice waiting for its handshake.
        self._leases: dict[str, tuple[str, float]] = {}
        self.declined: set[str] = set()  # reads not started (they fail; the turn is computed instead)
        self.reads_declined = 0
        self.reads_refused = 0
        self.notices_dropped = 0

    def _in_time(self, engine_id: str, lease_end: float) -> bool | None:
        """Whether now is at least `margin_s` before the lease ends in this clock; None before the handshake (the
        clock offset is not known yet: the read waits for the handshake and is checked then)."""
        offset = self.worker._engine_clock_offset.get(engine_id)
        if offset is None:
            return None
        return time.perf_counter() + self.margin_s < lease_end - offset

    def admit(self, metadata: Any) -> None:
        """Remove from this step's reads and notices (and from those that waited for a handshake) the ones too late
        to start; remember the lease of each read that starts."""
        ends: dict[str, float] = getattr(metadata, METADATA_ATTR, None) or {}
        for req_id, meta in list(metadata.reqs_to_recv.items()):
            lease_end = ends.get(req_id)
            if lease_end is None or meta.remote is None:
                continue
            in_time = self._in_time(meta.remote.engine_id, lease_end)
            if in_time is False:
                del metadata.reqs_to_recv[req_id]
                self._decline(req_id, meta)
            elif meta.awaiting_kvs or in_time is None:
                self._leases[req_id] = (meta.remote.engine_id, lease_end)
        self._admit_after_handshake()

    def _admit_after_handshake(self) -> None:
        ready: queue.Queue = self.worker._ready_requests
        kept = []
        while True:
            try:
                req_id, meta = ready.get_nowait()
            except queue.Empty:
                break
            lease = self._leases.get(req_id)
            if lease is not None and self._in_time(*lease) is False:
                self.worker._recving_metadata.pop(req_id, None)
                self._decline(req_id, meta)
                continue
            if not meta.awaiting_kvs:
                self._leases.pop(req_id, None)  # a notice: sent now, nothing to check later
            kept.append((req_id, meta))
        for item in kept:
            ready.put_nowait(item)

    def _decline(self, req_id: str, meta: Any) -> None:
        self._leases.pop(req_id, None)
        if meta.awaiting_kvs:
            self.reads_declined += 1
            self.declined.add(req_id)
            logger.warning("request %s: hold %s of engine %s ends its lease before a read could finish; not read, "
                           "the turn is computed instead", req_id, meta.remote.request_id, meta.remote.engine_id)
        else:  # a release or a full local hit's notice: the lease frees the blocks anyway
            self.notices_dropped += 1
            logger.debug("request %s: no notice for hold %s, whose lease ends first", req_id, meta.remote.request_id)

    def refuse_late(self, finished: Iterable[str], failed: set[str]) -> set[str]:
        """Of the reads finished this step, those that finished too close to (or after) their lease's end: the
        holder may have freed and reused the blocks meanwhile, so their KV is refused."""
        refused = set()
        for req_id in finished:
            lease = self._leases.pop(req_id, None)
            if lease is None or req_id in failed:
                continue
            if not self._in_time(*lease):
                refused.add(req_id)
                self.reads_refused += 1
                logger.warning("request %s: its read of engine %s's hold finished %.3f s before the lease's end "
                               "(%.3f s needed); refused, the turn is computed instead", req_id, lease[0],
                               lease[1] - self.worker._engine_clock_offset.get(lease[0], 0.0) - time.perf_counter(),
                               self.margin_s)
        return refused
