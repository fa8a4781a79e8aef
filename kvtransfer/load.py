"""How busy the replicas are, as the planner reads it: one view per live replica (`ReplicaView`), the busy engines
beside each on its node, and which replica a session prefers. Shared by the ingress and the fleet study."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NamedTuple


class ReplicaView(NamedTuple):
    """A live replica's load as the planner reads it: its heartbeat (`ReplicaStats`) reconciled with what this
    ingress has sent since (`app/inflight.py`), and the busy replicas beside it on its node."""

    replica_id: str
    running: int = 0
    waiting: int = 0
    decode_tok_s: float | None = None
    # Prompt tokens of requests known to be queued or prefilling there now (they run before a new turn).
    prefill_tokens: int = 0
    # Requests known to wait for their first token there (their tokens are in `prefill_tokens`).
    prefilling: int = 0
    # Requests per second sent there lately by other conversations than the planned turn's: how many arrive while
    # a new turn's prefill holds it.
    arrival_rate: float = 0.0
    # Other replicas on the same node that are busy now (they share its CPUs), each as its own view (without peers).
    peers: tuple[ReplicaView, ...] = ()
    # How long its engine has been computing the prefills in `prefill_tokens` (since the oldest was sent, or since the
    # prefill before it gave its first token, whichever came later): the part of them already done. 0 where
    # `prefill_tokens` counts only what is still to compute (the fleet study's engines report that).
    prefill_elapsed_ms: float = 0.0

    def left_of(self, queued_ms: float) -> float:
        """What remains of prefills priced at `queued_ms` in all, less what the engine has done of them."""
        return max(0.0, queued_ms - self.prefill_elapsed_ms)

    @property
    def busy_peers(self) -> int:
        return len(self.peers)

    @property
    def awaiting_first_token(self) -> int:
        """Requests there that have not had their first token yet: queued, or known to be prefilling."""
        return self.waiting + self.prefilling

    @property
    def idle(self) -> bool:
        return not (self.running or self.waiting or self.prefill_tokens or self.prefilling)




def with_busy_peers(
    views: list[ReplicaView], node_of: dict[str, str], shared_compute: bool = True
) -> list[ReplicaView]:
    """Each view with the other replicas on its node that are busy (running, queued or prefilling): how many,
    and, per busy one, its requests waiting for their first token, the prompt tokens they still need and its
    recent arrival rate. The idle views of a node share one tuple of peers (the planner sums over each tuple once).
    Where a node's engines do not share compute (`CostModel.shared_compute`: a GPU each), none slows another and
    the views come back as they are: on one node of 64 such replicas, collecting every busy one's peers was most of
    a plan's time."""
    if not shared_compute:
        return views
    busy: dict[str | None, list[ReplicaView]] = {}
    for v in views:
        if not v.idle:
            busy.setdefault(node_of.get(v.replica_id), []).append(v._replace(peers=()) if v.peers else v)
    shared = {node: tuple(peers) for node, peers in busy.items()}
    out = []
    for v in views:
        peers = shared.get(node_of.get(v.replica_id), ())
        if not v.idle:
            peers = tuple(p for p in peers if p.replica_id != v.replica_id)
        out.append(v._replace(peers=peers))
    return out


def preferred_replica(session_id: str | None, replica_ids: Sequence[str]) -> str | None:
    """Rendezvous hashing: a session keeps its replica while that replica lives, and moves minimally."""
    if not session_id or not replica_ids:
        return None

    def score(replica_id: str) -> bytes:
        return hashlib.blake2b(f"{session_id}\x00{replica_id}".encode(), digest_size=8).digest()

    return max(replica_ids, key=score)
