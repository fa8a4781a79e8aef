"""The KV directory: an exact, bounded, fast record of which engine replica holds which prefix's KV.

`KVDirectory` is the synchronous core (pure Python, single-threaded, injectable clock). `KVDirectoryActor`
is the async Ray actor that owns one (`app/builder.py` deploys it). The turn planner asks a copy of it, per
turn, who can serve the history's KV: as a local prefix-cache hit (`"resident"`) or as an exported hold that
another replica can pull over NIXL (`"hold"`).

The directory is a hint that is safe to lose: a missing entry costs speed, never a wrong answer. Matched
counts are exact for what it was told (full blocks by 128-bit chained hash, a hold's partial last block
by its stored tokens), and an expired or consumed hold is never offered.
"""

from __future__ import annotations

import heapq
import logging
import pickle
import sys
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from actors.directory_changes import ChangeLog, Changes, Snapshot
from actors.prefix_hash import HASH_BYTES, TOKEN_BYTES, BlockHash, PrefixKey, Scope
from actors.replica_api import ReplicaIdentity, ReplicaStats
from actors.replica_registry import DEFAULT_DEAD_AFTER_S, ReplicaRegistry
from kvtransfer.types import HoldingKind, HoldOffer, LookupResult, ReplicaMatch

H = HASH_BYTES  # a key's block hashes are packed: block d (1-based depth) is hashes[(d - 1) * H : d * H]

logger = logging.getLogger(__name__)

# NamedTuple construction through its generated __new__ costs a Python call; lookups build three per hit.
_tuple_new = tuple.__new__

DEFAULT_BLOCK_SIZE = 32
DEFAULT_MAX_ENTRIES = 2_000_000
DEFAULT_MAX_BYTES = 512 * 1024**2
# vLLM's puller declines a read within 5 s of the holder's deadline; leave room for routing and queueing.
DEFAULT_EXPIRY_MARGIN_S = 10.0


# ---------------------------------------------------------------------------------------------------------
# Results


class RecordResult(NamedTuple):
    """`hold_id` is None when the hold was not kept: no full block, already expired, or evicted at once."""

    hold_id: int | None
    new_entries: int
    evicted_chains: int


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


# ---------------------------------------------------------------------------------------------------------
# Internal records

_REF_BITS = 32  # per-replica reference counts are packed into one int, 32 bits per replica
_REF_MASK = (1 << _REF_BITS) - 1


class _Node:
    """One block of one prefix chain. Per replica, a reference count of why the replica holds it.

    A replica holds a node as long as it has a direct reason (a hold ending here, or its resident flag)
    or holds one of the node's children: so every replica's holdings are closed under "parent of", which
    lets lookups binary-search a query's chain instead of walking it.
    """

    __slots__ = ("parent", "mask", "hmask", "hrefs", "rmask", "rrefs", "ends")

    def __init__(self, parent: BlockHash | None) -> None:
        self.parent = parent
        self.mask = 0  # hmask | rmask: the replicas holding this node at all (what lookups read)
        self.hmask = 0  # replicas holding this node through holds
        self.hrefs = 0  # packed counts: holds ending here + children in hmask, per replica
        self.rmask = 0  # replicas holding this node in their prefix cache (events)
        self.rrefs = 0  # packed counts: resident flag + children in rmask, per replica
        self.ends: list[_Hold] | None = None  # holds whose full blocks end here


class _Hold:
    __slots__ = ("hold_id", "replica", "end", "num_tokens", "tail", "params", "expires_at", "nbytes", "used")

    def __init__(
        self,
        hold_id: int,
        replica: int,
        end: BlockHash,
        num_tokens: int,
        tail: bytes,
        params: dict[str, Any],
        expires_at: float,
        nbytes: int,
    ) -> None:
        self.hold_id = hold_id
        self.replica = replica
        self.end = end
        self.num_tokens = num_tokens
        self.tail = tail
        self.params = params
        self.expires_at = expires_at
        self.nbytes = nbytes
        self.used = False  # offered since it last reached the LRU's old end (second-chance LRU)


class _Segment:
    """The blocks of one resident store op: the LRU unit for prefix-cache entries."""

    __slots__ = ("chain_id", "replica", "hashes", "live", "parent_seg")

    def __init__(self, chain_id: int, replica: int, parent_seg: _Segment | None) -> None:
        self.chain_id = chain_id
        self.replica = replica
        self.hashes: list[BlockHash] = []
        self.live = 0
        self.parent_seg = parent_seg


