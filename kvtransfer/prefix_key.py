"""The identity of a prefix: chained block hashes over token ids, scoped by model and tenant.

`hash(k) = sha256(hash(k-1) || block k's token ids)[:15]`, seeded by the scope, so equal hashes mean equal
tokens from the first one on, under the same model, tenant and block size. The hashes are identical in
every process (no per-process salt, unlike Python's `hash()`), so engine replicas, the planner and the KV
directory can compute them independently and compare.
"""

from __future__ import annotations

import json
import sys
from array import array
from collections.abc import Iterable
from functools import lru_cache
from hashlib import sha256
from typing import NamedTuple

HASH_BYTES = 15
"""Bytes per block hash: 120 bits, so a chance collision between two prefixes is not a practical concern. Fifteen,
not sixteen: CPython hands out small objects in 16-byte steps and a bytes object carries 33 bytes of header, so a
15-byte hash is a 48-byte object and a 16-byte one a 64-byte object (the KV directory and every mirror keep one per
block: 16 MB per million blocks each)."""
TOKEN_BYTES = 4
"""Token ids are packed as little-endian uint32 (every vocabulary in use is far smaller)."""

_HASH_VERSION = "kvrelay-prefix-v2"

if array("I").itemsize != TOKEN_BYTES:  # pragma: no cover - exotic platforms only
    raise ImportError("prefix_key needs a 4-byte array('I'); this platform's is different")

BlockHash = bytes


class Scope(NamedTuple):
    """Whose KV a prefix is: one model, one tenant (API key or cache salt). Scopes never share a hash."""

    model: str
    tenant: str


@lru_cache(maxsize=1024)
def scope_seed(scope: Scope, block_size: int) -> BlockHash:
    """The parent hash of a scope's first block. Length-safe encoding: no two scopes share a seed."""
    blob = json.dumps([_HASH_VERSION, scope.model, scope.tenant, block_size]).encode()
    return sha256(blob).digest()[:HASH_BYTES]


def pack_tokens(token_ids: Iterable[int]) -> bytes:
    """Token ids as little-endian uint32 bytes."""
    try:
        arr = array("I", token_ids)
    except OverflowError as exc:
        raise ValueError(f"token ids must be in [0, 2**32): {exc}") from None
    if sys.byteorder == "big":  # pragma: no cover - big-endian hosts only
        arr.byteswap()
    return arr.tobytes()


def unpack_tokens(packed: bytes) -> tuple[int, ...]:
    arr = array("I", packed)
    if sys.byteorder == "big":  # pragma: no cover - big-endian hosts only
        arr.byteswap()
    return tuple(arr)


def _chain(parent: BlockHash, packed: bytes, block_size: int) -> bytes:
    """Concatenated hashes of the full blocks of packed tokens, chained from `parent`."""
    step = block_size * TOKEN_BYTES
    out = []
    append = out.append
    for start in range(0, len(packed) - step + 1, step):
        parent = sha256(parent + packed[start : start + step]).digest()[:HASH_BYTES]
        append(parent)
    return b"".join(out)


def chain_hashes(parent: BlockHash, token_ids: Iterable[int], block_size: int) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids`, chained from `parent`; a partial last block is ignored."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    joined = _chain(parent, pack_tokens(token_ids), block_size)
    return [joined[i : i + HASH_BYTES] for i in range(0, len(joined), HASH_BYTES)]


class PrefixKey(NamedTuple):
    """A token sequence with its chained block hashes: what lookups and records are keyed by.

    Packed as two flat byte strings (4 bytes per token, HASH_BYTES per full block), so a key is small,
    costs next to nothing to send through Ray, and lookups slice the one hash they probe. Build one per
    turn with `build` and grow it with `extend` as the conversation goes on (only new blocks are hashed).
    Immutable; safe to share between threads.
    """

    scope: Scope
    block_size: int
    tokens: bytes
    hashes: bytes

    @classmethod
    def build(cls, token_ids: Iterable[int], scope: Scope, block_size: int) -> PrefixKey:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        packed = pack_tokens(token_ids)
        return cls(scope, block_size, packed, _chain(scope_seed(scope, block_size), packed, block_size))

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // TOKEN_BYTES

    @property
    def num_full_blocks(self) -> int:
        return len(self.hashes) // HASH_BYTES

    def block_hash(self, index: int) -> BlockHash:
        """The hash of the prefix ending with full block `index` (0-based)."""
        return self.hashes[index * HASH_BYTES : (index + 1) * HASH_BYTES]

    def prompt_end(self, prompt_tokens: int) -> BlockHash | None:
        """Where a turn whose prompt is this key's first `prompt_tokens` tokens ends, as the next turn will see it: the
        hash of its last full block before the prompt's last token (a chat template may render that token together
        with the reply that follows it, so only the blocks before it are sure to come back); None if there is none."""
        blocks = min(self.num_full_blocks, (prompt_tokens - 1) // self.block_size) if prompt_tokens > 0 else 0
        return self.block_hash(blocks - 1) if blocks > 0 else None

    @property
    def block_hashes(self) -> tuple[BlockHash, ...]:
        """All block hashes, split (allocates; hot paths use `block_hash`)."""
        h = self.hashes
        return tuple(h[i : i + HASH_BYTES] for i in range(0, len(h), HASH_BYTES))

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The token ids, unpacked (allocates)."""
        return unpack_tokens(self.tokens)

    def extend(self, more_token_ids: Iterable[int]) -> PrefixKey:
        """This key followed by more tokens; hashes only the blocks that the new tokens complete."""
        more = pack_tokens(more_token_ids)
        if not more:
            return self
        packed = self.tokens + more
        done = self.num_full_blocks
        parent = self.hashes[-HASH_BYTES:] if done else scope_seed(self.scope, self.block_size)
        new = _chain(parent, packed[done * self.block_size * TOKEN_BYTES :], self.block_size)
        return PrefixKey(self.scope, self.block_size, packed, self.hashes + new)

    def truncate(self, num_tokens: int) -> PrefixKey:
        """The key of this key's first `num_tokens` tokens (no hashing)."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot truncate a {self.num_tokens}-token key to {num_tokens} tokens")
        if num_tokens == self.num_tokens:
            return self
        full = num_tokens // self.block_size
        return PrefixKey(
            self.scope,
            self.block_size,
            self.tokens[: num_tokens * TOKEN_BYTES],
            self.hashes[: full * HASH_BYTES],
        )

    def check(self) -> None:
        """Raise if the hashes do not belong to the tokens (for tests and untrusted input; rehashes all)."""
        if PrefixKey.build(self.token_ids, self.scope, self.block_size).hashes != self.hashes:
            raise ValueError("PrefixKey hashes do not match its token ids")
