"""The KV directory's internal records (a block of a chain, a hold, a cache segment, a replica) and their cost.

Byte costs are estimates the directory sums to stay within `max_bytes`; `benchmarks/directory.py` checks them
against tracemalloc.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable
from typing import Any

from kvtransfer.prefix_key import HASH_BYTES, BlockHash
from kvtransfer.types import Hold, HoldId

# NamedTuple construction through its generated __new__ costs a Python call; lookups build three per hit.
new_tuple = tuple.__new__


class Node:
    """One block of one prefix chain, as a full record: a block held by several replicas, through a hold, or as a hole.

    A block that is just one replica's prefix-cache entry (the common case) has no `Node`: the directory maps its
    hash to its cache `Segment`, which reads the same to a lookup (`mask`, `hmask`, `ends`).

    Per replica, a reference count of why the replica holds it. A replica holds a node as long as it has a direct
    reason (a hold ending here, or its resident flag) or holds one of the node's children: so every replica's
    holdings are closed under "parent of", which lets lookups binary-search a query's chain instead of walking it.
    `hrefs` and `rrefs` hold the counts of the replicas in `hmask` and `rmask` (see `ref_count`): a plain int while
    one replica is in the mask, a dict by replica index while several are.
    """

    __slots__ = ("key", "parent", "mask", "hmask", "hrefs", "rmask", "rrefs", "ends")

    def __init__(self, key: BlockHash, parent: BlockHash | None) -> None:
        # The directory's own key object for this block: a cache segment that records the block holds this very
        # object, so that the block settles back into its segment without re-keying (`ChainIndex._settle`).
        self.key = key
        self.parent = parent
        self.mask = 0  # hmask | rmask: the replicas holding this node at all (what lookups read)
        self.hmask = 0  # replicas holding this node through holds
        self.hrefs: Refs = 0  # holds ending here + children in hmask, per replica
        self.rmask = 0  # replicas holding this node in their prefix cache (events)
        self.rrefs: Refs = 0  # resident flag + children in rmask, per replica
        self.ends: list[HoldRecord] | None = None  # holds whose full blocks end here


Refs = int | dict[int, int]


def ref_count(refs: Refs, mask: int, index: int) -> int:
    """Replica `index`'s count in a node's `refs`, whose replicas are the bits of `mask`."""
    if type(refs) is dict:
        return refs.get(index, 0)
    return refs if mask >> index & 1 else 0


def add_ref(refs: Refs, mask: int, index: int, delta: int) -> Refs:
    """`refs` with replica `index`'s count changed by `delta`; `mask`: the replicas counted before the change.

    The caller keeps `mask` in step: a replica whose count reaches zero leaves it, one whose count starts joins it.
    """
    if type(refs) is dict:
        left = refs.get(index, 0) + delta
        if left:
            refs[index] = left
            return refs
        del refs[index]
        return next(iter(refs.values())) if len(refs) == 1 else refs
    if not mask or mask >> index == 1:  # no replica yet, or only this one (several: a dict, above)
        return refs + delta
    return {mask.bit_length() - 1: refs, index: delta}  # a second replica joins


_BITS: list[int] = []


def replica_bit(index: int) -> int:
    """`1 << index`, one shared int object per index: a node's mask of one replica costs a pointer, not an int."""
    while len(_BITS) <= index:
        _BITS.append(1 << len(_BITS))
    return _BITS[index]


def union(a: int, b: int) -> int:
    """`a | b`, reusing `a` or `b` when the other is empty (so a shared bit stays shared)."""
    return a | b if a and b else a or b


def without(mask: int, bit: int) -> int:
    """`mask` less `bit`, as a shared bit when one replica is left."""
    if mask == bit:
        return 0
    left = mask & ~bit
    return replica_bit(left.bit_length() - 1) if left and left & (left - 1) == 0 else left


class HoldRecord:
    """One recorded hold, by the id its replica minted: its replica, the node its full blocks end at, its partial last
    block's tokens, and the node its history's prompt ends at (`prompt_end`: the last full block before the prompt's
    last token; None if unknown or the prompt has none)."""

    __slots__ = ("hold_id", "replica", "end", "num_tokens", "tail", "hold", "expires_at", "nbytes", "used",
                 "prompt_end")

    def __init__(
        self,
        hold_id: HoldId,
        replica: int,
        end: BlockHash,
        num_tokens: int,
        tail: bytes,
        hold: Hold | None,
        expires_at: float,
        nbytes: int,
        prompt_end: BlockHash | None = None,
    ) -> None:
        self.hold_id = hold_id
        self.replica = replica
        self.end = end
        self.num_tokens = num_tokens
        self.tail = tail
        self.hold = hold
        self.expires_at = expires_at
        self.nbytes = nbytes
        self.used = False  # offered since it last reached the LRU's old end (second-chance LRU)
        self.prompt_end = prompt_end


