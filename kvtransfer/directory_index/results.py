"""What the KV directory's updates return, and the prefix-cache ops a replica's KV events become."""

from __future__ import annotations

from typing import NamedTuple

from kvtransfer.prefix_key import BlockHash


class RecordResult(NamedTuple):
    """`kept` is False when the hold was not kept: no full block, already expired, or evicted at once."""

    kept: bool
    new_entries: int
    evicted_chains: int


class HeldPrefix(NamedTuple):
    """What the directory keeps of the tokens a hold covers, all that recording it needs: the chained hashes of its full
    blocks, the token ids of its partial last block (packed as `PrefixKey.tokens` is), and where the prompt of the turn
    that left it ended (`PrefixKey.prompt_end`; None if unknown). `KVDirectory.held_prefix` builds one from a key."""

    hashes: bytes
    tail: bytes
    prompt_end: BlockHash | None


class StoreResident(NamedTuple):
    """A replica's prefix cache stored these consecutive blocks after `parent` (None: from block one)."""

    parent: BlockHash | None
    hashes: tuple[BlockHash, ...]


class RemoveResident(NamedTuple):
    """A replica's prefix cache dropped these blocks."""

    hashes: tuple[BlockHash, ...]


class ClearResident(NamedTuple):
    """A replica's prefix cache was reset."""


ResidentOp = StoreResident | RemoveResident | ClearResident


class ResidentResult(NamedTuple):
    """Blocks stored and removed, blocks skipped (unknown parent), and the directory's epoch.

    A changed epoch tells a forwarder the directory restarted empty, so it should re-report its state.
    """

    stored: int
    removed: int
    skipped: int
    epoch: str


class DirectoryStats(NamedTuple):
    entries: int
    bytes: int
    holds: int
    resident_blocks: int
    replicas: int
    lookups: int
    lookup_hits: int
    hit_rate: float
    hold_offers: int
    holds_consumed: int
    holds_expired: int
    chains_evicted: int
    resident_skipped: int
    max_entries: int
    max_bytes: int
    epoch: str
    holds_by_replica: dict[str, int]  # pending holds per replica id (replicas holding none left out)
    # Counted by the directory actor: replicas that left by deregistering (scale-down, shutdown, a failed pull
    # from them) and replicas dropped because their heartbeats stopped (killed, hung, cut off).
    replicas_left: int = 0
    replicas_silent: int = 0
    # The directory actor's change feed: the sequence number of its latest update (a mirror at a lower one lags).
    feed_seq: int = 0
