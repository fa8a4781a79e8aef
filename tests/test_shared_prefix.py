"""What seeding a shared prompt prefix on a replica is worth (`kvtransfer/shared_prefix.py`): first turns per second
by prefix, each replica's cache lifetime by Little's law, and Che's approximation of the chance of a reuse."""

from __future__ import annotations

import math
import random

import pytest

from kvtransfer.prefix_key import HASH_BYTES, PrefixKey, Scope
from kvtransfer.shared_prefix import SharedPrefixes, shared_prefix
from kvtransfer.types import LookupResult, ReplicaMatch


def test_first_turns_per_second_by_prefix_follow_their_arrival_rate():
    prefixes, rng, now = SharedPrefixes(), random.Random(0), 0.0
    while now < 20 * SharedPrefixes.TAU_S:  # Poisson arrivals: 3 a second of one prefix, 0.5 of another
        now += rng.expovariate(3.5)
        prefixes.observe_first_turn(b"hot" if rng.random() < 3 / 3.5 else b"rare", now)
    assert prefixes.rate(b"hot") == pytest.approx(3.0, rel=0.2)
    assert prefixes.rate(b"rare") == pytest.approx(0.5, rel=0.35)
    assert prefixes.rate(b"never") == 0.0
    # One that stops coming fades with the time constant, read at the latest first turn of any prefix.
    before = prefixes.rate(b"hot")
    prefixes.observe_first_turn(b"rare", now + SharedPrefixes.TAU_S)
    assert prefixes.rate(b"hot") == pytest.approx(before * math.exp(-1))


def test_a_caches_lifetime_is_its_resident_blocks_over_its_evictions_a_second():
    prefixes = SharedPrefixes()
    evicted = {"a": 0}

    def turnover() -> dict[str, tuple[int, int]]:
        return {"a": (20_000, evicted["a"]), "b": (500, 0)}

    for second in range(600):
        prefixes.observe_caches(turnover, float(second))
        evicted["a"] += 100  # "a" evicts 100 blocks a second; "b" nothing
    assert prefixes.lifetime_s("a") == pytest.approx(200.0, rel=0.02)
    assert prefixes.lifetime_s("b") == 599.0  # as long as it has been watched
    assert prefixes.lifetime_s("never-seen") == 0.0
    # Readings closer together than SAMPLE_S are skipped: the directory is not walked once per turn.
    calls = []
    prefixes.observe_caches(lambda: calls.append(1) or turnover(), 599.5)
    assert not calls


def test_a_seeded_prefix_is_reused_by_the_chance_of_its_next_request_within_the_caches_lifetime():
    prefixes = SharedPrefixes()
    for i in range(int(10 * SharedPrefixes.TAU_S)):
        prefixes.observe_first_turn(b"p", float(i))  # one a second
    prefixes.observe_caches(lambda: {"a": (1000, 0)}, 0.0)
    prefixes.observe_caches(lambda: {"a": (1000, 0)}, 8.0)  # watched 8 s, nothing evicted
    rate = prefixes.rate(b"p")
    # Spread over 4 replicas, "a" sees it at rate / 4 and keeps a block at least 8 s.
    assert prefixes.reuse_probability(b"p", "a", 4) == pytest.approx(1 - math.exp(-rate / 4 * 8.0))
    assert prefixes.reuse_probability(b"other", "a", 4) == 0.0


def test_a_shared_prefix_is_named_by_the_last_block_of_the_longest_cached_match():
    key = PrefixKey.build(list(range(100)), Scope("m", "t"), 16)
    block = [key.hashes[i * HASH_BYTES : (i + 1) * HASH_BYTES] for i in range(6)]
    matches = (ReplicaMatch("a", 32, "resident", 32, None), ReplicaMatch("b", 80, "resident", 80, None))
    found = LookupResult(100, matches)
    assert shared_prefix(key, found) == block[4]
    assert shared_prefix(key, LookupResult(100, ())) is None
