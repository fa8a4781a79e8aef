"""vLLM's block-level prefix cache, modelled: block hashes as vLLM computes them, reference counts, LRU eviction.

What vLLM v1 does (`vllm/v1/core/block_pool.py`, `kv_cache_utils.py`): a full block of a request's tokens is
cached under `hash((parent hash, block tokens, extra keys))`; a block nobody references stays cached and is
evicted least recently freed first when a request needs a block; a request reuses the longest run of cached
blocks that starts its prompt. Holds (a finished turn's blocks kept for a NIXL pull) are references like any
other. Each change is reported as vLLM's KV events report it (`BlockStored`, `BlockRemoved`), which kvrelay's
`actors/kv_events.ResidentTracker` turns into directory updates exactly as it does for a real engine.

Not thread-safe; `match` only reads, every other method mutates.
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple

# vLLM's NONE_HASH seed for its default (cryptographic) hash when PYTHONHASHSEED is unset
# (`vllm.v1.core.kv_cache_utils.DEFAULT_NONE_HASH_SEED`).
VLLM_NONE_HASH_SEED = "vllm-none-hash"


def _vllm_sha256(value: Any) -> bytes:
    """vLLM's default prefix-caching hash ("sha256", `vllm.utils.hashing.sha256`): SHA-256 of the pickled value."""
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def vllm_block_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
    parent: bytes | None = None, seed: str = VLLM_NONE_HASH_SEED,
) -> list[bytes]:
    """The block hashes vLLM gives the full blocks of `token_ids` (no LoRA, no multimodal input), chained from
    `parent` (None: the prompt's first block, whose extra keys carry the cache salt)."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        first = parent is None
        extra = (("cache_salt", cache_salt),) if first and cache_salt else None
        parent = _vllm_sha256((_vllm_sha256(seed) if first else parent,
                               tuple(token_ids[start:start + block_size]), extra))
        hashes.append(parent)
    return hashes


def external_block_hash(block_hash: bytes) -> int:
    """A block hash as vLLM's KV events carry it by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1: the low 64 bits
    of its big-endian value, `vllm.v1.core.kv_cache_utils.maybe_convert_block_hash`)."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


class BlockStored(NamedTuple):
    """vLLM's `BlockStored` KV event, with the fields kvrelay's tracker reads."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    extra_keys: list[Any] | None = None
    lora_id: int | None = None
    medium: str | None = "GPU"
    group_idx: int | None = None


class BlockRemoved(NamedTuple):
    block_hashes: list[int]
    medium: str | None = "GPU"
    group_idx: int | None = None


class PrefixCache:
    """A fixed number of KV blocks: cached full blocks by hash (referenced or free in LRU order), and blocks private
    to requests (partial blocks, blocks not yet computed). Events accumulate in `events` until taken."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("a cache needs a positive number of blocks and block size")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refs: dict[bytes, int] = {}  # cached blocks -> references (0: free, evictable)
        self._free_cached: OrderedDict[bytes, None] = OrderedDict()  # evicted from the front
        self._private = 0  # blocks owned by requests that are not in the cache
        self.events: list[BlockStored | BlockRemoved] = []
        self.evicted = 0

    # ----- reads

    def match(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of `hashes` are cached (referenced or not)."""
        n = 0
        for h in hashes:
            if h not in self._refs:
                break
            n += 1
        return n

    @property
    def used_blocks(self) -> int:
        """Blocks some request or hold references (what a new request cannot take)."""
        return len(self._refs) - len(self._free_cached) + self._private

    @property
    def available_blocks(self) -> int:
        """Blocks a new request could take: never used, or cached and free (evicted on demand)."""
        return self.num_blocks - self.used_blocks

    # ----- changes

    def acquire(self, hashes: Sequence[bytes], new_blocks: int) -> bool:
        """Reference the cached blocks `hashes` and take `new_blocks` private blocks, evicting free cached blocks as
        needed; False (and no change) if there are not enough blocks."""
        reuse_free = sum(1 for h in hashes if self._refs.get(h) == 0)
        if new_blocks > self.available_blocks - reuse_free:
            return False
        for h in hashes:
            if self._refs[h] == 0:
                del self._free_cached[h]
            self._refs[h] += 1
        self._take(new_blocks)
        return True

    def _take(self, n: int) -> None:
        unused = self.num_blocks - len(self._refs) - self._private
        evict = max(0, n - unused)
        gone = []
        for _ in range(evict):
            h, _ = self._free_cached.popitem(last=False)
            del self._refs[h]
            gone.append(h)
        if gone:
            self.evicted += len(gone)
            self.events.append(BlockRemoved([external_block_hash(h) for h in gone]))
        self._private += n

    def grow(self, n: int) -> bool:
        """Take `n` more private blocks for a running request (its decode crossed a block); False if none left."""
        if n > self.available_blocks:
            return False
        self._take(n)
        return True

    def cache(self, parent: bytes | None, hashes: Sequence[bytes], token_ids: Sequence[int],
              cache_salt: str | None = None) -> list[bytes]:
        """A request filled private blocks whose hashes are `hashes` (after `parent`): they join the cache, still
        referenced by it. A hash already cached (another request computed the same block) keeps the request's copy
        private, as vLLM does. `cache_salt`: the request's, reported with a prompt's first block. Returns the hashes
        the request now references in the cache."""
        stored: list[bytes] = []
        run_start = None
        bs = self.block_size
        for i, h in enumerate([*hashes, None]):
            if h is not None and h not in self._refs:
                self._refs[h] = 1
                self._private -= 1
                stored.append(h)
                run_start = i if run_start is None else run_start
                continue
            if run_start is not None:  # one event per run of newly stored blocks, as vLLM sends per step
                before = parent if run_start == 0 else hashes[run_start - 1]
                # vLLM's events carry each block's extra keys: the salt on a prompt's first block.
                extra = ([(cache_salt,)] + [None] * (i - run_start - 1)) if before is None and cache_salt else None
                self.events.append(BlockStored(
                    [external_block_hash(h) for h in hashes[run_start:i]],
                    None if before is None else external_block_hash(before),
                    list(token_ids[run_start * bs:i * bs]), bs, extra))
                run_start = None
        return stored

    def release(self, hashes: Sequence[bytes], private: int) -> None:
        """A request or hold lets go of its cached blocks `hashes` (freed ones join the LRU end, the last block first
        to go last, as vLLM frees a request's blocks in reverse) and of `private` blocks."""
        for h in reversed(hashes):
            left = self._refs[h] - 1
            self._refs[h] = left
            if left == 0:
                self._free_cached[h] = None
        self._private -= private
        if self._private < 0:
            raise RuntimeError("released more private blocks than were taken")

    def take_events(self) -> list[BlockStored | BlockRemoved]:
        events, self.events = self.events, []
        return events

    def check_integrity(self) -> None:
        """Raise if a derived count is off (for tests)."""
        free = {h for h, r in self._refs.items() if r == 0}
        if free != set(self._free_cached):
            raise AssertionError("the free list does not match the unreferenced cached blocks")
        if any(r < 0 for r in self._refs.values()) or self._private < 0:
            raise AssertionError("negative reference count")
        if self.used_blocks + len(self._free_cached) > self.num_blocks:
            raise AssertionError("more blocks in use than exist")
