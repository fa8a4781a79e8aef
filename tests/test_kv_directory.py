"""The KV directory core, its prefix hashes and the KV event translation, checked against brute force.

The property tests drive `KVDirectory` and a brute-force model of the same API through random
interleavings of record, lookup, consume, expire, resident store/remove/clear and replica drop. The event
tests use vLLM's own event structs and ZMQ publisher; one test runs a real tiny vLLM engine in a
subprocess and follows its prefix cache through the forwarder.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from actors.kv_events import KVEventForwarder, ResidentTracker
from kvtransfer.directory_index.index import KVDirectory
from kvtransfer.directory_index.results import ClearResident, RemoveResident, ResidentOp, ResidentResult, StoreResident
from kvtransfer.prefix_key import PrefixKey, Scope, chain_hashes, scope_seed
from kvtransfer.sim.block_cache import VLLM_NONE_HASH_SEED, external_block_hash, vllm_block_hashes
from kvtransfer.types import Hold, HoldId, LookupResult
from tests.conftest import make_hold

REPO_ROOT = Path(__file__).resolve().parents[1]
A, B = Scope("m", "tenant-a"), Scope("m", "tenant-b")


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def hold(tag: Any, num_tokens: int) -> Hold:
    return make_hold(num_tokens, engine_id=f"e-{tag}")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def directory(clock: FakeClock) -> KVDirectory:
    return KVDirectory(4, clock=clock, expiry_margin_s=5.0)


# ---------------------------------------------------------------------------------------------------------
# Prefix hashes


def test_hashes_are_chained_scoped_and_extend_incrementally() -> None:
    tokens = list(range(23))
    key = PrefixKey.build(tokens, A, 4)
    assert key.num_full_blocks == 5 and key.num_tokens == 23
    assert key.block_hashes == PrefixKey.build(tokens[:10], A, 4).extend(tokens[10:]).block_hashes
    assert key.truncate(13).block_hashes == key.block_hashes[:3]
    assert PrefixKey.build(tokens, B, 4).block_hashes[0] != key.block_hashes[0]
    assert PrefixKey.build(tokens, A, 8).block_hashes[0] != key.block_hashes[1]
    changed = PrefixKey.build([*tokens[:5], 99, *tokens[6:]], A, 4)
    assert changed.block_hashes[0] == key.block_hashes[0]
    assert all(x != y for x, y in zip(changed.block_hashes[1:], key.block_hashes[1:], strict=True))
    key.check()
    with pytest.raises(ValueError, match="2\\*\\*32"):
        PrefixKey.build([-1, 2, 3, 4], A, 4)


def test_hashes_are_identical_in_another_process() -> None:
    code = (
        "from kvtransfer.prefix_key import PrefixKey, Scope;"
        "print(PrefixKey.build(range(70), Scope('m', 't'), 32).block_hashes[-1].hex())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == PrefixKey.build(range(70), Scope("m", "t"), 32).block_hashes[-1].hex()


# ---------------------------------------------------------------------------------------------------------
# Holds


def test_hold_is_offered_for_exact_token_count_including_partial_last_block(directory: KVDirectory) -> None:
    history = directory.key(range(10), A)  # 2 full blocks + 2 tail tokens
    rec = directory.record_hold("r1", history, hold(1, 10), expires_at=2000.0)
    assert rec.kept and rec.new_entries == 2

    match = directory.lookup(history.extend([50, 51, 52])).best()
    assert match is not None and match.kind == "hold"
    assert (match.num_tokens, match.cached_tokens) == (10, 8)
    assert match.hold is not None and match.hold.hold.engine_id == "e-1"

    # Same full blocks, different tail token: the hold does not cover the query, the cached blocks still do.
    other = directory.lookup(directory.key([*range(9), 77, 78], A)).best()
    assert other is not None and other.kind == "resident" and other.hold is None
    assert (other.num_tokens, other.cached_tokens) == (8, 8)

    # A query shorter than the hold is not offered it either.
    short = directory.lookup(directory.key(range(9), A)).best()
    assert short is not None and short.hold is None and short.num_tokens == 8
    directory.check_integrity()


def test_hold_length_comes_from_remote_num_tokens(directory: KVDirectory) -> None:
    key = directory.key(range(12), A)
    directory.record_hold("r1", key, hold(1, 11), expires_at=2000.0)
    match = directory.lookup(key.extend([1])).best()
    assert match is not None and match.hold is not None and match.num_tokens == 11
    assert not directory.record_hold("r1", key, hold(2, 3), expires_at=2000.0).kept


def test_longest_hold_wins_and_newer_holds_do_not_supersede_older(directory: KVDirectory) -> None:
    turn1 = directory.key(range(9), A)
    turn2 = turn1.extend(range(100, 110))
    h1, h2 = hold(1, 9), hold(2, 19)
    directory.record_hold("r1", turn1, h1, expires_at=2000.0)
    directory.record_hold("r1", turn2, h2, expires_at=2000.0)
    match = directory.lookup(turn2.extend([7])).best()
    assert match is not None and match.hold is not None and match.hold.hold_id == h2.hold_id
    # A regenerated turn 2 diverges inside turn 2: turn 1's hold is still offered.
    regen = directory.lookup(turn1.extend([200, 201, 202, 203, 204, 205])).best()
    assert regen is not None and regen.hold is not None and regen.hold.hold_id == h1.hold_id
    assert regen.cached_tokens == 8  # turn 2's pinned blocks cover 2 full blocks of it
    directory.check_integrity()


def test_a_next_turn_continues_its_conversation_even_when_its_reply_came_back_as_other_tokens(
    directory: KVDirectory,
) -> None:
    system = list(range(100, 108))  # two blocks every conversation shares
    prompt = [*system, *range(10, 19)]  # 17 tokens: the turn's prompt
    reply = [40, 41, 42, 43, 44, 45]
    key = directory.key([*prompt, *reply], A)
    directory.record_hold("r1", key, hold(1, len(prompt) + len(reply)), expires_at=2000.0, prompt_tokens=len(prompt))
    # The next turn's prompt has the reply re-tokenized from its text (the first two tokens merged), then more.
    retokenized = directory.key([*prompt, 4041, 42, 43, 44, 45, 7, 8, 9, 10], A)
    assert directory.lookup(retokenized).best().hold is None  # no hold covers it: it is not the held history
    assert directory.continues(retokenized)
    # The chat template may render the prompt's last token (a newline) together with the reply.
    assert directory.continues(directory.key([*prompt[:-1], 999, *reply], A))
    # A new conversation sharing only the system prompt, or most of this one's prompt, does not continue it.
    assert not directory.continues(directory.key([*system, *range(60, 75)], A))
    assert not directory.continues(directory.key([*prompt[:10], 99, *prompt[11:], *reply], A))
    assert not directory.continues(directory.key([*prompt, *reply], B))  # another tenant
    directory.check_integrity()
    # Once the hold is gone (pulled, released or expired), nothing says where that conversation went.
    directory.consume_hold(directory.lookup(key.extend([1])).best().hold.hold_id)
    assert not directory.continues(retokenized)
    directory.check_integrity()


def test_expired_hold_is_never_returned(directory: KVDirectory, clock: FakeClock) -> None:
    key = directory.key(range(8), A)
    held = hold(1, 8)
    assert directory.record_hold("r1", key, held, expires_at=clock.now + 60).kept
    clock.now += 54.9
    assert directory.lookup(key).best() is not None
    clock.now += 0.2  # within the 5 s safety margin of the deadline
    assert directory.lookup(key).matches == ()
    assert directory.consume_hold(held.hold_id) is None
    assert directory.stats().holds_expired == 1 and directory.stats().entries == 0
    assert not directory.record_hold("r1", key, hold(2, 8), expires_at=clock.now + 4).kept
    directory.check_integrity()


def test_hold_is_single_use(directory: KVDirectory) -> None:
    key = directory.key(range(8), A)
    held = hold(1, 8)
    assert directory.record_hold("r1", key, held, expires_at=2000.0).kept
    assert directory.consume_hold(held.hold_id) == held
    assert directory.consume_hold(held.hold_id) is None
    assert directory.lookup(key).matches == ()
    directory.check_integrity()


def test_a_hold_is_known_by_the_id_its_replica_minted_and_recorded_once(directory: KVDirectory) -> None:
    key = directory.key(range(8), A)
    held = hold(1, 8)
    assert directory.record_hold("r1", key, held, expires_at=2000.0).kept
    # Recorded again (a mirror's own record and the feed's copy of it): one hold, still offered, taken once.
    again = directory.record_hold("r1", key, held, expires_at=2000.0)
    assert again.kept and again.new_entries == 0 and directory.stats().holds == 1
    assert directory.lookup(key).best().hold.hold_id == held.hold_id
    # Another export of the same tokens by the same engine is another hold.
    twin = replace(held, hold_id=held.hold_id._replace(serial=held.hold_id.serial + 1))
    directory.record_hold("r1", key, twin, expires_at=2000.0)
    assert directory.stats().holds == 2
    assert directory.lookup(key).best().hold.hold_id == twin.hold_id  # the newer of two equal holds is offered
    assert directory.consume_hold(held.hold_id) == held and directory.consume_hold(held.hold_id) is None
    assert directory.consume_hold(twin.hold_id) == twin
    directory.check_integrity()


def test_tenants_and_models_are_isolated(directory: KVDirectory) -> None:
    tokens = list(range(16))
    directory.record_hold("r1", directory.key(tokens, A), hold(1, 16), expires_at=2000.0)
    assert directory.lookup(tokens, B).matches == ()
    assert directory.lookup(tokens, Scope("other-model", "tenant-a")).matches == ()
    assert directory.lookup(tokens, A).best() is not None


def test_drop_replica_removes_everything_of_it(directory: KVDirectory) -> None:
    key = directory.key(range(16), A)
    directory.record_hold("r1", key, hold(1, 16), expires_at=2000.0)
    directory.record_hold("r2", key, hold(2, 16), expires_at=2000.0)
    directory.apply_resident("r1", [StoreResident(None, key.block_hashes)])
    assert directory.drop_replica("r1") == 2
    result = directory.lookup(key)
    assert [m.replica_id for m in result.matches] == ["r2"]
    assert directory.drop_replica("r1") == 0
    directory.check_integrity()


# ---------------------------------------------------------------------------------------------------------
# Resident prefix cache


def test_resident_chain_and_holes(directory: KVDirectory) -> None:
    key = directory.key(range(20), A)
    h = key.block_hashes
    res = directory.apply_resident("r1", [StoreResident(None, h[:2]), StoreResident(h[1], h[2:5])])
    assert (res.stored, res.skipped) == (5, 0)
    best = directory.lookup(key).best()
    assert best is not None and (best.kind, best.num_tokens, best.cached_tokens) == ("resident", 20, 20)
    # vLLM dropped block 2 but not its children: a prefix-cache hit stops before it.
    directory.apply_resident("r1", [RemoveResident((h[2],))])
    match = directory.lookup(key).best()
    assert match is not None and match.cached_tokens == 8 and match.kind == "resident"
    directory.check_integrity()
    # A store under an unknown parent is skipped (it could never be hit).
    other = directory.key(range(50, 70), A).block_hashes
    assert directory.apply_resident("r1", [StoreResident(other[0], other[1:3])]).skipped == 2
    # The block comes back: the chain is whole again.
    directory.apply_resident("r1", [StoreResident(h[1], (h[2],))])
    assert directory.lookup(key).best().cached_tokens == 20  # type: ignore[union-attr]
    directory.apply_resident("r1", [ClearResident()])
    assert directory.lookup(key).matches == () and directory.stats().entries == 0
    directory.check_integrity()


def test_each_replicas_cache_turnover_counts_what_its_engine_evicted(directory: KVDirectory) -> None:
    h = directory.key(range(20), A).block_hashes
    directory.apply_resident("r1", [StoreResident(None, h)])
    directory.apply_resident("r2", [StoreResident(None, h[:2])])
    directory.apply_resident("r1", [RemoveResident((h[4], h[3]))])
    directory.apply_resident("r1", [RemoveResident((h[3],))])  # already gone: not evicted twice
    assert directory.cache_turnover() == {"r1": (3, 2), "r2": (2, 0)}


def test_bounded_by_entries_with_lru_eviction(clock: FakeClock) -> None:
    directory = KVDirectory(4, max_entries=10, clock=clock)
    keys = [directory.key([i] * 16, A) for i in range(5)]  # 4 blocks each
    for i, key in enumerate(keys[:2]):
        directory.record_hold(f"r{i}", key, hold(i, 16), expires_at=2000.0)
    directory.lookup(keys[0])  # keys[0] is now the most recently used
    rec = directory.record_hold("r2", keys[2], hold(2, 16), expires_at=2000.0)
    assert rec.evicted_chains == 1
    assert directory.lookup(keys[1]).matches == () and directory.lookup(keys[0]).best() is not None
    assert directory.stats().entries <= 10
    directory.check_integrity()


def test_bounded_by_bytes(clock: FakeClock) -> None:
    directory = KVDirectory(4, max_bytes=20_000, clock=clock)
    for i in range(20):
        big = make_hold(8, block_ids=[list(range(200))])
        directory.record_hold("r1", directory.key([i] * 8, A), big, expires_at=2000.0)
        assert directory.stats().bytes <= 20_000
    assert 0 < directory.stats().holds < 20
    directory.check_integrity()


# ---------------------------------------------------------------------------------------------------------
# Property test: the directory against a brute-force model

BS = 2
MARGIN = 1.0
REPLICAS = ("r0", "r1", "r2")
SCOPES = (A, B)


class BruteForce:
    """The directory's contract, computed by scanning everything."""

    def __init__(self) -> None:
        self.holds: dict[HoldId, tuple[str, Scope, tuple[int, ...], Hold, float]] = {}
        self.flags: dict[str, set[tuple[Scope, tuple[int, ...]]]] = {r: set() for r in REPLICAS}
        self.prompts: dict[HoldId, int] = {}  # hold id -> the prompt tokens of the turn that left it

    def continues(self, scope: Scope, tokens: tuple[int, ...], now: float) -> bool:
        """Some pending hold's prompt, but for its last token and cut to full blocks, starts `tokens`."""
        for hold_id, (_r, s, htoks, _p, _e) in self.alive(now).items():
            prompt = self.prompts[hold_id]
            blocks = min(len(htoks) // BS, (prompt - 1) // BS) if prompt > 0 else 0
            if s == scope and blocks and tokens[: blocks * BS] == htoks[: blocks * BS]:
                return True
        return False

    def alive(self, now: float) -> dict[HoldId, tuple[str, Scope, tuple[int, ...], Hold, float]]:
        return {i: h for i, h in self.holds.items() if now < h[4] - MARGIN}

    def held_structurally(self, replica: str, scope: Scope, prefix: tuple[int, ...]) -> bool:
        return any(s == scope and p[: len(prefix)] == prefix for s, p in self.flags[replica])

    def lookup(self, scope: Scope, tokens: tuple[int, ...], now: float) -> list[tuple]:
        full = len(tokens) // BS
        out = []
        alive = self.alive(now)
        for replica in REPLICAS:
            resident = 0
            while resident < full and (scope, tokens[: (resident + 1) * BS]) in self.flags[replica]:
                resident += 1
            hold_blocks, best = 0, None
            for hold_id, (r, s, htoks, _p, _e) in alive.items():
                if r != replica or s != scope:
                    continue
                j = 0
                while j < min(len(htoks) // BS, full) and htoks[j * BS : (j + 1) * BS] == tokens[j * BS : (j + 1) * BS]:
                    j += 1
                hold_blocks = max(hold_blocks, j)
                if tokens[: len(htoks)] == htoks and (best is None or (len(htoks), hold_id) > best):
                    best = (len(htoks), hold_id)
            cached = max(resident, hold_blocks) * BS
            num = max(cached, best[0] if best else 0)
            if num:
                kind = "hold" if best is not None and best[0] >= cached else "resident"
                out.append((replica, num, kind, cached, best[1] if best else None))
        out.sort(key=lambda m: (-m[1], m[0]))
        return out


def summary(result: LookupResult) -> list[tuple]:
    return [
        (m.replica_id, m.num_tokens, m.kind, m.cached_tokens, m.hold.hold_id if m.hold else None)
        for m in result.matches
    ]


tokens_st = st.one_of(st.just(()), st.lists(st.integers(0, 2), max_size=8).map(tuple))
cut_st = st.sampled_from([0, 0, 0, 1, 2, 3, 5])
pick_st = st.integers(0, 11)


class DirectoryMachine(RuleBasedStateMachine):
    """Random interleavings: exact agreement when unbounded, never claiming more than the truth if bounded."""

    bounded = False

    @initialize()
    def setup(self) -> None:
        self.clock = FakeClock(0.0)
        limits = {"max_entries": 8, "max_bytes": 6_000} if self.bounded else {}
        self.directory = KVDirectory(BS, clock=self.clock, expiry_margin_s=MARGIN, **limits)
        self.model = BruteForce()
        self.hold_ids: list[HoldId] = []
        self.seqs: list[tuple[int, ...]] = [(0, 1, 0, 1, 0, 1, 0, 1), (0, 1, 2, 2, 1, 0)]

    def _seq(self, pick: int, extra: tuple[int, ...], cut: int) -> tuple[int, ...]:
        """A recent sequence (most recent first), cut short and/or extended: prefixes are shared often."""
        base = self.seqs[-1 - pick % len(self.seqs)]
        seq = (base[: max(0, len(base) - cut)] + extra)[:16]
        if seq not in self.seqs:
            self.seqs = [*self.seqs[-11:], seq]
        return seq

    @rule(
        replica=st.sampled_from(REPLICAS),
        scope=st.sampled_from(SCOPES),
        pick=pick_st,
        extra=tokens_st,
        cut=cut_st,
        ttl=st.floats(0.5, 20.0),
        prompt=st.integers(0, 16),
    )
    def record_hold(self, replica, scope, pick, extra, cut, ttl, prompt) -> None:
        seq = self._seq(pick, extra, cut)
        expires = self.clock.now + ttl
        prompt = min(prompt, len(seq))
        held = hold(seq, len(seq))
        rec = self.directory.record_hold(replica, PrefixKey.build(seq, scope, BS), held, expires,
                                         prompt_tokens=prompt)
        keep = len(seq) >= BS and self.clock.now < expires - MARGIN
        if not self.bounded:
            assert rec.kept == keep
        if rec.kept:
            assert keep
            self.hold_ids.append(held.hold_id)
            self.model.holds[held.hold_id] = (replica, scope, seq, held, expires)
            self.model.prompts[held.hold_id] = prompt

    @rule(
        replica=st.sampled_from(REPLICAS),
        scope=st.sampled_from(SCOPES),
        pick=pick_st,
        extra=tokens_st,
        start=st.integers(0, 7),
        count=st.integers(1, 4),
    )
    def store_resident(self, replica, scope, pick, extra, start, count) -> None:
        seq = self._seq(pick, extra, 0)
        hashes = PrefixKey.build(seq, scope, BS).block_hashes
        if start >= len(hashes):
            return
        parent = hashes[start - 1] if start else None
        res = self.directory.apply_resident(replica, [StoreResident(parent, hashes[start : start + count])])
        ok = start == 0 or self.model.held_structurally(replica, scope, seq[: start * BS])
        stored = len(hashes[start : start + count]) if ok else 0
        if not self.bounded:
            assert res.stored == stored
        if res.stored:
            assert ok
            for j in range(start, start + res.stored):
                self.model.flags[replica].add((scope, seq[: (j + 1) * BS]))

    @rule(
        replica=st.sampled_from(REPLICAS),
        scope=st.sampled_from(SCOPES),
        pick=pick_st,
        blocks=st.lists(st.integers(0, 7), max_size=3),
    )
    def remove_resident(self, replica, scope, pick, blocks) -> None:
        seq = self._seq(pick, (), 0)
        hashes = PrefixKey.build(seq, scope, BS).block_hashes
        chosen = tuple(sorted({b for b in blocks if b < len(hashes)}))
        self.directory.apply_resident(replica, [RemoveResident(tuple(hashes[b] for b in chosen))])
        for b in chosen:
            self.model.flags[replica].discard((scope, seq[: (b + 1) * BS]))

    @rule(replica=st.sampled_from(REPLICAS))
    def clear_resident(self, replica) -> None:
        self.directory.apply_resident(replica, [ClearResident()])
        self.model.flags[replica].clear()

    @rule(pick=st.integers(0, 1000))
    def consume(self, pick) -> None:
        if not self.hold_ids:
            return
        hold_id = self.hold_ids[pick % len(self.hold_ids)]
        got = self.directory.consume_hold(hold_id)
        expected = self.model.alive(self.clock.now).get(hold_id)
        if not self.bounded or got is not None:
            assert got == (expected[3] if expected else None)
        self.model.holds.pop(hold_id, None)

    @rule(seconds=st.floats(0.0, 4.0))
    def expire(self, seconds) -> None:
        self.clock.now += seconds

    @rule(replica=st.sampled_from(REPLICAS))
    def drop(self, replica) -> None:
        self.directory.drop_replica(replica)
        self.model.flags[replica].clear()
        self.model.holds = {i: h for i, h in self.model.holds.items() if h[0] != replica}

    @rule(scope=st.sampled_from(SCOPES), pick=pick_st, extra=tokens_st, cut=cut_st)
    def lookup(self, scope, pick, extra, cut) -> None:
        self._check_lookup(scope, self._seq(pick, extra, cut))

    def _check_lookup(self, scope: Scope, seq: tuple[int, ...]) -> None:
        key = PrefixKey.build(seq, scope, BS)
        got = summary(self.directory.lookup(key))
        expected = self.model.lookup(scope, seq, self.clock.now)
        continues = self.directory.continues(key)
        if not self.bounded:
            assert got == expected
            assert continues == self.model.continues(scope, seq, self.clock.now)
            return
        assert not continues or self.model.continues(scope, seq, self.clock.now)
        truth = {m[0]: m for m in expected}
        for replica, num, _kind, cached, hold_id in got:
            assert replica in truth and num <= truth[replica][1] and cached <= truth[replica][3]
            if hold_id is not None:
                _r, s, htoks, _p, _e = self.model.alive(self.clock.now)[hold_id]
                assert s == scope and seq[: len(htoks)] == htoks

    @invariant()
    def agrees_on_every_recent_sequence(self) -> None:
        for seq in self.seqs:
            for scope in SCOPES:
                self._check_lookup(scope, seq)
                self._check_lookup(scope, (*seq, 1))

    @invariant()
    def consistent(self) -> None:
        self.directory.check_integrity()


class BoundedDirectoryMachine(DirectoryMachine):
    bounded = True


_machine_settings = settings(
    max_examples=50, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestDirectoryAgainstBruteForce = DirectoryMachine.TestCase
TestDirectoryAgainstBruteForce.settings = _machine_settings
TestBoundedDirectoryIsSound = BoundedDirectoryMachine.TestCase
TestBoundedDirectoryIsSound.settings = _machine_settings


# ---------------------------------------------------------------------------------------------------------
# vLLM KV cache events


@pytest.fixture(scope="module")
def vllm_events() -> Any:
    import vllm.distributed.kv_events

    return vllm.distributed.kv_events


def stored(ev: Any, hashes: list[int], parent: int | None, tokens: list[int], salt: str | None = None, **kw) -> Any:
    extra = [(salt,) if salt else None] + [None] * (len(hashes) - 1) if parent is None else None
    return ev.BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=kw.pop("block_size", 4),
        lora_id=None,
        medium=kw.pop("medium", "GPU"),
        lora_name=None,
        extra_keys=extra,
        group_idx=0,
        kv_cache_spec_kind="full_attention",
        **kw,
    )


def test_tracker_maps_vllm_hashes_to_scoped_chain_hashes(vllm_events: Any) -> None:
    ev = vllm_events
    tracker = ResidentTracker("m", 4)
    directory = KVDirectory(4)
    tokens = list(range(16))
    ops = tracker.apply(
        [
            stored(ev, [101, 102], None, tokens[:8], salt="tenant-a"),
            stored(ev, [103, 104], 102, tokens[8:]),
            stored(ev, [999], 555, [1, 2, 3, 4]),  # unknown parent
            stored(ev, [777], None, [1, 2, 3, 4], medium="CPU"),  # offload tier
        ]
    )
    assert tracker.stats().skipped_unknown_parent == 1 and tracker.stats().skipped_other_tier == 1
    directory.apply_resident("r1", ops)
    key = directory.key(tokens, A)
    assert directory.lookup(key).best().cached_tokens == 16  # type: ignore[union-attr]
    assert directory.lookup(tokens, B).matches == ()

    directory.apply_resident("r1", tracker.apply([ev.BlockRemoved(block_hashes=[104], medium="GPU", group_idx=0)]))
    assert directory.lookup(key).best().cached_tokens == 12  # type: ignore[union-attr]
    # A bigger vLLM block maps to several of ours; removing it removes them all.
    big = tracker.apply([stored(ev, [201], None, list(range(8)), block_size=8)])
    assert big == [StoreResident(None, tuple(chain_hashes(scope_seed(Scope("m", ""), 4), range(8), 4)))]
    assert tracker.apply([ev.BlockRemoved(block_hashes=[201], medium="GPU")]) == [RemoveResident(big[0].hashes)]
    directory.apply_resident("r1", tracker.apply([ev.AllBlocksCleared()]))
    assert directory.lookup(key).matches == () and tracker.stats().mapped_blocks == 0
    directory.check_integrity()


def test_forwarder_replays_missed_batches_and_rebuilds_a_restarted_directory(vllm_events: Any, tmp_path: Path) -> None:
    ev = vllm_events
    endpoint, replay = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    publisher = ev.ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay, buffer_steps=100)
    directories = [KVDirectory(4)]

    async def send(replica_id: str, ops: list[ResidentOp]) -> ResidentResult:
        return directories[-1].apply_resident(replica_id, ops)

    tokens = list(range(24))
    key = directories[0].key(tokens, A)

    async def wait_for(cached: int) -> None:
        for _ in range(200):
            best = directories[-1].lookup(key).best()
            if (best.cached_tokens if best else 0) == cached:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"directory never reached {cached} cached tokens")

    async def scenario() -> KVEventForwarder:
        # Published before the forwarder subscribed: only the replay socket still has it.
        publisher.publish(ev.KVEventBatch(ts=time.time(), events=[stored(ev, [1, 2], None, tokens[:8], "tenant-a")]))
        await asyncio.sleep(0.2)
        forwarder = KVEventForwarder("r1", endpoint, ResidentTracker("m", 4), send, replay_endpoint=replay)
        forwarder.start()
        await asyncio.sleep(0.5)  # let the subscription settle (ZMQ drops messages to unready subscribers)
        publisher.publish(ev.KVEventBatch(ts=time.time(), events=[stored(ev, [3, 4], 2, tokens[8:16])]))
        await wait_for(16)
        directories.append(KVDirectory(4))  # the directory restarted empty, with a new epoch
        publisher.publish(ev.KVEventBatch(ts=time.time(), events=[stored(ev, [5], 4, tokens[16:20])]))
        await wait_for(20)
        await forwarder.stop()
        return forwarder

    try:
        forwarder = asyncio.run(scenario())
    finally:
        publisher.shutdown()
    stats = forwarder.stats()
    assert stats.replayed_batches == 1 and stats.rebuilds == 1 and stats.last_seq == 2
    directories[-1].check_integrity()


