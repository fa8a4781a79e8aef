"""How busy the replicas are, as the planner reads it: busy engines beside each replica on its node, and which
replica a session prefers. Pure functions of the live replicas' views, shared by the ingress and the fleet study."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from kvtransfer.options import PeerLoad, ReplicaView


def with_busy_peers(views: list[ReplicaView], node_of: dict[str, str]) -> list[ReplicaView]:
    """Each view with the other replicas on its node that are busy (running, queued or prefilling): how many,
    and, per busy one, its requests waiting for their first token, the prompt tokens they still need and its
    recent arrival rate."""
    busy = [v for v in views if not v.idle]
    out = []
    for v in views:
        node = node_of.get(v.replica_id)
        peers = [b for b in busy if b.replica_id != v.replica_id and node_of.get(b.replica_id) == node]
        out.append(v._replace(peers=tuple(PeerLoad(p.waiting + p.prefilling, p.prefill_tokens, p.arrival_rate)
                                          for p in peers)))
    return out


def preferred_replica(session_id: str | None, replica_ids: Sequence[str]) -> str | None:
    """Rendezvous hashing: a session keeps its replica while that replica lives, and moves minimally."""
    if not session_id or not replica_ids:
        return None

    def score(replica_id: str) -> bytes:
        return hashlib.blake2b(f"{session_id}\x00{replica_id}".encode(), digest_size=8).digest()

    return max(replica_ids, key=score)
