"""The KV directory's prefix chains: one node per block hash, and per replica a reference count of why it holds it.

`ChainIndex` owns the directory's state and the reference counting that keeps every replica's holdings closed
under "parent of"; `HoldIndex` and `ResidentIndex` add the two reasons a replica holds a block, and
`KVDirectory` (`index.py`) answers lookups over both.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from kvtransfer.directory_index.records import (
    FULL_NODE_BYTES,
    NODE_BYTES,
    RESIDENT_NODE_BYTES,
    HoldRecord,
    Node,
    ReplicaRecord,
    Segment,
    add_ref,
    ref_count,
    union,
    without,
)
from kvtransfer.prefix_key import HASH_BYTES, BlockHash, PrefixKey, Scope
from kvtransfer.types import HoldId

H = HASH_BYTES  # a key's block hashes are packed: block d (1-based depth) is hashes[(d - 1) * H : d * H]

DEFAULT_BLOCK_SIZE = 32
DEFAULT_MAX_ENTRIES = 2_000_000
DEFAULT_MAX_BYTES = 512 * 1024**2
# vLLM's puller declines a read within 5 s of the holder's deadline; leave room for routing and queueing.
DEFAULT_EXPIRY_MARGIN_S = 10.0


class ChainIndex:
    """The directory's state: nodes, holds, cache segments, the LRU over both, replicas, counters.

    Not thread-safe: one caller at a time. Three invariants hold between public calls: a node exists while some
    replica holds it, a replica that holds a node holds its parent, and a block that is only one replica's cache
    entry (no other replica, no hold, not a hole) has no `Node` but is recorded in its cache segment.
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
        # Every block held by any replica: its full Node, or, for a block that is only one replica's cache entry,
        # its cache segment (see `Segment`): one dict slot and one hash per block in the common case.
        self._nodes: dict[BlockHash, Node | Segment] = {}
        self._holds: dict[HoldId, HoldRecord] = {}  # by the id the holder's replica minted
        # The block each pending hold's prompt ends at (`HoldRecord.prompt_end`), with how many holds end there.
        self._prompt_ends: dict[BlockHash, int] = {}
        self._lru: OrderedDict[HoldId | int, HoldRecord | Segment] = OrderedDict()  # segments by their chain id
        self._expiry: list[tuple[float, HoldId]] = []
        self._replicas: dict[str, ReplicaRecord] = {}
        self._by_index: dict[int, ReplicaRecord] = {}
        self._next_chain_id = 1  # the next cache segment's
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

    def _replica(self, replica_id: str) -> ReplicaRecord:
        rep = self._replicas.get(replica_id)
        if rep is None:
            index = next(i for i in range(len(self._by_index) + 1) if i not in self._by_index)
            rep = ReplicaRecord(replica_id, index)
            self._replicas[replica_id] = rep
            self._by_index[index] = rep
        return rep

    def _forget_if_empty(self, rep: ReplicaRecord) -> None:
        if self._replicas.get(rep.replica_id) is rep and not (rep.holds or rep.resident_count or rep.segments):
            del self._replicas[rep.replica_id]
            del self._by_index[rep.index]

    # ----- blocks: plain cache entries and full nodes

    def _segment_of(self, rep: ReplicaRecord, key: BlockHash | None) -> Segment | None:
        """The segment `key` is resident in on `rep`; None if it is not resident there."""
        value = self._nodes.get(key) if key is not None else None
        if type(value) is Segment:
            return value if value.replica == rep.index else None
        return rep.resident.get(key) if value is not None else None

    def _expand(self, key: BlockHash, seg: Segment, position: int) -> Node:
        """Give a plain cache entry (`seg.hashes[position]`) a full Node: a second replica, a hold or a hole is
        about to touch it."""
        node = Node(seg.hashes[position], seg.parent_of(position))
        node.rmask = node.mask = seg.mask
        node.rrefs = seg.refs[position]
        self._by_index[seg.replica].resident[key] = seg
        self._nodes[key] = node
        self._bytes += FULL_NODE_BYTES + RESIDENT_NODE_BYTES
        return node

    def _settle(self, key: BlockHash, node: Node, hint: tuple[Segment | None, int]) -> tuple[Segment | None, int]:
        """Record `node` in its segment again if it is back to a plain cache entry of one replica.

        `hint`: a segment and where `key` likely is in it; returns where it was (`hint` if it was not settled).
        """
        rmask = node.rmask
        if node.hmask or node.ends or not rmask or rmask & (rmask - 1):
            return hint
        seg = self._by_index[rmask.bit_length() - 1].resident.pop(key, None)
        if seg is None:
            return hint  # a hole
        position = seg.position(key, hint[1] if seg is hint[0] else -1)
        seg.refs[position] = node.rrefs
        # The segment holds the directory's key object for the block (`Node.key`): an assignment keeps it, with no
        # second hash object alive and no deleted slot left in the table. (Deleting and re-inserting every block whose
        # hold ended left the table at 2^22 slots for a million blocks, 84 bytes a block where 42 hold them.)
        stored = seg.hashes[position]
        if stored is not node.key:  # never expected (`check_integrity` asserts it): re-key under the segment's copy
            del self._nodes[key]
        self._nodes[stored] = seg
        self._bytes -= FULL_NODE_BYTES + RESIDENT_NODE_BYTES
        return seg, position

    # ----- reference counting on the node chains

    def _release(
        self, key: BlockHash | None, rep: ReplicaRecord, resident: bool, direct: bool = True,
        hint: tuple[Segment | None, int] = (None, -1),
    ) -> None:
        """Drop one direct reference of `rep` on `key` and the references it implied on the ancestors.

        `direct` False: the reference dropped is a child's. `hint`: a segment and where `key` likely is in it.
        """
        index, bit = rep.index, rep.bit
        nodes = self._nodes
        while key is not None:
            node = nodes[key]
            if type(node) is Segment:
                # A plain cache entry: only a resident child's reference can end here, and its flag keeps it.
                assert resident and not direct
                node.refs[node.position(key, hint[1] if node is hint[0] else -1)] -= 1
                return
            # An int count is this replica's: it is in the mask, and an int means the mask holds one replica.
            if resident:
                if type(node.rrefs) is int:
                    left = node.rrefs = node.rrefs - 1
                else:
                    left = ref_count(node.rrefs, node.rmask, index) - 1
                    node.rrefs = add_ref(node.rrefs, node.rmask, index, -1)
                if left:
                    if direct:
                        rep.holes.add(key)
                    return
                node.rmask = without(node.rmask, bit)
                rep.holes.discard(key)
            else:
                if type(node.hrefs) is int:
                    left = node.hrefs = node.hrefs - 1
                else:
                    left = ref_count(node.hrefs, node.hmask, index) - 1
                    node.hrefs = add_ref(node.hrefs, node.hmask, index, -1)
                if left:
                    return
                node.hmask = without(node.hmask, bit)
            node.mask = union(node.hmask, node.rmask)
            if not node.mask:
                del nodes[key]
                self._bytes -= NODE_BYTES + FULL_NODE_BYTES
            else:
                seg, position = self._settle(key, node, hint)
                hint = (seg, position - 1)  # the parent is likely the block before it in its segment
            key = node.parent
            direct = False

    def _enforce_bounds(self) -> int:
        """Evict least recently used chains until within bounds; returns how many (`KVDirectory` evicts)."""
        raise NotImplementedError
