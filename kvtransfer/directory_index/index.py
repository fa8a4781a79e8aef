"""The KV directory's index: which replica holds which prefix, as exported holds and resident cache blocks.

`KVDirectory` answers lookups over both kinds of holdings, keeps itself within its bounds, and can check every
derived count (`check_integrity`). What it is built from: `chains.py`, `holds.py`, `resident.py`, `records.py`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from kvtransfer.directory_index.chains import H
from kvtransfer.directory_index.holds import HoldIndex
from kvtransfer.directory_index.records import (
    FULL_NODE_BYTES,
    NODE_BYTES,
    RESIDENT_NODE_BYTES,
    SEGMENT_BLOCK_BYTES,
    SEGMENT_BYTES,
    HoldRecord,
    Node,
    ReplicaRecord,
    Segment,
    bits,
    new_tuple,
    ref_count,
    replica_bit,
)
from kvtransfer.directory_index.resident import ResidentIndex
from kvtransfer.directory_index.results import DirectoryStats
from kvtransfer.prefix_key import TOKEN_BYTES, BlockHash, PrefixKey, Scope
from kvtransfer.types import HoldingKind, LookupResult, ReplicaMatch


def _deepest_holding(
    get: Callable[[BlockHash], Node | Segment | None], hashes: bytes, first: Node | Segment, hi: int, want: int
) -> tuple[int, Node | Segment]:
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


class KVDirectory(HoldIndex, ResidentIndex):
    """Which replica holds which prefix: exported holds and resident prefix-cache blocks, per replica.

    Not thread-safe: one caller at a time (the actor's event loop). Every public method runs to
    completion without yielding. `lookup` mutates only counters, LRU order and expired holds (purged on
    the way in); `record_hold`, `consume_hold`, `apply_resident` and `drop_replica` mutate the directory;
    `stats` and `check_integrity` read only (`stats` purges expired holds first).

    Holds are independent: a newer, longer hold of the same conversation on the same replica does not
    supersede the older one (both stay pullable until consumed or expired; lookups offer the longest).
    """

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
                for index in bits(level):
                    match = self._match_replica(key, self._by_index[index], node, depth)
                    if match is not None:
                        matches.append(match)
            remaining &= ~level
            hi = depth - 1
        if matches:
            self._lookup_hits += 1
            if len(matches) > 1:
                matches.sort(key=_match_order)
        return new_tuple(LookupResult, (len(key.tokens) // TOKEN_BYTES, tuple(matches)))

    def _match_replica(
        self, key: PrefixKey, rep: ReplicaRecord, deepest: Node | Segment, depth: int
    ) -> ReplicaMatch | None:
        hashes, bit = key.hashes, rep.bit
        if deepest.hmask & bit:
            hold_depth = cached = depth
        else:
            cached = depth
            if rep.holes:
                cached = next((i for i in range(depth) if hashes[i * H : (i + 1) * H] in rep.holes), depth)
            hold_depth = self._deepest(hashes, depth - 1, bit) if rep.holds else 0
            cached = max(cached, hold_depth)
            if cached and (seg := self._segment_of(rep, hashes[(cached - 1) * H : cached * H])) is not None:
                self._touch_segment(seg)
        offer = self._offer(key, rep, hold_depth, deepest if hold_depth == depth else None) if rep.holds else None
        cached_tokens = cached * self.block_size
        num_tokens = max(cached_tokens, offer.num_tokens if offer else 0)
        if num_tokens == 0:
            return None
        kind: HoldingKind = "hold" if offer is not None and offer.num_tokens >= cached_tokens else "resident"
        return new_tuple(ReplicaMatch, (rep.replica_id, num_tokens, kind, cached_tokens, offer))

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

    def table_bytes(self) -> int:
        """Bytes of the block table itself (its dict, not the hashes and records it points to)."""
        return sys.getsizeof(self._nodes)

    def cache_turnover(self) -> dict[str, tuple[int, int]]:
        """Per replica, its resident blocks and the blocks its engine has evicted so far (`SharedPrefixes`)."""
        return {rid: (rep.resident_count, rep.evicted) for rid, rep in self._replicas.items()}

    def _enforce_bounds(self) -> int:
        evicted = 0
        while (len(self._nodes) > self.max_entries or self._bytes > self.max_bytes) and self._lru:
            chain = next(iter(self._lru.values()))
            if isinstance(chain, HoldRecord) and chain.used:  # offered lately: a second chance, O(1) per lookup
                chain.used = False
                self._lru.move_to_end(chain.hold_id)
                continue
            if isinstance(chain, HoldRecord):
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
            holds_by_replica={rid: len(rep.holds) for rid, rep in self._replicas.items() if rep.holds},
        )

    def check_integrity(self) -> None:
        """Recompute every derived field from the direct references and raise AssertionError on a mismatch."""
        nodes = self._nodes
        # Each block as a full record, whether it has a Node or is a plain cache entry recorded in its segment:
        # (parent, hmask, hold counts, rmask, resident counts, ends), counts by replica index.
        blocks: dict[BlockHash, tuple[BlockHash | None, int, dict[int, int], int, dict[int, int], list | None]] = {}
        resident_on: dict[tuple[BlockHash, int], Segment] = {}
        full_nodes = 0
        for key, node in nodes.items():
            if type(node) is Segment:
                position = node.position(key)
                assert node.hashes[position] is key, "a segment holds another copy of the table's key"
                assert node.live > 0 and self._lru.get(node.chain_id) is node, "plain entry in a dead segment"
                assert node.mask is replica_bit(node.replica)
                assert key not in self._by_index[node.replica].resident, "plain entry also kept as a full node"
                blocks[key] = (node.parent_of(position), 0, {}, node.mask, {node.replica: node.refs[position]}, None)
                resident_on[key, node.replica] = node
                continue
            full_nodes += 1
            assert type(node) is Node
            assert node.key is key, "a node keeps another copy of the table's key"
            for refs, mask in ((node.hrefs, node.hmask), (node.rrefs, node.rmask)):
                assert (type(refs) is dict) == (mask & (mask - 1) != 0), "refs not kept as the mask's shape asks"
                assert type(refs) is not dict or set(refs) == set(bits(mask)), "refs of replicas off the mask"
            hcounts = {i: ref_count(node.hrefs, node.hmask, i) for i in bits(node.hmask)}
            rcounts = {i: ref_count(node.rrefs, node.rmask, i) for i in bits(node.rmask)}
            blocks[key] = (node.parent, node.hmask, hcounts, node.rmask, rcounts, node.ends)
            rmask = node.rmask
            if not node.hmask and not node.ends and rmask and not rmask & (rmask - 1):
                assert key not in self._by_index[rmask.bit_length() - 1].resident, "plain entry kept as a full node"
        for rep in self._replicas.values():
            assert self._by_index[rep.index] is rep
            assert rep.bit is replica_bit(rep.index)
            for key, seg in rep.resident.items():
                assert type(nodes.get(key)) is Node, "full-node resident entry without a Node"
                assert seg.hashes[seg.position(key)] is nodes[key].key, "a segment holds another copy of the key"
                resident_on[key, rep.index] = seg
        hold_refs: dict[tuple[BlockHash, int], int] = {}
        res_refs: dict[tuple[BlockHash, int], int] = {key_index: 1 for key_index in resident_on}
        for hold in self._holds.values():
            block = blocks.get(hold.end)
            assert block is not None and block[5] is not None and hold in block[5], "hold not at its end"
            assert hold.hold_id in self._by_index[hold.replica].holds
            hold_refs[hold.end, hold.replica] = hold_refs.get((hold.end, hold.replica), 0) + 1
        for key, (parent, hmask, _, rmask, _, ends) in blocks.items():
            node = nodes[key]
            assert hmask or rmask, "empty node kept"
            assert node.mask == hmask | rmask, "union mask out of step"
            if parent is not None:
                assert parent in nodes, "node without parent"
                for index in bits(hmask):
                    hold_refs[parent, index] = hold_refs.get((parent, index), 0) + 1
                for index in bits(rmask):
                    res_refs[parent, index] = res_refs.get((parent, index), 0) + 1
            for hold in ends or ():
                assert self._holds.get(hold.hold_id) is hold and hold.end == key
        top = max(self._by_index, default=-1) + 1
        for key, (_, hmask, hcounts, rmask, rcounts, _) in blocks.items():
            for index in range(max(hmask.bit_length(), rmask.bit_length(), top)):
                bit = 1 << index
                h = hold_refs.get((key, index), 0)
                r = res_refs.get((key, index), 0)
                assert hcounts.get(index, 0) == h, f"hold refs of replica {index} wrong"
                assert rcounts.get(index, 0) == r, f"resident refs of replica {index} wrong"
                assert bool(hmask & bit) == (h > 0) and bool(rmask & bit) == (r > 0)
                if r > 0:
                    rep = self._by_index[index]
                    assert (key in rep.holes) == ((key, index) not in resident_on), "hole set wrong"
        prompt_ends: dict[BlockHash, int] = {}
        for hold in self._holds.values():
            if hold.prompt_end is not None:
                assert hold.prompt_end in nodes, "prompt end off the chains"
                prompt_ends[hold.prompt_end] = prompt_ends.get(hold.prompt_end, 0) + 1
        assert prompt_ends == self._prompt_ends, "prompt ends out of step"
        live_segments = 0
        for rep in self._replicas.values():
            for key in rep.holes:
                assert key in blocks and blocks[key][3] & rep.bit
            for chain_id in rep.segments:
                seg = self._lru[chain_id]
                assert isinstance(seg, Segment) and seg.replica == rep.index
                assert len(seg.refs) == len(seg.hashes)
                assert seg.live == sum(1 for k in seg.hashes if resident_on.get((k, rep.index)) is seg) > 0
                live_segments += 1
            assert rep.resident_count == sum(1 for _, index in resident_on if index == rep.index)
        assert len(self._lru) == len(self._holds) + live_segments, "LRU out of step"
        expected_bytes = (
            len(nodes) * NODE_BYTES
            + full_nodes * FULL_NODE_BYTES
            + sum(len(rep.resident) for rep in self._replicas.values()) * RESIDENT_NODE_BYTES
            + sum(h.nbytes for h in self._holds.values())
            + sum(SEGMENT_BYTES + SEGMENT_BLOCK_BYTES * len(s.hashes) for s in self._lru.values() if type(s) is Segment)
        )
        assert self._bytes == expected_bytes, f"bytes {self._bytes} != {expected_bytes}"
        assert self._resident_blocks == len(resident_on)
        assert len(nodes) <= self.max_entries or not self._lru
        assert self._bytes <= self.max_bytes or not self._lru
