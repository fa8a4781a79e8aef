"""What engine replicas, the KV directory, its mirrors, the planner and the turn runner hand each other.

A `Hold` is an engine's exported KV, parsed once from vLLM's `kv_transfer_params` where the replica receives it
(the wire contract is written down in `kvtransfer/connector.py`) and named there by its `HoldId`; the dict form
exists again only where a replica hands it back to vLLM. `LookupResult` is the directory's answer to "who holds
this prefix". Nothing here imports anything of ours, so `actors/` and the pure planner both depend on this module,
never on each other.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, NamedTuple

HoldingKind = Literal["hold", "resident"]

# The fields a pullable hold must carry, and the flags that say what an engine should do with one.
_REQUIRED = ("remote_block_ids", "remote_engine_id", "remote_host", "remote_port", "remote_num_tokens")
_FLAGS = ("do_remote_prefill", "do_remote_decode")
_TYPED = (*_REQUIRED, "remote_request_id", "remote_blocks_expiry_time")


def token_digest(token_ids: Sequence[int]) -> str:
    """A digest of token ids: equal digests mean the same tokens in the same order."""
    return hashlib.blake2b(b"".join(t.to_bytes(4, "little") for t in token_ids), digest_size=16).hexdigest()


class HoldId(NamedTuple):
    """A hold's one name, minted by the replica that exports it: its engine and a serial the replica counts up. The KV
    directory actor, its change feed and every ingress's mirror name the hold by it, and taking it by this id takes
    exactly that hold. An engine id is new at every engine start (`{replica_id}-{random}`), so an id never names two
    holds; within one engine, a higher serial is a newer hold."""

    engine_id: str
    serial: int


@dataclass(frozen=True, slots=True)
class Hold:
    """A finished request's KV blocks that its engine keeps for one pull by another engine (NIXL), until its lease ends.

    Read only: the directory and its mirrors share one instance between their records and their offers.
    """

    engine_id: str  # the holder's engine (remote_engine_id)
    host: str  # the holder's NIXL side channel (remote_host, remote_port)
    port: int
    block_ids: list[list[int]]  # per KV cache group (remote_block_ids)
    num_tokens: int  # the leading tokens of prompt + output whose KV the blocks hold (remote_num_tokens)
    hold_id: HoldId  # minted by the holder's replica at export
    request_id: str | None = None  # the holder's internal request id (remote_request_id)
    expiry_time: float | None = None  # the holder's perf_counter deadline, if it sent one (remote_blocks_expiry_time)
    # The other fields vLLM sent (parallel sizes, transfer mode), handed back to it unchanged.
    extra: dict[str, Any] = field(default_factory=dict)
    # Which tokens the blocks hold (`token_digest` of the first `num_tokens`), and the holder's seal over every
    # field: vLLM's connector reads whatever blocks a hold names and checks no token, so a replica reads a hold only
    # if a replica of its app sealed it (`authentic`) for exactly the tokens its prompt starts with (`covers`).
    digest: str | None = None
    seal: str | None = None

    @classmethod
    def from_params(cls, params: dict[str, Any] | None, hold_id: HoldId) -> Hold | None:
        """The hold an engine's returned `kv_transfer_params` describe, named `hold_id`; None if they describe no
        pullable hold."""
        if not params or any(params.get(f) is None for f in _REQUIRED) or params["remote_num_tokens"] <= 0:
            return None
        return cls(
            engine_id=params["remote_engine_id"],
            host=params["remote_host"],
            port=params["remote_port"],
            block_ids=params["remote_block_ids"],
            num_tokens=int(params["remote_num_tokens"]),
            hold_id=hold_id,
            request_id=params.get("remote_request_id"),
            expiry_time=params.get("remote_blocks_expiry_time"),
            extra={k: v for k, v in params.items() if k not in _TYPED and k not in _FLAGS},
        )

    def sealed(self, key: bytes, token_ids: Sequence[int]) -> Hold:
        """This hold, as its holder vouches for it: `token_ids` are the request's prompt and output."""
        unsealed = replace(self, digest=token_digest(token_ids[: self.num_tokens]), seal=None)
        return replace(unsealed, seal=unsealed._mac(key))

    def authentic(self, key: bytes) -> bool:
        """Whether a replica holding `key` sealed this very hold (no field changed since)."""
        return self.seal is not None and self.digest is not None and hmac.compare_digest(self.seal, self._mac(key))

    def covers(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether the held tokens are exactly the first `num_tokens` of this prompt."""
        return (self.digest is not None and len(prompt_token_ids) >= self.num_tokens
                and hmac.compare_digest(self.digest, token_digest(prompt_token_ids[: self.num_tokens])))

    def _mac(self, key: bytes) -> str:
        fields = [self.engine_id, self.host, self.port, self.block_ids, self.num_tokens, self.hold_id, self.request_id,
                  self.expiry_time, self.extra, self.digest]
        return hmac.new(key, json.dumps(fields, sort_keys=True).encode(), hashlib.sha256).hexdigest()

    def pull_params(self) -> dict[str, Any]:
        """Params for a turn on another engine that reads this hold's tokens (and leaves a hold of its own)."""
        return self._params(do_remote_prefill=False, do_remote_decode=True)

    def release_params(self) -> dict[str, Any]:
        """Params for `AsyncLLM.notify_kv_transfer_request_rejected` on another engine: free the hold early."""
        return self._params(do_remote_prefill=True, do_remote_decode=False)

    def _params(self, do_remote_prefill: bool, do_remote_decode: bool) -> dict[str, Any]:
        return {
            **self.extra,
            "do_remote_prefill": do_remote_prefill,
            "do_remote_decode": do_remote_decode,
            "remote_block_ids": self.block_ids,
            "remote_engine_id": self.engine_id,
            "remote_request_id": self.request_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_num_tokens": self.num_tokens,
            "remote_blocks_expiry_time": self.expiry_time,
        }


class HoldOffer(NamedTuple):
    """An unexpired exported hold whose every token is a prefix of the query: pullable over NIXL.

    Take it by its `hold_id` (`consume_hold`), from the directory actor or any mirror of it.
    """

    replica_id: str
    num_tokens: int
    expires_at: float
    hold: Hold

    @property
    def hold_id(self) -> HoldId:
        return self.hold.hold_id


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