class _Replica:
    __slots__ = ("replica_id", "index", "holds", "resident", "holes", "segments")

    def __init__(self, replica_id: str, index: int) -> None:
        self.replica_id = replica_id
        self.index = index
        self.holds: set[int] = set()
        self.resident: dict[BlockHash, _Segment] = {}
        # Nodes this replica holds only because resident children do (vLLM dropped the block itself):
        # a prefix-cache match stops there. Rare: vLLM evicts a chain's tail before its head.
        self.holes: set[BlockHash] = set()
        self.segments: set[int] = set()


def _alloc(obj: Any) -> int:
    """Bytes the allocator really hands out for `obj` (CPython rounds small blocks up to 16)."""
    return (sys.getsizeof(obj) + 15) & ~15


def _deep_size(obj: Any, _depth: int = 0) -> int:
    """Approximate bytes of a kv_transfer_params-like value (dicts, lists, scalars).

    Small ints and dict keys are shared (cached or interned) and not counted.
    """
    if type(obj) is int and -5 <= obj <= 256:
        return 0
    size = _alloc(obj)
    if _depth > 4:
        return size
    if isinstance(obj, dict):
        return size + sum(_deep_size(v, _depth + 1) for v in obj.values())
    if isinstance(obj, list | tuple):
        return size + sum(_deep_size(v, _depth + 1) for v in obj)
    return size


# Accounting estimates, checked against tracemalloc by the benchmark. A dict slot costs three pointers
# in the entries table plus index space, at the table's load between one third and two thirds.
_DICT_SLOT_BYTES = 56
NODE_BYTES = _alloc(_Node(None)) + _alloc(b"\0" * HASH_BYTES) + _DICT_SLOT_BYTES
_HOLD_BYTES = _alloc(_Hold(0, 0, b"", 0, b"", {}, 0.0, 0)) + 3 * _DICT_SLOT_BYTES + 64
_SEGMENT_BYTES = _alloc(_Segment(0, 0, None)) + _alloc([]) + 2 * _DICT_SLOT_BYTES
_RESIDENT_BYTES = _DICT_SLOT_BYTES + 8


def _deepest_holding(
    get: Callable[[BlockHash], _Node | None], hashes: bytes, first: _Node, hi: int, want: int
) -> tuple[int, _Node]:
    """The deepest depth in [1, hi] (and its node) held by a replica in `want`; depth 1 is known held.

    Gallops down from `hi` before bisecting: a follow-up turn's history usually ends a block or two
    short of the query, so this is a few probes instead of log2(blocks).
    """
    lo, lo_node, top, step = 1, first, hi, 1
    while lo < top:
        probe = max(lo + 1, top - step + 1)
        node = get(hashes[(probe - 1) * H : probe * H])
        if node is not None and node.mask & want:
            lo, lo_node = probe, node
            break
        top, step = probe - 1, step * 2
    while lo < top:
        mid = (lo + top + 1) >> 1
        node = get(hashes[(mid - 1) * H : mid * H])
        if node is not None and node.mask & want:
            lo, lo_node = mid, node
        else:
            top = mid - 1
    return lo, lo_node


def _match_order(match: ReplicaMatch) -> tuple[int, str]:
    return -match.num_tokens, match.replica_id


