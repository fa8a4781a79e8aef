"""The KV directory's index: which replica holds which prefix, as exported holds and resident cache blocks.

`KVDirectory` answers lookups over both kinds of holdings, keeps itself within its bounds, and can check every
derived count (`check_integrity`). What it is built from: `chains.py`, `holds.py`, `resident.py`, `records.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtransfer.directory_index.chains import H
from kvtransfer.directory_index.holds import HoldIndex
from kvtransfer.directory_index.records import (
    NODE_BYTES,
    REF_BITS,
    REF_MASK,
    RESIDENT_BYTES,
    SEGMENT_BYTES,
    HoldRecord,
    Node,
    ReplicaRecord,
    Segment,
    bits,
    new_tuple,
)
from kvtransfer.directory_index.resident import ResidentIndex
from kvtransfer.directory_index.results import DirectoryStats
from kvtransfer.prefix_key import TOKEN_BYTES, BlockHash, PrefixKey, Scope
from kvtransfer.types import HoldingKind, LookupResult, ReplicaMatch


def _deepest_holding(
    get: Callable[[BlockHash], Node | None], hashes: bytes, first: Node, hi: int, want: int
) -> tuple[int, Node]:
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

    def _match_replica(self, key: PrefixKey, rep: ReplicaRecord, deepest: Node, depth: int) -> ReplicaMatch | None:
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
                for index in bits(node.hmask):
                    hold_refs[node.parent, index] = hold_refs.get((node.parent, index), 0) + 1
                for index in bits(node.rmask):
                    res_refs[node.parent, index] = res_refs.get((node.parent, index), 0) + 1
            for hold in node.ends or ():
                assert self._holds.get(hold.hold_id) is hold and hold.end == key
        top = max(self._by_index, default=-1) + 1
        for key, node in self._nodes.items():
            for index in range(max(node.hmask.bit_length(), node.rmask.bit_length(), top)):
                shift, bit = REF_BITS * index, 1 << index
                h = hold_refs.get((key, index), 0)
                r = res_refs.get((key, index), 0)
                assert (node.hrefs >> shift) & REF_MASK == h, f"hold refs of replica {index} wrong"
                assert (node.rrefs >> shift) & REF_MASK == r, f"resident refs of replica {index} wrong"
                assert bool(node.hmask & bit) == (h > 0) and bool(node.rmask & bit) == (r > 0)
                if r > 0:
                    rep = self._by_index[index]
                    assert (key in rep.holes) == (key not in rep.resident), "hole set wrong"
        prompt_ends: dict[BlockHash, int] = {}
        for hold in self._holds.values():
            if hold.prompt_end is not None:
                assert hold.prompt_end in self._nodes, "prompt end off the chains"
                prompt_ends[hold.prompt_end] = prompt_ends.get(hold.prompt_end, 0) + 1
        assert prompt_ends == self._prompt_ends, "prompt ends out of step"
        live_segments = 0
        for rep in self._replicas.values():
            for key in rep.holes:
                assert key in self._nodes and self._nodes[key].rmask & (1 << rep.index)
            for chain_id in rep.segments:
                seg = self._lru[chain_id]
                assert isinstance(seg, Segment) and seg.replica == rep.index
                assert seg.live == sum(1 for k in seg.hashes if rep.resident.get(k) is seg) > 0
                live_segments += 1
        assert len(self._lru) == len(self._holds) + live_segments, "LRU out of step"
        expected_bytes = (
            len(self._nodes) * NODE_BYTES
            + sum(h.nbytes for h in self._holds.values())
            + self._resident_blocks * RESIDENT_BYTES
            + sum(SEGMENT_BYTES + 8 * len(s.hashes) for s in self._lru.values() if isinstance(s, Segment))
        )
        assert self._bytes == expected_bytes, f"bytes {self._bytes} != {expected_bytes}"
        assert self._resident_blocks == sum(len(r.resident) for r in self._replicas.values())
        assert len(self._nodes) <= self.max_entries or not self._lru
        assert self._bytes <= self.max_bytes or not self._lru
