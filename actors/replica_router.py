"""Serve request router for engine replicas: send a request to the replica its plan names.

The planner picks a replica per turn (where the KV is, or who should pull it). Requests without a
target, or whose target has gone (died, scaled down), fall back to Serve's power-of-two choice: the
turn still runs, only without the planned reuse.
"""

from __future__ import annotations

import logging

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import LocalityMixin, MultiplexMixin, PendingRequest, RequestRouter, RunningReplica

logger = logging.getLogger(__name__)


def requested_replica(pending_request: PendingRequest | None) -> str | None:
    """The replica id a pending `generate` call asks for, if any."""
    if pending_request is None or not pending_request.args:
        return None
    request = pending_request.args[0]
    if isinstance(request, dict):
        return request.get("target_replica")
    return getattr(request, "target_replica", None)


class TargetReplicaRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Routes to `request.target_replica` when that replica is alive, else power of two choices.

    Serve's own power-of-two router also mixes in `FIFOMixin`, which hands a replica found for one pending request
    to the oldest pending request instead: with several turns routing at once, a turn ran on the replica planned
    for another (seen under the multi-turn benchmark's bursts of first turns). Without it, Serve's base router gives
    each request the replica chosen for it.
    """

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        target = requested_replica(pending_request)
        if target is not None:
            for replica in candidate_replicas:
                if replica.replica_id.unique_id == target:
                    return [[replica]]
            logger.debug("target replica %s is gone; falling back to power of two choices", target)
        return await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)
