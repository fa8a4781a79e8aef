"""Serve request router for engine replicas: send a request to the replica its plan names.

The planner picks a replica per turn (where the KV is, or who should pull it). Requests without a
target, or whose target has gone (died, scaled down), fall back to Serve's power-of-two choice: the
turn still runs, only without the planned reuse.
"""

from __future__ import annotations

import logging

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RunningReplica

logger = logging.getLogger(__name__)


def requested_replica(pending_request: PendingRequest | None) -> str | None:
    """The replica id a pending `generate` call asks for, if any."""
    if pending_request is None or not pending_request.args:
        return None
    request = pending_request.args[0]
    if isinstance(request, dict):
        return request.get("target_replica")
    return getattr(request, "target_replica", None)


class TargetReplicaRouter(PowerOfTwoChoicesRequestRouter):
    """Routes to `request.target_replica` when that replica is alive, else power of two choices.

    Serve routes each pending request in its own task, and its FIFO rule hands whatever replica a task finds to the
    oldest pending request of all. So while one turn's target was full, or slow to answer Serve's queue-length
    probe, the replica found for the next turn went to it, and it ran where it was not planned (seen under the
    multi-turn benchmark's bursts of first turns). Here a replica goes to the oldest pending request that may run
    there: one that targets it, targets no replica, or targets one Serve no longer has. (Matching each request to
    its own task instead, Serve's other rule, fails for the several calls one HTTP request makes: they share the
    id it matches by.)
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
        return await super().choose_replicas(candidate_replicas, pending_request)

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata: object = None) -> None:
        found = replica.replica_id.unique_id
        known = {r.replica_id.unique_id for r in self._replicas_list}

        def may_run_here(request: PendingRequest) -> bool:
            target = requested_replica(request)
            return target is None or target == found or target not in known

        pending = next((p for p in self._pending_requests_to_fulfill if not p.future.done() and may_run_here(p)), None)
        if pending is None:
            return  # nobody waiting may run there: the task routing for its request tries again
        self._pending_requests_to_fulfill.remove(pending)
        self._cancel_routing_task_for_pending_request(pending)
        self._record_queue_wait_time(pending)
        pending.future.set_result(replica)
        self._remove_pending_request_from_indices(pending)
