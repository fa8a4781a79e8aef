"""Each replica's prefix cache in the KV directory, from its KV cache events: blocks stored, removed, cleared.

A store op's blocks form a segment, the LRU unit for prefix-cache entries: a chain is evicted from its tail,
and a lookup that hits a segment marks it and its ancestors used.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

from kvtransfer.directory_index.chains import ChainIndex
from kvtransfer.directory_index.records import (
    FULL_NODE_BYTES,
    NODE_BYTES,
    RESIDENT_NODE_BYTES,
    SEGMENT_BLOCK_BYTES,
    SEGMENT_BYTES,
    Node,
    ReplicaRecord,
    Segment,
    add_ref,
    union,
)
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
                    if self._segment_of(rep, key) is not None:
                        self._remove_resident(rep, key)
                        removed += 1
                        rep.evicted += 1
            elif isinstance(op, ClearResident):
                removed += rep.resident_count
                self._clear_resident(rep)
            else:
                raise TypeError(f"unknown resident op {op!r}")
        self._resident_skipped += skipped
        self._enforce_bounds()
        if (rep := self._replicas.get(replica_id)) is not None:
            self._forget_if_empty(rep)
        return ResidentResult(stored, removed, skipped, self.epoch)

    def _store_resident(self, rep: ReplicaRecord, parent: BlockHash | None, hashes: Sequence[BlockHash]) -> int:
        index, bit = rep.index, rep.bit
        nodes = self._nodes
        if parent is not None:
            pnode = nodes.get(parent)
            if pnode is None or not (pnode.mask if type(pnode) is Segment else pnode.rmask) & bit:
                return 0  # the parent is unknown here (missed event, restart, eviction): cannot chain
        seg = Segment(self._next_chain_id, index, parent, self._segment_of(rep, parent))
        seg_hashes, seg_refs = seg.hashes, seg.refs
        stored, prev = 0, parent
        near: tuple[Segment | None, int] = (None, -1)  # where the previous block was found: this one is likely next
        for key in hashes:
            node = nodes.get(key)
            if node is None:  # the common case: a new block, recorded in its segment alone
                nodes[key] = seg
                seg_hashes.append(key)
                seg_refs.append(1)
                self._bytes += NODE_BYTES
                self._add_child_ref(rep, prev, seg, len(seg_hashes) - 2)
                self._resident_blocks += 1
                rep.resident_count += 1
            else:
                if type(node) is Segment:
                    position = node.position(key, near[1] + 1 if node is near[0] else -1)
                    near = (node, position)
                    parent_ok = node.parent_of(position) == prev
                else:
                    parent_ok = node.parent == prev
                if not parent_ok:
                    break  # malformed op: this hash belongs to another chain
                old = self._segment_of(rep, key)
                if old is seg:
                    break  # malformed op: a hash repeats
                if old is not None:  # stored again: the block moves to this segment with its references
                    if node is old:
                        seg_refs.append(old.refs[position])
                        nodes[key] = seg
                        seg_hashes.append(old.hashes[position])  # the table's key object (as below, `Node.key`)
                    else:
                        seg_refs.append(0)
                        rep.resident[key] = seg
                        seg_hashes.append(node.key)
                    self._unlink_segment_block(rep, old)
                else:
                    if type(node) is Segment:
                        node = self._expand(key, node, position)  # another replica's cache entry
                    was_held = node.rmask & bit
                    node.rrefs = add_ref(node.rrefs, node.rmask, index, 1)
                    if was_held:
                        rep.holes.discard(key)  # the block is back in the cache
                    else:
                        node.rmask = union(node.rmask, bit)
                        node.mask = union(node.mask, bit)
                        self._add_child_ref(rep, prev, seg, len(seg_hashes) - 1)
                    rep.resident[key] = seg
                    self._bytes += RESIDENT_NODE_BYTES
                    seg_hashes.append(node.key)  # the table's key object: the event's copy of the hash is dropped
                    seg_refs.append(0)
                    self._settle(key, node, (seg, len(seg_hashes) - 1))
                    self._resident_blocks += 1
                    rep.resident_count += 1
            seg.live += 1
            stored += 1
            prev = key
        if seg.live:
            self._next_chain_id += 1
            self._lru[seg.chain_id] = seg
            rep.segments.add(seg.chain_id)
            self._bytes += SEGMENT_BYTES + SEGMENT_BLOCK_BYTES * len(seg_hashes)
            self._touch_segment(seg)
        return stored

    def _add_child_ref(self, rep: ReplicaRecord, parent: BlockHash | None, seg: Segment, hint: int) -> None:
        """`rep` now holds a child of `parent` in its cache (`hint`: where `parent` likely is in `seg`)."""
        if parent is None:
            return
        node = self._nodes[parent]
        if type(node) is Segment:
            node.refs[node.position(parent, hint if node is seg else -1)] += 1
        else:
            assert node.rmask & rep.bit
            node.rrefs = add_ref(node.rrefs, node.rmask, rep.index, 1)

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
            self._bytes -= SEGMENT_BYTES + SEGMENT_BLOCK_BYTES * len(seg.hashes)
            seg.hashes = []  # children may still point at this segment; keep it small
            seg.refs = array("I")

    def _remove_resident(self, rep: ReplicaRecord, key: BlockHash, hint: int = -1) -> None:
        """Drop `key` from `rep`'s cache (`hint`: where it likely is in its segment)."""
        node = self._nodes[key]
        self._resident_blocks -= 1
        rep.resident_count -= 1
        if type(node) is not Segment:
            self._unlink_segment_block(rep, rep.resident.pop(key))
            self._bytes -= RESIDENT_NODE_BYTES
            self._release(key, rep, resident=True)
            return
        seg = node
        position = seg.position(key, hint)
        parent, left = seg.parent_of(position), seg.refs[position] - 1
        if left:  # the replica still holds children of it: a hole
            hole = Node(seg.hashes[position], parent)
            hole.rmask = hole.mask = rep.bit
            hole.rrefs = left
            self._nodes[key] = hole
            self._bytes += FULL_NODE_BYTES
            rep.holes.add(key)
        else:
            del self._nodes[key]
            self._bytes -= NODE_BYTES
            self._release(parent, rep, resident=True, direct=False, hint=(seg, position - 1))
        self._unlink_segment_block(rep, seg)

    def _evict_segment(self, seg: Segment) -> None:
        rep = self._by_index[seg.replica]
        hashes = seg.hashes
        for position in range(len(hashes) - 1, -1, -1):
            key = hashes[position]
            if self._segment_of(rep, key) is seg:
                self._remove_resident(rep, key, position)
        self._forget_if_empty(rep)

    def _clear_resident(self, rep: ReplicaRecord) -> None:
        for chain_id in list(rep.segments):
            seg = self._lru[chain_id]
            assert isinstance(seg, Segment)
            self._evict_segment(seg)