_ENGINE_SCRIPT = r"""
import json, os, sys
from vllm import LLM, SamplingParams

def main():
    model_dir, endpoint, replay = sys.argv[1:4]
    # 2 MiB of KV cache is 16 blocks of 32 tokens for this model: a few prompts evict older blocks.
    llm = LLM(model=model_dir, enforce_eager=True, max_model_len=256, block_size=32, dtype="float32",
              kv_cache_memory_bytes=2 * 1024**2, enable_prefix_caching=True, seed=0,
              kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                "endpoint": endpoint, "replay_endpoint": replay})
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    print("@@READY", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "generate":
            prompt = {"prompt_token_ids": cmd["tokens"]}
            if cmd.get("salt"):
                prompt["cache_salt"] = cmd["salt"]
            out = llm.generate([prompt], greedy, use_tqdm=False)[0]
            answer = {"output": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens}
            print("@@" + json.dumps(answer), flush=True)
        elif cmd["op"] == "reset":
            llm.reset_prefix_cache()
            print("@@{}", flush=True)
        else:
            return

if __name__ == "__main__":
    main()
"""


@pytest.mark.slow
def test_real_vllm_engine_events_follow_its_prefix_cache(tmp_path: Path) -> None:
    """One tiny engine in a subprocess; its ZMQ KV events drive a directory through the forwarder."""
    from model_prep.store import ensure_model

    model_dir = ensure_model("tiny-llama", progress=lambda _msg: None)
    endpoint, replay = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    script = tmp_path / "engine.py"
    script.write_text(_ENGINE_SCRIPT)
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"),
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
    }
    child = subprocess.Popen(
        [sys.executable, str(script), str(model_dir), endpoint, replay],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    assert child.stdin is not None and child.stdout is not None

    def reply() -> str:
        """The child's next answer line; vLLM logs to stdout too, so answers start with '@@'."""
        for line in child.stdout:  # type: ignore[union-attr]
            if line.startswith("@@"):
                return line[2:].strip()
        return ""

    def call(**cmd: Any) -> dict[str, Any]:
        child.stdin.write(json.dumps(cmd) + "\n")  # type: ignore[union-attr]
        child.stdin.flush()  # type: ignore[union-attr]
        return json.loads(reply())

    directory = KVDirectory(32)
    scope = Scope("tiny-llama", "tenant-a")

    async def send(replica_id: str, ops: list[ResidentOp]) -> ResidentResult:
        return directory.apply_resident(replica_id, ops)

    async def settle(key: PrefixKey, cached: int) -> int:
        got = -1
        for _ in range(300):
            best = directory.lookup(key).best()
            got = best.cached_tokens if best else 0
            if got == cached:
                break
            await asyncio.sleep(0.05)
        return got

    async def generate(tokens: list[int], salt: str | None = None) -> dict[str, Any]:
        return await asyncio.to_thread(call, op="generate", tokens=tokens, salt=salt)

    class Recording:
        """The tracker, keeping the vLLM block hashes of the blocks the engine reports stored."""

        def __init__(self, tracker: ResidentTracker) -> None:
            self.tracker, self.stored = tracker, []

        def apply(self, events: Any) -> list[ResidentOp]:
            self.stored += [h for e in events if type(e).__name__ == "BlockStored" for h in e.block_hashes]
            return self.tracker.apply(events)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.tracker, name)

    recording = Recording(ResidentTracker("tiny-llama", 32))

    async def scenario() -> dict[str, int]:
        tracker = recording.tracker
        forwarder = KVEventForwarder("r1", endpoint, recording, send, replay_endpoint=replay)
        forwarder.start()
        seen: dict[str, int] = {}
        prompt = [(7 * i) % 1500 + 10 for i in range(100)]
        turn1 = await generate(prompt, salt="tenant-a")
        follow_up = PrefixKey.build(prompt + turn1["output"] + [5, 6, 7], scope, 32)
        seen["after_turn1"] = await settle(follow_up, 96)
        # The fleet simulator's modelled cache hashes the same tokens into the same blocks as this engine.
        seed = os.environ.get("PYTHONHASHSEED", VLLM_NONE_HASH_SEED)
        modelled = vllm_block_hashes(prompt + turn1["output"], 32, "tenant-a", seed=seed)
        seen["hashes_as_modelled"] = recording.stored[:3] == [external_block_hash(h) for h in modelled]
        seen["other_tenant"] = len(directory.lookup(prompt, Scope("tiny-llama", "")).matches)
        seen["engine_turn2"] = (await generate(list(follow_up.token_ids), salt="tenant-a"))["cached"]
        for seed in (1, 2, 3):  # unrelated long prompts push the conversation's blocks out
            await generate([(seed * 1000 + 13 * i) % 1400 + 20 for i in range(200)])
        await asyncio.sleep(1.0)  # let the forwarder deliver the removals
        best = directory.lookup(follow_up).best()
        seen["predicted_turn3"] = best.cached_tokens if best else 0
        seen["engine_turn3"] = (await generate(list(follow_up.token_ids), salt="tenant-a"))["cached"]
        seen["removed"] = tracker.stats().removed
        await asyncio.to_thread(call, op="reset")
        await generate([1, 2, 3])  # the next engine step publishes the clear
        for _ in range(300):
            if directory.stats().resident_blocks == 0:
                break
            await asyncio.sleep(0.05)
        seen["after_reset"] = directory.stats().resident_blocks
        await forwarder.stop()
        return seen

    try:
        started = reply()
        assert started == "READY", f"the tiny vLLM engine did not start: {started}"
        seen = asyncio.run(scenario())
        child.stdin.write(json.dumps({"op": "quit"}) + "\n")
        child.stdin.flush()
    finally:
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
    assert seen["hashes_as_modelled"]  # kvtransfer/sim/block_cache.py computes vLLM's own block hashes
    assert seen["after_turn1"] == 96  # 100 prompt + 6 generated tokens, 105 computed: 3 full blocks of 32
    assert seen["other_tenant"] == 0  # the cache salt is the tenant
    assert seen["engine_turn2"] == 96  # vLLM agrees: turn 2 hit exactly what the directory said
    assert seen["removed"] > 0 and seen["predicted_turn3"] < 96  # evictions reach the directory
    assert seen["predicted_turn3"] == seen["engine_turn3"]  # and it still predicts vLLM's hit exactly
    assert seen["after_reset"] == 0
    directory.check_integrity()