def _bits(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


# ---------------------------------------------------------------------------------------------------------
# The core


class KVDirectory:
    """Which replica holds which prefix: exported holds and resident prefix-cache blocks, per replica.

    Not thread-safe: one caller at a time (the actor's event loop). Every public method runs to
    completion without yielding. `lookup` mutates only counters, LRU order and expired holds (purged on
    the way in); `record_hold`, `consume_hold`, `apply_resident` and `drop_replica` mutate the directory;
    `stats` and `check_integrity` read only (`stats` purges expired holds first).

    Holds are independent: a newer, longer hold of the same conversation on the same replica does not
    supersede the older one (both stay pullable until consumed or expired; lookups offer the longest).
    """

    def __init__(
        self,
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_bytes: int = DEFAULT_MAX_BYTES,
        expiry_margin_s: float = DEFAULT_EXPIRY_MARGIN_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if max_entries <= 0 or max_bytes <= 0:
            raise ValueError(f"max_entries and max_bytes must be positive, got {max_entries}, {max_bytes}")
        self.block_size = block_size
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.expiry_margin_s = expiry_margin_s
        self.epoch = uuid.uuid4().hex
        self._clock = clock
        self._nodes: dict[BlockHash, _Node] = {}
        self._holds: dict[int, _Hold] = {}
        self._lru: OrderedDict[int, _Hold | _Segment] = OrderedDict()
        self._expiry: list[tuple[float, int]] = []
        self._replicas: dict[str, _Replica] = {}
        self._by_index: dict[int, _Replica] = {}
        self._next_chain_id = 1
        self._bytes = 0
        self._resident_blocks = 0
        self._lookups = 0
        self._lookup_hits = 0
        self._hold_offers = 0
        self._holds_consumed = 0
        self._holds_expired = 0
        self._chains_evicted = 0
        self._resident_skipped = 0

    # ----- keys and replicas

    def key(self, token_ids: Iterable[int], scope: Scope | tuple[str, str]) -> PrefixKey:
        """The PrefixKey of `token_ids` under `scope` with this directory's block size."""
        return PrefixKey.build(token_ids, Scope(*scope), self.block_size)

    def _as_key(self, query: PrefixKey | Sequence[int], scope: Scope | tuple[str, str] | None) -> PrefixKey:
        if isinstance(query, PrefixKey):
            if query.block_size != self.block_size:
                raise ValueError(
                    f"the key was hashed with block_size={query.block_size} but this directory uses "
                    f"{self.block_size}; build keys with the engines' block size"
                )
            return query
        if scope is None:
            raise ValueError("raw token ids need a scope (model, tenant); or pass a PrefixKey")
        return self.key(query, scope)

    def _replica(self, replica_id: str) -> _Replica:
        rep = self._replicas.get(replica_id)
        if rep is None:
            index = next(i for i in range(len(self._by_index) + 1) if i not in self._by_index)
            rep = _Replica(replica_id, index)
            self._replicas[replica_id] = rep
            self._by_index[index] = rep
        return rep

    def _forget_if_empty(self, rep: _Replica) -> None:
        if self._replicas.get(rep.replica_id) is rep and not (rep.holds or rep.resident or rep.segments):
            del self._replicas[rep.replica_id]
            del self._by_index[rep.index]

    # ----- reference counting on the node chains

    def _new_node(self, key: BlockHash, parent: BlockHash | None) -> _Node:
        node = _Node(parent)
        self._nodes[key] = node
        self._bytes += NODE_BYTES
        return node

    def _acquire_hold(self, hashes: bytes, depth: int, index: int) -> int:
        """One direct hold reference of replica `index` on the node at `depth`; returns nodes created."""
        one, bit = 1 << (_REF_BITS * index), 1 << index
        created = 0
        i = depth - 1
        key: BlockHash | None = hashes[i * H : (i + 1) * H]
        while key is not None:
            # One bytes object per hash: a new node's parent pointer is its new parent's dict key.
            parent = hashes[(i - 1) * H : i * H] if i else None
            node = self._nodes.get(key)
            if node is None:
                node = self._new_node(key, parent)
                created += 1
            node.hrefs += one
            if node.hmask & bit:
                break
            node.hmask |= bit
            node.mask |= bit
            key, i = parent, i - 1
        return created

    def _release(self, key: BlockHash | None, rep: _Replica, resident: bool) -> None:
        """Drop one direct reference of `rep` on `key` and the references it implied on the ancestors."""
        shift, bit = _REF_BITS * rep.index, 1 << rep.index
        one = 1 << shift
        direct = True
        while key is not None:
            node = self._nodes[key]
            if resident:
                node.rrefs -= one
                if (node.rrefs >> shift) & _REF_MASK:
                    if direct:
                        rep.holes.add(key)
                    return
                node.rmask &= ~bit
                node.mask = node.hmask | node.rmask
                rep.holes.discard(key)
            else:
                node.hrefs -= one
                if (node.hrefs >> shift) & _REF_MASK:
                    return
                node.hmask &= ~bit
                node.mask = node.hmask | node.rmask
            if not node.mask:
                del self._nodes[key]
                self._bytes -= NODE_BYTES
            key = node.parent
            direct = False

    # ----- lookups

    def lookup(self, query: PrefixKey | Sequence[int], scope: Scope | tuple[str, str] | None = None) -> LookupResult:
        """Per replica, the longest prefix of the query it holds, and the longest pullable hold.

        Cost: one dict probe for a miss; O(log blocks) probes per distinct depth among the holders plus
        a short walk for hold offers on a hit. Pass a PrefixKey (hashed once by the caller, extended turn
        by turn) to keep hashing off this path.
        """
        key = query if type(query) is PrefixKey else self._as_key(query, scope)
        if key.block_size != self.block_size:
            self._as_key(key, None)  # raises with the explanation
        expiry = self._expiry
        if expiry and self._clock() >= expiry[0][0] - self.expiry_margin_s:
            self._purge_expired()
        self._lookups += 1
        hashes = key.hashes
        get = self._nodes.get
        first = get(hashes[:H]) if hashes else None
        if first is None:
            return LookupResult(key.num_tokens, ())
        matches: list[ReplicaMatch] = []
        # Every replica's holdings are closed under "parent of", so along the query's chain the holder
        # sets are nested: find the deepest depth of the remaining holders, take that level's replicas,
        # repeat below it for the others.
        remaining, hi = first.mask, len(hashes) // H
        while remaining:
            depth, node = _deepest_holding(get, hashes, first, hi, remaining)
            level = node.mask & remaining
            if level & (level - 1) == 0:  # one replica: the common case
                match = self._match_replica(key, self._by_index[level.bit_length() - 1], node, depth)
                if match is not None:
                    matches.append(match)
            else:
                for index in _bits(level):
                    match = self._match_replica(key, self._by_index[index], node, depth)
                    if match is not None:
                        matches.append(match)
            remaining &= ~level
            hi = depth - 1
        if matches:
            self._lookup_hits += 1
            if len(matches) > 1:
                matches.sort(key=_match_order)
        return _tuple_new(LookupResult, (len(key.tokens) // TOKEN_BYTES, tuple(matches)))

    def _deepest(self, hashes: Sequence[BlockHash], hi: int, bit: int) -> int:
        """Deepest depth in [0, hi] whose node this replica holds through holds (prefix-closed)."""
        get = self._nodes.get
        lo = 0
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            node = get(hashes[(mid - 1) * H : mid * H])
            if node is not None and node.hmask & bit:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _match_replica(self, key: PrefixKey, rep: _Replica, deepest: _Node, depth: int) -> ReplicaMatch | None:
        hashes, bit = key.hashes, 1 << rep.index
        if deepest.hmask & bit:
            hold_depth = cached = depth
        else:
            cached = depth
            if rep.holes:
                cached = next((i for i in range(depth) if hashes[i * H : (i + 1) * H] in rep.holes), depth)
            hold_depth = self._deepest(hashes, depth - 1, bit) if rep.holds else 0
            cached = max(cached, hold_depth)
            if cached and (seg := rep.resident.get(hashes[(cached - 1) * H : cached * H])) is not None:
                self._touch_segment(seg)
        offer = self._offer(key, rep, hold_depth, deepest if hold_depth == depth else None) if rep.holds else None
        cached_tokens = cached * self.block_size
        num_tokens = max(cached_tokens, offer.num_tokens if offer else 0)
        if num_tokens == 0:
            return None
        kind: HoldingKind = "hold" if offer is not None and offer.num_tokens >= cached_tokens else "resident"
        return _tuple_new(ReplicaMatch, (rep.replica_id, num_tokens, kind, cached_tokens, offer))

    def _offer(self, key: PrefixKey, rep: _Replica, depth: int, node: _Node | None) -> HoldOffer | None:
        """The longest hold of `rep` whose full blocks end on the query's chain and whose tail matches.

        `node` is the node at `depth` when the caller has it.
        """
        get, tokens, hashes, index = self._nodes.get, key.tokens, key.hashes, rep.index
        step = self.block_size * TOKEN_BYTES
        if node is None and depth:
            node = get(hashes[(depth - 1) * H : depth * H])
        k = depth
        while k > 0:
            ends = node.ends if node is not None else None
            if ends:
                best: _Hold | None = None
                start = k * step
                for hold in ends:
                    if hold.replica != index or tokens[start : start + len(hold.tail)] != hold.tail:
                        continue
                    if best is None or (hold.num_tokens, hold.hold_id) > (best.num_tokens, best.hold_id):
                        best = hold
                if best is not None:
                    best.used = True
                    self._hold_offers += 1
                    offer = (best.hold_id, rep.replica_id, best.num_tokens, best.expires_at, best.params)
                    return _tuple_new(HoldOffer, offer)
            k -= 1
            if k:
                node = get(hashes[(k - 1) * H : k * H])
        return None

    # ----- exported holds

    def record_hold(
        self,
        replica_id: str,
        key: PrefixKey | Sequence[int],
        kv_transfer_params: dict[str, Any],
        expires_at: float,
        *,
        num_tokens: int | None = None,
        scope: Scope | tuple[str, str] | None = None,
    ) -> RecordResult:
        """Record that `replica_id` exported the KV of the first `num_tokens` tokens of `key`.

        `num_tokens` defaults to the params' `remote_num_tokens`, else the whole key. `expires_at` is in
        this directory's clock (wall time by default). Holds without a full block are
        not kept: a pull would never beat recomputing them.
        """
        key = self._as_key(key, scope)
        now = self._purge_expired()
        if num_tokens is None:
            remote = kv_transfer_params.get("remote_num_tokens")
            num_tokens = key.num_tokens if remote is None else int(remote)
        if not 0 <= num_tokens <= key.num_tokens:
            raise ValueError(f"num_tokens={num_tokens} is outside the key's {key.num_tokens} tokens")
        full = num_tokens // self.block_size
        if full == 0 or not self._offerable(expires_at, now):
            return RecordResult(None, 0, 0)
        rep = self._replica(replica_id)
        hold_id = self._next_chain_id
        self._next_chain_id += 1
        tail = key.tokens[full * self.block_size * TOKEN_BYTES : num_tokens * TOKEN_BYTES]
        params = dict(kv_transfer_params)
        nbytes = _HOLD_BYTES + _alloc(tail) + _deep_size(params)
        end = key.block_hash(full - 1)
        hold = _Hold(hold_id, rep.index, end, num_tokens, tail, params, expires_at, nbytes)
        created = self._acquire_hold(key.hashes, full, rep.index)
        node = self._nodes[end]
        if node.ends is None:
            node.ends = [hold]
        else:
            node.ends.append(hold)
        self._holds[hold_id] = hold
        self._lru[hold_id] = hold
        rep.holds.add(hold_id)
        heapq.heappush(self._expiry, (expires_at, hold_id))
        self._bytes += nbytes
        evicted = self._enforce_bounds()
        return RecordResult(hold_id if hold_id in self._holds else None, created, evicted)

    def consume_hold(self, hold_id: int) -> dict[str, Any] | None:
        """The hold's kv_transfer_params, once: the hold is gone afterwards. None if expired or unknown."""
        self._purge_expired()
        hold = self._holds.get(hold_id)
        if hold is None:
            return None
        self._remove_hold(hold)
        self._holds_consumed += 1
        return hold.params

    def _offerable(self, expires_at: float, now: float) -> bool:
        return now < expires_at - self.expiry_margin_s

    def _remove_hold(self, hold: _Hold) -> None:
        rep = self._by_index[hold.replica]
        node = self._nodes[hold.end]
        assert node.ends is not None
        node.ends.remove(hold)
        if not node.ends:
            node.ends = None
        del self._holds[hold.hold_id]
        del self._lru[hold.hold_id]
        rep.holds.discard(hold.hold_id)
        self._bytes -= hold.nbytes
        self._release(hold.end, rep, resident=False)
        self._forget_if_empty(rep)

    def _purge_expired(self) -> float:
        """Remove every hold that is no longer offerable; returns the clock reading used."""
        now = self._clock()
        heap = self._expiry
        while heap and not self._offerable(heap[0][0], now):
            _, hold_id = heapq.heappop(heap)
            hold = self._holds.get(hold_id)
            if hold is not None and not self._offerable(hold.expires_at, now):
                self._remove_hold(hold)
                self._holds_expired += 1
        if len(heap) > 2 * len(self._holds) + 64:  # consumed and evicted holds leave stale entries
            self._expiry = [(h.expires_at, h.hold_id) for h in self._holds.values()]
            heapq.heapify(self._expiry)
        return now

    # ----- resident prefix cache

    def apply_resident(self, replica_id: str, ops: Iterable[ResidentOp]) -> ResidentResult:
        """Apply a replica's prefix-cache changes (see `actors.kv_events`), in order."""
        stored = removed = skipped = 0
        for op in ops:
            rep = self._replica(replica_id)  # re-fetched: a clear may have forgotten the replica
            if isinstance(op, StoreResident):
                ok = self._store_resident(rep, op.parent, op.hashes)
                stored += ok
                skipped += len(op.hashes) - ok
            elif isinstance(op, RemoveResident):
                for key in op.hashes:
                    if key in rep.resident:
                        self._remove_resident(rep, key)
                        removed += 1
            elif isinstance(op, ClearResident):
                removed += len(rep.resident)
                self._clear_resident(rep)
            else:
                raise TypeError(f"unknown resident op {op!r}")
        self._resident_skipped += skipped
        self._enforce_bounds()
        if (rep := self._replicas.get(replica_id)) is not None:
            self._forget_if_empty(rep)
        return ResidentResult(stored, removed, skipped, self.epoch)

    def _store_resident(self, rep: _Replica, parent: BlockHash | None, hashes: Sequence[BlockHash]) -> int:
        shift, bit = _REF_BITS * rep.index, 1 << rep.index
        one = 1 << shift
        if parent is not None:
            pnode = self._nodes.get(parent)
            if pnode is None or not pnode.rmask & bit:
                return 0  # the parent is unknown here (missed event, restart, eviction): cannot chain
        seg = _Segment(self._next_chain_id, rep.index, rep.resident.get(parent) if parent else None)
        stored, prev = 0, parent
        for key in hashes:
            node = self._nodes.get(key)
            if node is not None and node.parent != prev:
                break  # malformed op: this hash belongs to another chain
            old = rep.resident.get(key)
            if old is seg:
                break  # malformed op: a hash repeats
            if old is not None:
                self._unlink_segment_block(rep, old)
            else:
                if node is None:
                    node = self._new_node(key, prev)
                node.rrefs += one
                if node.rmask & bit:
                    rep.holes.discard(key)  # the block is back in the cache
                else:
                    node.rmask |= bit
                    node.mask |= bit
                    assert prev is None or self._nodes[prev].rmask & bit
                    if prev is not None:
                        self._nodes[prev].rrefs += one
                self._resident_blocks += 1
                self._bytes += _RESIDENT_BYTES
            rep.resident[key] = seg
            seg.hashes.append(key)
            seg.live += 1
            stored += 1
            prev = key
        if seg.live:
            self._next_chain_id += 1
            self._lru[seg.chain_id] = seg
            rep.segments.add(seg.chain_id)
            self._bytes += _SEGMENT_BYTES + 8 * len(seg.hashes)
            self._touch_segment(seg)
        return stored

    def _touch_segment(self, seg: _Segment) -> None:
        """Mark a segment and its ancestors used, ancestors last: a chain is evicted from its tail."""
        s: _Segment | None = seg
        while s is not None:
            if s.live:
                self._lru.move_to_end(s.chain_id)
            s = s.parent_seg

    def _unlink_segment_block(self, rep: _Replica, seg: _Segment) -> None:
        seg.live -= 1
        if seg.live == 0:
            del self._lru[seg.chain_id]
            rep.segments.discard(seg.chain_id)
            self._bytes -= _SEGMENT_BYTES + 8 * len(seg.hashes)
            seg.hashes = []  # children may still point at this segment; keep it small

    def _remove_resident(self, rep: _Replica, key: BlockHash) -> None:
        seg = rep.resident.pop(key)
        self._unlink_segment_block(rep, seg)
        self._resident_blocks -= 1
        self._bytes -= _RESIDENT_BYTES
        self._release(key, rep, resident=True)

    def _evict_segment(self, seg: _Segment) -> None:
        rep = self._by_index[seg.replica]
        for key in reversed(seg.hashes):
            if rep.resident.get(key) is seg:
                self._remove_resident(rep, key)
        self._forget_if_empty(rep)

    def _clear_resident(self, rep: _Replica) -> None:
        for chain_id in list(rep.segments):
            seg = self._lru[chain_id]
            assert isinstance(seg, _Segment)
            self._evict_segment(seg)

    # ----- replicas, bounds, stats

    def drop_replica(self, replica_id: str) -> int:
        """Forget everything of a dead, removed or restarted replica; returns the chains removed."""
        rep = self._replicas.get(replica_id)
        if rep is None:
            return 0
        chains = len(rep.holds) + len(rep.segments)
        for hold_id in list(rep.holds):
            self._remove_hold(self._holds[hold_id])
        self._clear_resident(rep)
        self._replicas.pop(replica_id, None)
        self._by_index.pop(rep.index, None)
        return chains

    def _enforce_bounds(self) -> int:
        evicted = 0
        while (len(self._nodes) > self.max_entries or self._bytes > self.max_bytes) and self._lru:
            chain = next(iter(self._lru.values()))
            if isinstance(chain, _Hold) and chain.used:  # offered lately: a second chance, O(1) per lookup
                chain.used = False
                self._lru.move_to_end(chain.hold_id)
                continue
            if isinstance(chain, _Hold):
                self._remove_hold(chain)
            else:
                self._evict_segment(chain)
            evicted += 1
        self._chains_evicted += evicted
        return evicted

    def stats(self) -> DirectoryStats:
        self._purge_expired()
        return DirectoryStats(
            entries=len(self._nodes),
            bytes=self._bytes,
            holds=len(self._holds),
            resident_blocks=self._resident_blocks,
            replicas=len(self._replicas),
            lookups=self._lookups,
            lookup_hits=self._lookup_hits,
            hit_rate=self._lookup_hits / self._lookups if self._lookups else 0.0,
            hold_offers=self._hold_offers,
            holds_consumed=self._holds_consumed,
            holds_expired=self._holds_expired,
            chains_evicted=self._chains_evicted,
            resident_skipped=self._resident_skipped,
            max_entries=self.max_entries,
            max_bytes=self.max_bytes,
            epoch=self.epoch,
        )

    def check_integrity(self) -> None:
        """Recompute every derived field from the direct references and raise AssertionError on a mismatch."""
        hold_refs: dict[tuple[BlockHash, int], int] = {}
        res_refs: dict[tuple[BlockHash, int], int] = {}
        for hold in self._holds.values():
            node = self._nodes.get(hold.end)
            assert node is not None and node.ends is not None and hold in node.ends, "hold not at its end"
            assert hold.hold_id in self._by_index[hold.replica].holds
            hold_refs[hold.end, hold.replica] = hold_refs.get((hold.end, hold.replica), 0) + 1
        for rep in self._replicas.values():
            assert self._by_index[rep.index] is rep
            for key in rep.resident:
                res_refs[key, rep.index] = 1
        for key, node in self._nodes.items():
            assert node.hmask or node.rmask, "empty node kept"
            assert node.mask == node.hmask | node.rmask, "union mask out of step"
            if node.parent is not None:
                parent = self._nodes.get(node.parent)
                assert parent is not None, "node without parent"
                for index in _bits(node.hmask):
                    hold_refs[node.parent, index] = hold_refs.get((node.parent, index), 0) + 1
                for index in _bits(node.rmask):
                    res_refs[node.parent, index] = res_refs.get((node.parent, index), 0) + 1
            for hold in node.ends or ():
                assert self._holds.get(hold.hold_id) is hold and hold.end == key
        top = max(self._by_index, default=-1) + 1
        for key, node in self._nodes.items():
            for index in range(max(node.hmask.bit_length(), node.rmask.bit_length(), top)):
                shift, bit = _REF_BITS * index, 1 << index
                h = hold_refs.get((key, index), 0)
                r = res_refs.get((key, index), 0)
                assert (node.hrefs >> shift) & _REF_MASK == h, f"hold refs of replica {index} wrong"
                assert (node.rrefs >> shift) & _REF_MASK == r, f"resident refs of replica {index} wrong"
                assert bool(node.hmask & bit) == (h > 0) and bool(node.rmask & bit) == (r > 0)
                if r > 0:
                    rep = self._by_index[index]
                    assert (key in rep.holes) == (key not in rep.resident), "hole set wrong"
        live_segments = 0
        for rep in self._replicas.values():
            for key in rep.holes:
                assert key in self._nodes and self._nodes[key].rmask & (1 << rep.index)
            for chain_id in rep.segments:
                seg = self._lru[chain_id]
                assert isinstance(seg, _Segment) and seg.replica == rep.index
                assert seg.live == sum(1 for k in seg.hashes if rep.resident.get(k) is seg) > 0
                live_segments += 1
        assert len(self._lru) == len(self._holds) + live_segments, "LRU out of step"
        expected_bytes = (
            len(self._nodes) * NODE_BYTES
            + sum(h.nbytes for h in self._holds.values())
            + self._resident_blocks * _RESIDENT_BYTES
            + sum(_SEGMENT_BYTES + 8 * len(s.hashes) for s in self._lru.values() if isinstance(s, _Segment))
        )
        assert self._bytes == expected_bytes, f"bytes {self._bytes} != {expected_bytes}"
        assert self._resident_blocks == sum(len(r.resident) for r in self._replicas.values())
        assert len(self._nodes) <= self.max_entries or not self._lru
        assert self._bytes <= self.max_bytes or not self._lru


# ---------------------------------------------------------------------------------------------------------
# The Ray actor


class KVDirectoryActor:
    """Ray actor owning one `KVDirectory` and the live-replica registry: the record every mirror follows.

    Methods are `async` and, but for `changes`, never await, so each runs atomically on the actor's event
    loop; callers `await handle.method.remote(...)` and never block theirs. Every update is also appended to
    a change feed (`actors/directory_changes.py`) that each ingress's mirror follows. After a crash the
    actor comes back empty with a new epoch; event forwarders re-report their replicas' caches and mirrors
    resync.
    """

    def __init__(self, dead_after_s: float = DEFAULT_DEAD_AFTER_S, **directory_kwargs: Any) -> None:
        self._directory = KVDirectory(**directory_kwargs)
        self._replicas = ReplicaRegistry(dead_after_s)
        self._log = ChangeLog()
        self._snapshot: Snapshot | None = None

    # ----- live replicas (heartbeats)

    async def heartbeat(self, identity: ReplicaIdentity, stats: ReplicaStats) -> bool:
        """A replica's periodic report of its identity and load; True when the replica was not registered
        (first beat, or the directory restarted or dropped it): it should re-report what it holds."""
        self._sweep()
        self._log.append(("beat", identity, stats))
        return self._replicas.heartbeat(identity, stats)

    async def deregister(self, replica_id: str) -> None:
        """A replica leaves (scale-down, shutdown, a failed pull from it): forget it and all it holds, at once."""
        self._replicas.remove(replica_id)
        self._directory.drop_replica(replica_id)
        self._log.append(("leave", replica_id))

    def _sweep(self) -> None:
        for replica_id in self._replicas.sweep():
            logger.warning("replica %s stopped reporting; dropping its directory entries", replica_id)
            self._directory.drop_replica(replica_id)
            self._log.append(("leave", replica_id))

    async def replica_identities(self) -> list[ReplicaIdentity]:
        self._sweep()
        return self._replicas.identities()

    # ----- holdings

    async def lookup(self, query: PrefixKey | Sequence[int], scope: Scope | None = None) -> LookupResult:
        return self._directory.lookup(query, scope)

    async def record_hold(
        self,
        replica_id: str,
        key: PrefixKey | Sequence[int],
        kv_transfer_params: dict[str, Any],
        expires_at: float,
        num_tokens: int | None = None,
        scope: Scope | None = None,
    ) -> RecordResult:
        result = self._directory.record_hold(
            replica_id, key, kv_transfer_params, expires_at, num_tokens=num_tokens, scope=scope
        )
        if result.hold_id is not None:
            key = self._directory._as_key(key, scope)
            self._log.append(("hold", replica_id, key, kv_transfer_params, expires_at, num_tokens, result.hold_id))
        return result

    async def consume_hold(self, hold_id: int) -> dict[str, Any] | None:
        params = self._directory.consume_hold(hold_id)
        if params is not None:
            self._log.append(("consume", hold_id))
        return params

    async def apply_resident(self, replica_id: str, ops: list[ResidentOp]) -> ResidentResult:
        result = self._directory.apply_resident(replica_id, ops)
        self._log.append(("resident", replica_id, ops))
        return result

    async def drop_replica(self, replica_id: str) -> int:
        chains = self._directory.drop_replica(replica_id)
        self._log.append(("leave", replica_id))
        return chains

    # ----- mirrors

    async def changes(self, epoch: str | None, since: int, wait_s: float = 2.0) -> Changes:
        """The updates after `since` (waiting up to `wait_s` for one), or, when `epoch` is not this directory's
        or `since` fell out of the log, a snapshot to fetch with `snapshot_part` and the live replicas."""
        if epoch != self._directory.epoch or not self._log.covers(since):
            self._sweep()
            seq = self._log.seq
            if self._snapshot is None or self._snapshot.seq != seq or self._snapshot.epoch != self._directory.epoch:
                self._snapshot = Snapshot.of(self._directory.epoch, seq, pickle.dumps(self._directory))
            live = list(zip(self._replicas.identities(), self._replicas.live(), strict=True))
            return Changes(self._directory.epoch, seq, [], len(self._snapshot.parts), live)
        await self._log.wait(since, wait_s)
        updates = self._log.after(since)
        return Changes(self._directory.epoch, since + len(updates), updates)

    async def snapshot_part(self, epoch: str, seq: int, index: int) -> bytes | None:
        """Part `index` of the snapshot taken at (`epoch`, `seq`); None once a newer one replaced it."""
        snap = self._snapshot
        if snap is None or (snap.epoch, snap.seq) != (epoch, seq):
            return None
        return snap.parts[index]

    async def stats(self) -> DirectoryStats:
        return self._directory.stats()

    async def check_integrity(self) -> None:
        self._directory.check_integrity()
