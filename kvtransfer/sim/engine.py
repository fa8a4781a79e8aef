"""A modelled vLLM engine: continuous batching over a block prefix cache, in virtual time.

Each step the scheduler (as vLLM v1's, simplified) first gives every running request its share of the token
budget (`max_num_batched_tokens`): a decode token each, then the rest of a chunked prefill; then admits waiting
requests first come first served while budget, `max_num_seqs` and free KV blocks last. A request whose KV is
being pulled is admitted only once its transfer is done (`kv_ready_at`). A prefill's last chunk yields the first
token at the end of its step; each later step one token more. Full blocks join the prefix cache as they are
computed; a finished request's blocks are freed, or kept as a hold (`Hold`) until it is pulled, released or its
lease ends, as long as holds pin at most `max_held_fraction` of the cache (kvrelay's `nixl.max_held_fraction`).
A request is admitted only with blocks for its whole reply, where vLLM allocates a block at a time and preempts
a running request when none is left: no preemption, and so no request ever stalls mid-reply. Left out too:
speculative decoding, and bandwidth shared between simultaneous transfers.

The caller drives time: `next_step(now)` starts a step if there is work and returns when it ends; `finish_step()`
applies it. Not thread-safe.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtransfer.sim.block_cache import PrefixCache
from kvtransfer.sim.profile import EngineProfile


@dataclass
class SimRequest:
    """One engine request: a prompt, the reply it will produce, and what it may reuse."""

    request_id: str
    token_ids: list[int]  # prompt
    output_ids: list[int]  # the tokens it generates, known in advance (their count is max_tokens)
    # vLLM block hashes of every full block of prompt + output (the caller hashes a conversation once).
    hashes: list[bytes]
    arrival: float
    # Prompt tokens whose KV arrives by a pull (or a read of this engine's own hold), usable from kv_ready_at.
    pulled_tokens: int = 0
    kv_ready_at: float = 0.0
    cache_salt: str | None = None  # the tenant: its blocks hash apart from every other tenant's
    skip_cache: bool = False  # a forced recompute: reuse nothing
    export_hold: bool = False
    # Prompt tokens the planner expects it to reuse (its plan's): what a router counts as its prefill until the
    # engine admits it and finds what it really reuses.
    planned_reused: int = 0
    # Filled in as it runs.
    reused_tokens: int = 0
    computed: int = 0
    generated: int = 0
    refs: list[bytes] = field(default_factory=list)  # cached blocks it references
    private: int = 0  # blocks it owns outside the cache
    blocks_done: int = 0  # leading full blocks already offered to the cache
    prefill_started_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    ran_alone: bool = True  # no other request shared a step of its prefill

    @property
    def prompt_len(self) -> int:
        return len(self.token_ids)

    @property
    def context(self) -> int:
        return self.computed + max(0, self.generated - 1)

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt_len


@dataclass
class Hold:
    """A finished request's blocks, kept for a pull."""

    engine: SimEngine
    request_id: str
    num_tokens: int
    refs: list[bytes]
    private: int
    expires_at: float
    released: bool = False

    def release(self) -> None:
        """Free the blocks (pulled, released or expired); idempotent."""
        if not self.released:
            self.released = True
            self.engine.cache.release(self.refs, self.private)
            self.engine.holds.pop(self.request_id, None)


