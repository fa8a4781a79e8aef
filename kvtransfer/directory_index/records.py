"""The KV directory's internal records (a block of a chain, a hold, a cache segment, a replica) and their cost.

Byte costs are estimates the directory sums to stay within `max_bytes`; `benchmarks/directory.py` checks them
against tracemalloc.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from kvtransfer.prefix_key import HASH_BYTES, BlockHash
from kvtransfer.types import Hold, HoldId

# NamedTuple construction through its generated __new__ costs a Python call; lookups build three per hit.
new_tuple = tuple.__new__

REF_BITS = 32  # per-replica reference counts are packed into one int, 32 bits per replica
REF_MASK = (1 << REF_BITS) - 1


class Node:
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
        self.ends: list[HoldRecord] | None = None  # holds whose full blocks end here


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
    """The blocks of one resident store op: the LRU unit for prefix-cache entries."""

    __slots__ = ("chain_id", "replica", "hashes", "live", "parent_seg")

    def __init__(self, chain_id: int, replica: int, parent_seg: Segment | None) -> None:
        self.chain_id = chain_id
        self.replica = replica
        self.hashes: list[BlockHash] = []
        self.live = 0
        self.parent_seg = parent_seg


class ReplicaRecord:
    """One replica's holdings: its holds, its resident blocks (by segment), and its bit index in node masks."""

    __slots__ = ("replica_id", "index", "holds", "resident", "holes", "segments")

    def __init__(self, replica_id: str, index: int) -> None:
        self.replica_id = replica_id
        self.index = index
        self.holds: set[HoldId] = set()
        self.resident: dict[BlockHash, Segment] = {}
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
NODE_BYTES = alloc(Node(None)) + alloc(b"\0" * HASH_BYTES) + _DICT_SLOT_BYTES
HOLD_BYTES = alloc(HoldRecord(HoldId("", 0), 0, b"", 0, b"", None, 0.0, 0)) + 3 * _DICT_SLOT_BYTES + 64
PROMPT_END_BYTES = _DICT_SLOT_BYTES  # a hold's entry in the directory's prompt ends
SEGMENT_BYTES = alloc(Segment(0, 0, None)) + alloc([]) + 2 * _DICT_SLOT_BYTES
RESIDENT_BYTES = _DICT_SLOT_BYTES + 8


def bits(mask: int) -> Iterable[int]:
    """The set bits of a replica mask, as replica indexes (lowest first)."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low
