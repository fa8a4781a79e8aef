"""What the KV directory answers and the planner, the turn runner and the ingress read: who holds a prefix.

Plain NamedTuples with no imports of ours, so the directory (`actors/`) and the pure planner (`kvtransfer/`)
both depend on this module and never on each other.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

HoldingKind = Literal["hold", "resident"]


class HoldOffer(NamedTuple):
    """An unexpired exported hold whose every token is a prefix of the query: pullable over NIXL.

    In-process, `kv_transfer_params` is the directory's own dict: read it, copy it before changing it.
    """

    hold_id: int
    replica_id: str
    num_tokens: int
    expires_at: float
    kv_transfer_params: dict[str, Any]


class ReplicaMatch(NamedTuple):
    """What one replica holds of a query.

    `num_tokens` is the longest prefix of the query this replica holds. `cached_tokens` is the full-block
    part of it that sits in the replica's prefix cache (reported by KV events, or pinned by its holds);
    `hold` is the longest pullable hold. `kind` is `"hold"` when the hold reaches `num_tokens`.
    """

    replica_id: str
    num_tokens: int
    kind: HoldingKind
    cached_tokens: int
    hold: HoldOffer | None


class LookupResult(NamedTuple):
    """Per replica what it holds of the query, longest first; replicas holding nothing are left out."""

    query_tokens: int
    matches: tuple[ReplicaMatch, ...]

    def best(self) -> ReplicaMatch | None:
        return self.matches[0] if self.matches else None

    def get(self, replica_id: str) -> ReplicaMatch | None:
        return next((m for m in self.matches if m.replica_id == replica_id), None)
