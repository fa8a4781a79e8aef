"""The KV directory's blocks by hash, packed: `BlockMap`.

A dict of a million blocks costs, per block, a slot of its table (CPython sizes a table that has seen deletions at
three times its entries: about 80 bytes a block at a million) and keeps each 16-byte hash alive as a Python object
(64 bytes). `BlockMap` keeps each hash as its two 64-bit halves in sorted arrays, with a pointer to its record beside
them: 24 bytes a block and what the arrays over-allocate. The hashes are spread over buckets by their low bits, so
that adding or dropping a block moves about a thousand entries of one bucket at a million blocks, never the whole map.
A lookup is a binary search in one bucket: 1.5 us against a dict's 0.1 (a turn's lookup probes a few blocks, a
prefix-cache event one per block it stores).
"""

from __future__ import annotations

import struct
import sys
from array import array
from bisect import bisect_left
from collections.abc import Iterator
from typing import Any

from kvtransfer.prefix_key import HASH_BYTES, BlockHash

if HASH_BYTES != 16:  # pragma: no cover - the layout below is two 64-bit halves
    raise ImportError(f"BlockMap packs 16-byte block hashes, not {HASH_BYTES}")

_halves = struct.Struct("<QQ").unpack  # a hash's two 64-bit halves (struct.error if it is not 16 bytes)
_pack = struct.Struct("<QQ").pack
_BUCKETS = 1024
_MASK = _BUCKETS - 1
Bucket = tuple[array, array, list]  # first halves (sorted), second halves, records
_NO_BUCKET: Bucket = (array("Q"), array("Q"), [])  # read in place of a bucket not made yet; never written


def _alloc(obj: object) -> int:
    return (sys.getsizeof(obj) + 15) & ~15  # CPython rounds small allocations up to 16 bytes


BYTES_PER_BLOCK = 31  # two 8-byte halves and an 8-byte pointer, and what the buckets over-allocate (most when small)
_EMPTY_BYTES = _alloc([_NO_BUCKET] * _BUCKETS)
_BUCKET_BYTES = _alloc(_NO_BUCKET) + 2 * _alloc(array("Q")) + _alloc([])


class BlockMap:
    """Block hash -> record, for 16-byte hashes: the dict operations the directory uses. Not thread-safe."""

    __slots__ = ("_buckets", "_made", "_len")

    def __init__(self) -> None:
        self._buckets: list[Bucket] = [_NO_BUCKET] * _BUCKETS
        self._made = 0  # buckets that hold a block
        self._len = 0

    @property
    def overhead_bytes(self) -> int:
        """What the map costs beyond `BYTES_PER_BLOCK` a block: its bucket table and the buckets in use."""
        return _EMPTY_BYTES + self._made * _BUCKET_BYTES

    @staticmethod
    def _index(high: int, low: int, bucket: Bucket) -> int:
        """Where the hash (`high`, `low`) is in `bucket`; if it is not there, -1 - where it would go."""
        highs = bucket[0]
        i = where = bisect_left(highs, high)
        n = len(highs)
        while i < n and highs[i] == high:  # hashes that share a first half (rare) are next to each other
            if bucket[1][i] == low:
                return i
            i += 1
        return -1 - where

    def get(self, key: BlockHash, default: Any = None) -> Any:
        high, low = _halves(key)
        bucket = self._buckets[high & _MASK]
        i = self._index(high, low, bucket)
        return bucket[2][i] if i >= 0 else default

    def __getitem__(self, key: BlockHash) -> Any:
        high, low = _halves(key)
        bucket = self._buckets[high & _MASK]
        i = self._index(high, low, bucket)
        if i < 0:
            raise KeyError(key)
        return bucket[2][i]

    def __contains__(self, key: object) -> bool:
        if type(key) is not bytes or len(key) != HASH_BYTES:
            return False
        high, low = _halves(key)
        return self._index(high, low, self._buckets[high & _MASK]) >= 0

    def __setitem__(self, key: BlockHash, record: Any) -> None:
        high, low = _halves(key)
        bucket = self._buckets[high & _MASK]
        i = self._index(high, low, bucket)
        if i >= 0:
            bucket[2][i] = record
        else:
            self._insert(high, low, -1 - i, record)

    def add(self, key: BlockHash, record: Any) -> Any:
        """Give `key` the record `record` unless it has one: returns the record it had, None if it had none (one
        search where a get and a set take two). Records are never None."""
        high, low = _halves(key)
        bucket = self._buckets[high & _MASK]
        i = self._index(high, low, bucket)
        if i >= 0:
            return bucket[2][i]
        self._insert(high, low, -1 - i, record)
        return None

    def _insert(self, high: int, low: int, i: int, record: Any) -> None:
        bucket = self._buckets[high & _MASK]
        if bucket is _NO_BUCKET:
            bucket = self._buckets[high & _MASK] = (array("Q"), array("Q"), [])
            self._made += 1
        bucket[0].insert(i, high)
        bucket[1].insert(i, low)
        bucket[2].insert(i, record)
        self._len += 1

    def __delitem__(self, key: BlockHash) -> None:
        high, low = _halves(key)
        bucket = self._buckets[high & _MASK]
        i = self._index(high, low, bucket)
        if i < 0:
            raise KeyError(key)
        del bucket[0][i], bucket[1][i], bucket[2][i]
        self._len -= 1
        if not bucket[0]:
            self._buckets[high & _MASK] = _NO_BUCKET
            self._made -= 1

    def __getstate__(self) -> dict[int, Bucket]:
        return {i: bucket for i, bucket in enumerate(self._buckets) if bucket is not _NO_BUCKET}

    def __setstate__(self, state: dict[int, Bucket]) -> None:
        self._buckets = [_NO_BUCKET] * _BUCKETS  # this process's stand-in for an empty bucket, not a copy of another's
        for i, bucket in state.items():
            self._buckets[i] = bucket
        self._made = len(state)
        self._len = sum(len(bucket[0]) for bucket in state.values())

    def __len__(self) -> int:
        return self._len

    def items(self) -> Iterator[tuple[BlockHash, Any]]:
        for highs, lows, records in self._buckets:
            for high, low, record in zip(highs, lows, records, strict=True):
                yield _pack(high, low), record