class Segment:
    """The blocks of one resident store op: the LRU unit for prefix-cache entries.

    It is also the directory's record of each of its blocks that is only this replica's cache entry (no other
    replica, no hold, not a hole): the directory maps such a block's hash to its segment, and the block's parent is
    the previous hash here (`parent`, the op's, for the first). `refs[i]`: the replica's reference count on
    `hashes[i]` (its resident flag + its children the replica holds) while that block is recorded here.
    """

    __slots__ = ("chain_id", "replica", "mask", "parent", "hashes", "refs", "live", "parent_seg")

    # What a lookup reads of a node, for a block recorded here: held by this replica alone, through no hold.
    hmask = 0
    ends = None

    def __init__(self, chain_id: int, replica: int, parent: BlockHash | None, parent_seg: Segment | None) -> None:
        self.chain_id = chain_id
        self.replica = replica
        self.mask = replica_bit(replica)
        self.parent = parent
        self.hashes: list[BlockHash] = []
        self.refs = array("I")
        self.live = 0
        self.parent_seg = parent_seg

    def position(self, key: BlockHash, hint: int = -1) -> int:
        """Where `key` is in `hashes` (`hint`: where it is likely to be)."""
        hashes = self.hashes
        if 0 <= hint < len(hashes) and hashes[hint] == key:
            return hint
        return hashes.index(key)

    def parent_of(self, position: int) -> BlockHash | None:
        return self.hashes[position - 1] if position else self.parent


class ReplicaRecord:
    """One replica's holdings: its holds, its resident blocks (by segment), and its bit index in node masks.

    Its resident blocks are those recorded in one of its segments (`KVDirectory._nodes` maps them to it) and those
    with a full `Node`, in `resident` with their segment.
    """

    __slots__ = ("replica_id", "index", "bit", "holds", "resident", "resident_count", "holes", "segments", "evicted")

    def __init__(self, replica_id: str, index: int) -> None:
        self.replica_id = replica_id
        self.index = index
        self.bit = replica_bit(index)
        self.holds: set[HoldId] = set()
        self.resident: dict[BlockHash, Segment] = {}  # resident blocks that have a full Node
        self.resident_count = 0  # all its resident blocks
        self.evicted = 0  # blocks its engine has evicted from its prefix cache, in all (its removal events)
        # Nodes this replica holds only because resident children do (vLLM dropped the block itself):
        # a prefix-cache match stops there. Rare: vLLM evicts a chain's tail before its head.
        self.holes: set[BlockHash] = set()
        self.segments: set[int] = set()


def alloc(obj: Any) -> int:
    """Bytes the allocator really hands out for `obj` (CPython rounds small blocks up to 16)."""
    return (sys.getsizeof(obj) + 15) & ~15


def deep_size(obj: Any, _depth: int = 0) -> int:
    """Approximate bytes of a `Hold` and what it refers to (dicts, lists, scalars).

    Small ints and dict keys are shared (cached or interned) and not counted.
    """
    if type(obj) is int and -5 <= obj <= 256:
        return 0
    size = alloc(obj)
    if _depth > 4:
        return size
    if isinstance(obj, Hold):
        return size + sum(deep_size(getattr(obj, name), _depth + 1) for name in Hold.__slots__)
    if isinstance(obj, dict):
        return size + sum(deep_size(v, _depth + 1) for v in obj.values())
    if isinstance(obj, list | tuple):
        return size + sum(deep_size(v, _depth + 1) for v in obj)
    return size


# Accounting estimates, checked against tracemalloc by the benchmark. A dict slot costs three pointers
# in the entries table plus index space, at the table's load between one third and two thirds.
_DICT_SLOT_BYTES = 56
NODE_BYTES = alloc(b"\0" * HASH_BYTES) + _DICT_SLOT_BYTES  # every block: its hash and its slot in the directory
FULL_NODE_BYTES = alloc(Node(b"", None))  # a block with a full Node: the Node
RESIDENT_NODE_BYTES = _DICT_SLOT_BYTES  # a full Node's entry in the `resident` of a replica that caches it
HOLD_BYTES = alloc(HoldRecord(HoldId("", 0), 0, b"", 0, b"", None, 0.0, 0)) + 3 * _DICT_SLOT_BYTES + 64
PROMPT_END_BYTES = _DICT_SLOT_BYTES  # a hold's entry in the directory's prompt ends
SEGMENT_BYTES = alloc(Segment(0, 0, None, None)) + alloc([]) + alloc(array("I")) + 2 * _DICT_SLOT_BYTES
SEGMENT_BLOCK_BYTES = 8 + 4  # a block's hash pointer and reference count in its segment


def bits(mask: int) -> Iterable[int]:
    """The set bits of a replica mask, as replica indexes (lowest first)."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low
