"""Each replica's prefix cache in the KV directory, from its KV cache events: blocks stored, removed, cleared.

A store op's blocks form a segment, the LRU unit for prefix-cache entries: a chain is evicted from its tail,
and a lookup that hits a segment marks it and its ancestors used.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvtransfer.directory_index.chains import ChainIndex
from kvtransfer.directory_index.records import REF_BITS, RESIDENT_BYTES, SEGMENT_BYTES, ReplicaRecord, Segment
from kvtransfer.directory_index.results import ClearResident, RemoveResident, ResidentOp, ResidentResult, StoreResident
from kvtransfer.prefix_key import BlockHash


class ResidentIndex(ChainIndex):
    """Apply replicas' prefix-cache ops and evict cache segments (part of `KVDirectory`)."""

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

    def _store_resident(self, rep: ReplicaRecord, parent: BlockHash | None, hashes: Sequence[BlockHash]) -> int:
        shift, bit = REF_BITS * rep.index, 1 << rep.index
        one = 1 << shift
        if parent is not None:
            pnode = self._nodes.get(parent)
            if pnode is None or not pnode.rmask & bit:
                return 0  # the parent is unknown here (missed event, restart, eviction): cannot chain
        seg = Segment(self._next_chain_id, rep.index, rep.resident.get(parent) if parent else None)
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
                self._bytes += RESIDENT_BYTES
            rep.resident[key] = seg
            seg.hashes.append(key)
            seg.live += 1
            stored += 1
            prev = key
        if seg.live:
            self._next_chain_id += 1
            self._lru[seg.chain_id] = seg
            rep.segments.add(seg.chain_id)
            self._bytes += SEGMENT_BYTES + 8 * len(seg.hashes)
            self._touch_segment(seg)
        return stored

    def _touch_segment(self, seg: Segment) -> None:
        """Mark a segment and its ancestors used, ancestors last: a chain is evicted from its tail."""
        s: Segment | None = seg
        while s is not None:
            if s.live:
                self._lru.move_to_end(s.chain_id)
            s = s.parent_seg

    def _unlink_segment_block(self, rep: ReplicaRecord, seg: Segment) -> None:
        seg.live -= 1
        if seg.live == 0:
            del self._lru[seg.chain_id]
            rep.segments.discard(seg.chain_id)
            self._bytes -= SEGMENT_BYTES + 8 * len(seg.hashes)
            seg.hashes = []  # children may still point at this segment; keep it small

    def _remove_resident(self, rep: ReplicaRecord, key: BlockHash) -> None:
        seg = rep.resident.pop(key)
        self._unlink_segment_block(rep, seg)
        self._resident_blocks -= 1
        self._bytes -= RESIDENT_BYTES
        self._release(key, rep, resident=True)

    def _evict_segment(self, seg: Segment) -> None:
        rep = self._by_index[seg.replica]
        for key in reversed(seg.hashes):
            if rep.resident.get(key) is seg:
                self._remove_resident(rep, key)
        self._forget_if_empty(rep)

    def _clear_resident(self, rep: ReplicaRecord) -> None:
        for chain_id in list(rep.segments):
            seg = self._lru[chain_id]
            assert isinstance(seg, Segment)
            self._evict_segment(seg)
