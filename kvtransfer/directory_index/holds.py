"""Exported holds in the KV directory: recorded per turn, offered when a query starts with their tokens,
consumed once, and gone at expiry.

vLLM checks no token ids when it pulls, so a hold is offered only for a query that starts with exactly its
tokens (its full blocks by chained hash, its partial last block by the stored tokens), and only until its lease
is within `expiry_margin_s` of ending.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from kvtransfer.directory_index.chains import ChainIndex, H
from kvtransfer.directory_index.records import (
    FULL_NODE_BYTES,
    HOLD_BYTES,
    NODE_BYTES,
    PROMPT_END_BYTES,
    HoldRecord,
    Node,
    ReplicaRecord,
    Segment,
    add_ref,
    alloc,
    deep_size,
    new_tuple,
    union,
)
from kvtransfer.directory_index.results import HeldPrefix, RecordResult
from kvtransfer.prefix_key import TOKEN_BYTES, BlockHash, PrefixKey, Scope
from kvtransfer.types import Hold, HoldId, HoldOffer


class HoldIndex(ChainIndex):
    """Record, offer, consume and expire holds (part of `KVDirectory`)."""

    def record_hold(
        self,
        replica_id: str,
        key: PrefixKey | Sequence[int],
        hold: Hold,
        expires_at: float,
        *,
        scope: Scope | tuple[str, str] | None = None,
        prompt_tokens: int = 0,
    ) -> RecordResult:
        """Record that `replica_id` exported `hold`, the KV of the first `hold.num_tokens` tokens of `key`, under the
        id its replica minted (`hold.hold_id`); a hold recorded already stays as it is.

        `expires_at` is in this directory's clock (wall time by default). Holds without a full block are not
        kept: a pull would never beat recomputing them. `prompt_tokens`: how many of `key`'s tokens were the
        prompt of the turn that left the hold (the rest its reply), so that `continues` knows a next turn of its
        conversation even where the reply's tokens come back different (0: unknown).
        """
        held = self.held_prefix(key, hold.num_tokens, scope=scope, prompt_tokens=prompt_tokens)
        return self.record_held(replica_id, held, hold, expires_at)

    def held_prefix(
        self, key: PrefixKey | Sequence[int], num_tokens: int, *, scope: Scope | tuple[str, str] | None = None,
        prompt_tokens: int = 0,
    ) -> HeldPrefix:
        """What recording a hold of the first `num_tokens` tokens of `key` keeps of them (see `record_hold`)."""
        key = self._as_key(key, scope)
        if not 0 <= num_tokens <= key.num_tokens:
            raise ValueError(f"num_tokens={num_tokens} is outside the key's {key.num_tokens} tokens")
        full = num_tokens // self.block_size
        tail = key.tokens[full * self.block_size * TOKEN_BYTES : num_tokens * TOKEN_BYTES]
        prompt_end = key.prompt_end(min(prompt_tokens, full * self.block_size + 1))  # within the hold's full blocks
        return HeldPrefix(key.hashes[: full * H], tail, prompt_end)

    def record_held(self, replica_id: str, held: HeldPrefix, hold: Hold, expires_at: float) -> RecordResult:
        """`record_hold` for a hold whose tokens are already reduced to what the directory keeps of them (how the
        directory actor's change feed carries a hold to the mirrors)."""
        num_tokens = hold.num_tokens
        full = len(held.hashes) // H
        if full * self.block_size + len(held.tail) // TOKEN_BYTES != num_tokens or len(held.tail) >= (
            self.block_size * TOKEN_BYTES
        ):
            raise ValueError(f"the held prefix does not cover the hold's {num_tokens} tokens")
        now = self._purge_expired()
        hold_id = hold.hold_id
        if hold_id in self._holds:
            return RecordResult(True, 0, 0)
        if full == 0 or not self._offerable(expires_at, now):
            return RecordResult(False, 0, 0)
        rep = self._replica(replica_id)
        tail, prompt_end = held.tail, held.prompt_end
        end = held.hashes[-H:]
        nbytes = HOLD_BYTES + alloc(tail) + deep_size(hold) + (PROMPT_END_BYTES if prompt_end is not None else 0)
        record = HoldRecord(hold_id, rep.index, end, num_tokens, tail, hold, expires_at, nbytes, prompt_end)
        if prompt_end is not None:
            self._prompt_ends[prompt_end] = self._prompt_ends.get(prompt_end, 0) + 1
        created = self._acquire_hold(held.hashes, full, rep)
        node = self._nodes[end]
        assert type(node) is Node  # a held block has a full Node
        if node.ends is None:
            node.ends = [record]
        else:
            node.ends.append(record)
        self._holds[hold_id] = record
        self._lru[hold_id] = record
        rep.holds.add(hold_id)
        heapq.heappush(self._expiry, (expires_at, hold_id))
        self._bytes += nbytes
        evicted = self._enforce_bounds()
        return RecordResult(hold_id in self._holds, created, evicted)

    def _acquire_hold(self, hashes: bytes, depth: int, rep: ReplicaRecord) -> int:
        """One direct hold reference of `rep` on the node at `depth`; returns nodes created."""
        index, bit = rep.index, rep.bit
        nodes = self._nodes
        created = 0
        near: tuple[Segment | None, int] = (None, -1)  # where the child was found: the parent is likely before it
        i = depth - 1
        key: BlockHash | None = hashes[i * H : (i + 1) * H]
        while key is not None:
            # One bytes object per hash: a new node's parent pointer is its new parent's dict key.
            parent = hashes[(i - 1) * H : i * H] if i else None
            node = nodes.get(key)
            if node is None:
                node = nodes[key] = Node(key, parent)
                self._bytes += NODE_BYTES + FULL_NODE_BYTES
                created += 1
            elif type(node) is Segment:
                near = (node, node.position(key, near[1] - 1 if node is near[0] else -1))
                node = self._expand(key, node, near[1])
            hmask = node.hmask
            node.hrefs = node.hrefs + 1 if hmask == bit else add_ref(node.hrefs, hmask, index, 1)
            if hmask & bit:
                break
            node.hmask = union(hmask, bit)
            node.mask = union(node.mask, bit)
            key, i = parent, i - 1
        return created

    def consume_hold(self, hold_id: HoldId) -> Hold | None:
        """The hold, once: it is gone from the directory afterwards. None if expired or unknown."""
        self._purge_expired()
        record = self._holds.get(hold_id)
        if record is None:
            return None
        self._remove_hold(record)
        self._holds_consumed += 1
        return record.hold

    def _offerable(self, expires_at: float, now: float) -> bool:
        return now < expires_at - self.expiry_margin_s

    def _remove_hold(self, hold: HoldRecord) -> None:
        rep = self._by_index[hold.replica]
        node = self._nodes[hold.end]
        assert node.ends is not None
        node.ends.remove(hold)
        if not node.ends:
            node.ends = None
        del self._holds[hold.hold_id]
        del self._lru[hold.hold_id]
        if hold.prompt_end is not None:
            left = self._prompt_ends.pop(hold.prompt_end) - 1
            if left:
                self._prompt_ends[hold.prompt_end] = left
        rep.holds.discard(hold.hold_id)
        self._bytes -= hold.nbytes
        self._release(hold.end, rep, resident=False)
        self._forget_if_empty(rep)

    def _purge_expired(self) -> float:
        """Remove every hold that is no longer offerable; returns the clock reading used."""
        now = self._clock()
        heap = self._expiry
        while heap and not self._offerable(heap[0][0], now):
            _, hold_id = heapq.heappop(heap)
            hold = self._holds.get(hold_id)
            if hold is not None and not self._offerable(hold.expires_at, now):
                self._remove_hold(hold)
                self._holds_expired += 1
        if len(heap) > 2 * len(self._holds) + 64:  # consumed and evicted holds leave stale entries
            self._expiry = [(h.expires_at, h.hold_id) for h in self._holds.values()]
            heapq.heapify(self._expiry)
        return now

    def continues(self, key: PrefixKey) -> bool:
        """Whether `key` starts with the whole prompt of a turn whose hold is pending here: the query then continues
        that turn's conversation (or repeats the turn), whatever its reply's tokens came back as. A reply
        re-tokenized from its text can differ from the tokens the model generated ("of" + "a" comes back as "ofa"),
        and then no hold matches the query, though the conversation goes on. Holds past their offer time no longer
        count. A prompt end lies on its hold's chain, so only the query's blocks that some hold covers are probed,
        from the deepest (found by bisection: every replica's holds are closed under "parent of")."""
        ends = self._prompt_ends
        if ends and self._expiry and self._clock() >= self._expiry[0][0] - self.expiry_margin_s:
            self._purge_expired()
        if not ends:
            return False
        hashes = key.hashes
        held = self._deepest(hashes, len(hashes) // H, -1)  # bit -1: held by any replica
        return any(hashes[(d - 1) * H : d * H] in ends for d in range(held, 0, -1))

    # ----- offers (for `KVDirectory.lookup`)

    def _deepest(self, hashes: Sequence[BlockHash], hi: int, bit: int) -> int:
        """Deepest depth in [0, hi] whose node this replica holds through holds (prefix-closed)."""
        get = self._nodes.get
        lo = 0
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            node = get(hashes[(mid - 1) * H : mid * H])
            if node is not None and node.hmask & bit:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _offer(self, key: PrefixKey, rep: ReplicaRecord, depth: int, node: Node | None) -> HoldOffer | None:
        """The longest hold of `rep` whose full blocks end on the query's chain and whose tail matches.

        `node` is the node at `depth` when the caller has it.
        """
        get, tokens, hashes, index = self._nodes.get, key.tokens, key.hashes, rep.index
        step = self.block_size * TOKEN_BYTES
        if node is None and depth:
            node = get(hashes[(depth - 1) * H : depth * H])
        k = depth
        while k > 0:
            ends = node.ends if node is not None else None
            if ends:
                best: HoldRecord | None = None
                start = k * step
                for hold in ends:
                    if hold.replica != index or tokens[start : start + len(hold.tail)] != hold.tail:
                        continue
                    if best is None or (hold.num_tokens, hold.hold_id) > (best.num_tokens, best.hold_id):
                        best = hold
                if best is not None:
                    best.used = True
                    self._hold_offers += 1
                    offer = (rep.replica_id, best.num_tokens, best.expires_at, best.hold)
                    return new_tuple(HoldOffer, offer)
            k -= 1
            if k:
                node = get(hashes[(k - 1) * H : k * H])
        return None
