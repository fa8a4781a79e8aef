"""A replica's reports to the KV directory: heartbeats (identity and load) and its engine's prefix-cache events.

Runs on a thread of its own with its own event loop, so a busy serving loop cannot starve it. When the replica
stops, the thread's last act is to deregister it: the directory forgets the replica and everything it holds
before the engine shuts down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from actors.kv_events import KVEventForwarder, ResidentTracker, ray_sender
from actors.replica_api import ReplicaIdentity, ReplicaStats

logger = logging.getLogger(__name__)


class DirectoryReporter:
    """Every `heartbeat_s`: identity and load (every `idle_heartbeat_s` while they do not change).
    Continuously: blocks stored, evicted, cleared (if `events`)."""

    idle_heartbeat_s = 2.0

    def __init__(
        self,
        directory: Any,
        identity: ReplicaIdentity,
        stats: Callable[[], ReplicaStats],
        heartbeat_s: float,
        events: tuple[str, str] | None,
        event_batch: type | None = None,
    ) -> None:
        """`events`: the engine's (publish, replay) KV event endpoints; `event_batch`: the struct their batches decode
        into (`KVEventForwarder`'s `batch_type`)."""
        self.directory = directory
        self.identity = identity
        self.stats = stats
        self.heartbeat_s = heartbeat_s
        self.events = events
        self.event_batch = event_batch
        self._stopping = threading.Event()
        # Set once `_run` is on its loop: `stop` wakes the loop through it (a timer sleeps; no thread waits).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._woken: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="kvrelay-reporter", daemon=True)
        self._thread.start()

    async def _run(self) -> None:
        self._woken, self._loop = asyncio.Event(), asyncio.get_running_loop()
        directory, replica_id = self._own_handle(), self.identity.replica_id
        forwarder = None
        if self.events is not None:
            tracker = ResidentTracker(self.identity.model, self.identity.block_size)
            publish, replay = self.events
            forwarder = KVEventForwarder(replica_id, publish, tracker, ray_sender(directory), replay_endpoint=replay,
                                         batch_type=self.event_batch)
            forwarder.start()
        first = True
        last_sent: dict[str, Any] | None = None
        last_sent_at = 0.0
        while not await self._stopped_within(self.heartbeat_s):
            stats = self.stats()
            figures = stats.model_dump(exclude={"at"})
            # An idle replica's figures do not change: beat less often (every beat wakes the directory and every
            # ingress's mirror), still well within the directory's dead-after window.
            if figures == last_sent and time.monotonic() - last_sent_at < self.idle_heartbeat_s:
                continue
            try:
                new = await directory.heartbeat.remote(self.identity, stats)
                last_sent, last_sent_at = figures, time.monotonic()
                if new and not first and forwarder is not None:
                    forwarder.resync()  # the directory had dropped us (restart, missed beats): re-report
                first = False
            except Exception as exc:  # the directory restarts empty; the next beat re-registers us
                logger.warning("heartbeat to the KV directory failed: %s", exc)
        if forwarder is not None:
            await forwarder.stop()
        try:
            await asyncio.wait_for(directory.deregister.remote(replica_id), timeout=5)
        except Exception as exc:  # the directory may be gone already (app teardown)
            logger.warning("could not deregister %s from the KV directory: %s", replica_id, exc)

    async def _stopped_within(self, seconds: float) -> bool:
        """Sleep `seconds` or until `stop`; True once stopping."""
        if not self._stopping.is_set():
            assert self._woken is not None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._woken.wait(), seconds)
        return self._stopping.is_set()

    def _own_handle(self) -> Any:
        """A Serve handle whose router lives on this thread's loop. In Ray Serve's throughput-optimized mode a
        handle routes on the loop that first used it, and the one passed to the replica belongs to the serving
        loop; calling it from here lost heartbeats. A plain Ray actor handle (tests) is used as is."""
        from ray.serve.handle import DeploymentHandle

        if isinstance(self.directory, DeploymentHandle):
            from ray import serve

            did = self.directory.deployment_id
            return serve.get_deployment_handle(did.name, did.app_name)
        return self.directory

    def stop(self, timeout_s: float = 10) -> None:
        """Stop reporting and deregister (blocks until done, at most `timeout_s`)."""
        self._stopping.set()
        loop, woken = self._loop, self._woken
        if loop is not None and woken is not None:
            with contextlib.suppress(RuntimeError):  # the loop has ended already
                loop.call_soon_threadsafe(woken.set)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout_s)