class SimEngine:
    """One modelled replica."""

    def __init__(self, replica_id: str, node: str, profile: EngineProfile,
                 busy_peers: Callable[[SimEngine], int] = lambda _: 0, max_held_fraction: float = 0.5) -> None:
        self.replica_id = replica_id
        self.node = node
        self.profile = profile
        self.cache = PrefixCache(profile.kv_cache_blocks, profile.block_size)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.holds: dict[str, Hold] = {}
        self.max_held_fraction = max_held_fraction
        # vLLM's enable_prefix_caching: off, a request reuses only what it pulls, and no block is cached.
        self.prefix_caching = True
        self._busy_peers = busy_peers
        self._step: list[tuple[SimRequest, int]] | None = None  # (request, tokens) of the step in flight
        self.last_step_ms: float | None = None
        self.steps = 0
        self.on_first_token: Callable[[SimRequest], None] = lambda r: None
        self.on_finish: Callable[[SimRequest, Hold | None], None] = lambda r, h: None

    # ----- state the planner reads

    @property
    def busy(self) -> bool:
        return self._step is not None

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting and self._step is None

    def prefill_backlog(self) -> tuple[int, int]:
        """(requests waiting for their first token, their prompt tokens still to compute): for a request not yet
        admitted, the prompt less what its plan reuses (as the ingress counts what it sent, `app/inflight.py`)."""
        waiting = [r for r in self.waiting if r.first_token_at is None]
        running = [r for r in self.running if r.first_token_at is None]
        return len(waiting) + len(running), (sum(r.prompt_len - max(r.computed, r.planned_reused) for r in waiting)
                                             + sum(r.prompt_len - r.computed for r in running))

    # ----- requests

    def add(self, request: SimRequest) -> None:
        self.waiting.append(request)

    # ----- stepping

    def next_step(self, now: float) -> float | None:
        """Schedule and start a step at `now` if there is work; returns when it ends (None: nothing to do)."""
        if self._step is not None:
            raise RuntimeError("a step is already in flight")
        budget = self.profile.max_num_batched_tokens
        batch: list[tuple[SimRequest, int]] = []
        for r in self.running:
            if budget <= 0:
                break
            if r.prefilling:
                k = min(budget, r.prompt_len - r.computed)
                if not self._blocks_for(r, r.computed + k):
                    continue
            else:
                k = 1
                if not self._blocks_for(r, r.prompt_len + r.generated + 1):
                    continue
            batch.append((r, k))
            budget -= k
        while self.waiting and budget > 0 and len(self.running) < self.profile.max_num_seqs:
            r = self._next_admissible(now)
            if r is None or not self._admit(r):
                break
            self.waiting.remove(r)
            self.running.append(r)
            k = min(budget, r.prompt_len - r.computed)
            batch.append((r, k))
            budget -= k
        if not batch:
            return None
        decoding = [(r, k) for r, k in batch if not r.prefilling]
        prefills = [(k, r.computed) for r, k in batch if r.prefilling]
        ms = self.profile.step_ms(len(decoding), sum(r.context for r, _ in decoding), prefills,
                                  self._busy_peers(self))
        for r, _ in batch:
            if r.prefilling and r.prefill_started_at is None:
                r.prefill_started_at = now
            if r.prefilling and len(batch) > 1:
                r.ran_alone = False
        self._step = batch
        self.last_step_ms = ms
        self.steps += 1
        return now + ms / 1e3

    def finish_step(self, now: float) -> None:
        """Apply the step in flight: prefill progress, tokens, newly full blocks, finished requests."""
        batch, self._step = self._step or [], None
        bs = self.profile.block_size
        for r, k in batch:
            if r.prefilling:
                r.computed += k
                if not r.prefilling:
                    r.generated = 1
                    r.first_token_at = now
                    self.on_first_token(r)
            else:
                r.generated += 1
            # Blocks hold the KV of every token but the newest (its KV is computed by the next step).
            full = min((r.computed + max(0, r.generated - 1)) // bs, len(r.hashes))
            if full > r.blocks_done and self.prefix_caching:
                self._cache_blocks(r, full)
            if r.generated >= len(r.output_ids) and r.generated > 0:
                self._finish(r, now)

    # ----- internals

    def _next_admissible(self, now: float) -> SimRequest | None:
        """The first waiting request whose KV (if pulled) has arrived: vLLM parks the others apart."""
        for r in self.waiting:
            if r.pulled_tokens == 0 or r.kv_ready_at <= now:
                return r
        return None

    def _admit(self, r: SimRequest) -> bool:
        """Reference the cached prefix, take blocks for the rest of the prompt; False if the cache is full."""
        bs = self.profile.block_size
        prompt_blocks = r.prompt_len // bs
        cached = 0 if r.skip_cache or not self.prefix_caching else self.cache.match(r.hashes[:prompt_blocks])
        reused = min(max(cached * bs, r.pulled_tokens), r.prompt_len - 1)
        needed = math.ceil((r.prompt_len + len(r.output_ids)) / bs) - cached
        if not self.cache.acquire(r.hashes[:cached], needed):
            return False
        r.refs = list(r.hashes[:cached])
        r.private = needed
        r.blocks_done = cached
        r.reused_tokens = reused
        r.computed = reused
        return True

    def _blocks_for(self, r: SimRequest, tokens: int) -> bool:
        """Whether `r` has (or could take) the blocks for `tokens` tokens."""
        have = len(r.refs) + r.private
        more = math.ceil(tokens / self.profile.block_size) - have
        if more <= 0:
            return True
        if self.cache.grow(more):
            r.private += more
            return True
        return False

    def _cache_blocks(self, r: SimRequest, full: int) -> None:
        """Offer `r`'s newly full blocks to the cache; those it stores move from `r`'s private blocks to its
        references (a block another request cached first stays private to `r`, as vLLM keeps the duplicate)."""
        bs, start = self.profile.block_size, r.blocks_done
        tokens = (r.token_ids + r.output_ids)[start * bs: full * bs]
        parent = r.hashes[start - 1] if start else None
        stored = self.cache.cache(parent, r.hashes[start:full], tokens, r.cache_salt)
        r.refs.extend(stored)
        r.private -= len(stored)
        r.blocks_done = full

    def _finish(self, r: SimRequest, now: float) -> None:
        r.finished_at = now
        self.running.remove(r)
        hold = None
        held = sum(len(h.refs) + h.private for h in self.holds.values())
        if r.export_hold and held + len(r.refs) + r.private <= self.max_held_fraction * self.cache.num_blocks:
            hold = Hold(self, r.request_id, r.prompt_len + r.generated - 1, r.refs, r.private,
                        now + self.profile.hold_ttl_s)
            self.holds[r.request_id] = hold
        else:
            self.cache.release(r.refs, r.private)
        self.on_finish(r, hold)
