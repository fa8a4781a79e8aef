"""The modelled engine (kvtransfer/sim) against hand-worked cases, and the fleet study end to end on it.

The modelled engine is for fleet-scale studies only; that its block hashes are vLLM's is checked against a real
engine in tests/test_kv_directory.py (test_real_vllm_engine_events_follow_its_prefix_cache)."""

from __future__ import annotations

import pytest

from actors.kv_events import ResidentTracker
from kvtransfer.prefix_key import PrefixKey, Scope
from kvtransfer.sim.block_cache import PrefixCache, external_block_hash, vllm_block_hashes
from kvtransfer.sim.engine import SimEngine, SimRequest
from kvtransfer.sim.profile import EngineProfile, load_profile

BS = 16


def profile(**overrides) -> EngineProfile:
    """Steps of 10 ms plus 1 ms per decoding request and 0.1 ms per prefill token; 64 tokens per step, two requests."""
    fields = dict(name="hand", description="hand-worked", block_size=BS, kv_bytes_per_token=1000,
                  kv_cache_tokens=BS * 64, max_num_seqs=2, max_num_batched_tokens=64, base_ms=10.0,
                  decode_ms_per_seq=1.0, decode_ms_per_kctx=0.0, prefill_ms_per_token=0.1,
                  prefill_ms_per_ktoken_ctx=0.0, same_node={"fixed_ms": 1.0, "gb_s": 1.0},
                  other_node={"fixed_ms": 2.0, "gb_s": 1.0}, hold_ttl_s=5.0)
    fields.update(overrides)
    return EngineProfile(**fields, sources={k: "test" for k in EngineProfile.model_fields
                                            if k not in ("name", "description", "sources", "measurement",
                                                         "provenance")})


def request(rid: str, prompt: list[int], output: int, **kw) -> SimRequest:
    out = [9000 + i for i in range(output)]
    return SimRequest(rid, prompt, out, vllm_block_hashes(prompt + out, BS), arrival=0.0, **kw)


def run(engine: SimEngine, until: float = 10.0) -> float:
    """Step the engine until it has nothing to do; returns the virtual time."""
    now = 0.0
    while (end := engine.next_step(now)) is not None and end <= until:
        engine.finish_step(end)
        now = end
    return now


def test_continuous_batching_packs_decodes_and_chunked_prefills_into_each_step():
    engine = SimEngine("r0", "n0", profile())
    a, b, c = (request(r, list(range(base, base + 48)), out) for r, base, out in (("a", 0, 3), ("b", 100, 2),
                                                                                   ("c", 200, 1)))
    for r in (a, b, c):
        engine.add(r)
    run(engine)
    # Step 1 (10 + 0.1 x 64 = 16.4 ms): all of a's 48 prompt tokens and b's first 16 (the 64-token budget); c waits
    # for a slot (two requests at most). Step 2 (10 + 1 + 0.1 x 32 = 14.2 ms): a decodes, b finishes its prefill.
    # Step 3 (10 + 2 = 12 ms): both decode; a and b are done and c's prefill runs in step 4 (10 + 4.8 ms).
    assert a.first_token_at == pytest.approx(0.0164)
    assert b.first_token_at == pytest.approx(0.0306)
    assert a.finished_at == pytest.approx(0.0426) and b.finished_at == pytest.approx(0.0426)
    assert c.first_token_at == pytest.approx(0.0426 + 0.0148)
    assert not a.ran_alone and b.prefill_started_at == 0.0


def test_a_busy_peer_slows_decodes_and_prefills_each_by_its_own_measured_factor():
    # 10 ms fixed, 1 ms per decoding request and 2 ms per 1,000 tokens of their context, 0.1 ms per prefill token.
    hand = profile(decode_ms_per_kctx=2.0, contention_per_busy_peer=0.5, decode_contention_per_busy_peer=0.25)
    assert hand.step_ms(2, 3000, []) == pytest.approx(10 + 2 + 6)
    # Beside one busy engine: a decode-only step at the decodes' rate, fixed part included (18 x 1.25);
    assert hand.step_ms(2, 3000, [], busy_peers=1) == pytest.approx(18 * 1.25)
    # a prefill-only step at the prefills' (16.4 x 1.5); a mixed step each part at its own, the fixed part with the
    # prefill (measured with it).
    assert hand.step_ms(0, 0, [(64, 0)], busy_peers=1) == pytest.approx(16.4 * 1.5)
    assert hand.step_ms(2, 3000, [(64, 0)], busy_peers=1) == pytest.approx(16.4 * 1.5 + 8 * 1.25)
    # A profile that measured one factor uses it for both.
    assert profile(contention_per_busy_peer=0.5).step_ms(2, 0, [], busy_peers=1) == pytest.approx(12 * 1.5)


def test_a_prompt_reuses_the_cached_blocks_of_an_earlier_turn():
    engine = SimEngine("r0", "n0", profile())
    first = request("t1", list(range(48)), 1)
    engine.add(first)
    run(engine)
    history = first.token_ids + first.output_ids  # 49 tokens: 3 full blocks cached
    follow_up = request("t2", history + list(range(500, 520)), 1)
    engine.add(follow_up)
    run(engine)
    assert follow_up.reused_tokens == 48
    assert follow_up.computed == follow_up.prompt_len  # and computed only the 21 tokens after them


def test_the_least_recently_freed_blocks_are_evicted_first_and_holds_are_never_evicted():
    # Eight blocks of cache: two finished 3-block prompts fit; a third needs blocks back.
    engine = SimEngine("r0", "n0", profile(kv_cache_tokens=8 * BS, max_num_seqs=1))
    x, y = request("x", list(range(48)), 1), request("y", list(range(1000, 1048)), 1, export_hold=True)
    engine.add(x)
    run(engine)
    engine.add(y)
    run(engine)
    engine.cache.take_events()
    # y's hold pins 4 blocks, x's 3 cached blocks are free, 1 was never used: z's 63 tokens and its first token need
    # 4 blocks, so x's three go, its last block first (vLLM frees a request's blocks tail first).
    z = request("z", list(range(2000, 2063)), 1)
    engine.add(z)
    run(engine)
    removed = [h for e in engine.cache.take_events() if type(e).__name__ == "BlockRemoved" for h in e.block_hashes]
    assert removed == [external_block_hash(h) for h in reversed(x.hashes[:3])]
    assert engine.cache.match(y.hashes[:3]) == 3  # y's hold pins its blocks
    engine.holds["y"].release()
    engine.cache.check_integrity()
    assert engine.cache.available_blocks == 8  # nothing referenced once the hold is gone


def test_a_pulled_request_starts_once_its_kv_has_arrived():
    engine = SimEngine("r0", "n0", profile())
    pulled = request("p", list(range(64)), 1, pulled_tokens=48, kv_ready_at=0.5)
    engine.add(pulled)
    assert engine.next_step(0.0) is None  # nothing to do until the KV is there
    end = engine.next_step(0.5)
    engine.finish_step(end)
    assert pulled.reused_tokens == 48 and pulled.first_token_at == pytest.approx(0.5 + 0.0116)


def test_the_modelled_cache_events_drive_the_real_directory_tracker():
    engine = SimEngine("r0", "n0", profile())
    r = request("t", list(range(40)), 10, cache_salt="tenant-a")
    engine.add(r)
    run(engine)
    tracker = ResidentTracker("m", BS)
    ops = tracker.apply(engine.cache.take_events())
    ours = PrefixKey.build(r.token_ids + r.output_ids, Scope("m", "tenant-a"), BS).block_hashes
    assert [h for op in ops for h in op.hashes] == list(ours[:3])  # 49 tokens with KV: 3 full blocks


def test_a_cache_refuses_what_it_cannot_hold():
    cache = PrefixCache(4, BS)
    assert cache.acquire([], 3)
    assert not cache.acquire([], 2)
    cache.check_integrity()


def test_shipped_profiles_load_with_a_source_for_every_number():
    for name in ("h100-llama-3.1-8b", "h100-llama-3.3-70b-tp4"):
        p = load_profile(name)
        assert p.prefill_ms(8192) > p.prefill_ms(1024) > 0
    with pytest.raises(ValueError, match="no source"):
        EngineProfile(**{**profile().model_dump(), "sources": {}})


def test_a_fleet_of_eight_modelled_replicas_serves_a_multi_turn_workload_with_pulls():
    from benchmarks.fleet_sim import Fleet
    from benchmarks.fleet_workloads import Dist, Workload

    # Long histories (20k-30k tokens: recomputing one takes longer than pulling it), new conversations arriving
    # four a second and a second's thought between turns: some holders are busy with a new conversation's first
    # turn when their conversations' next turns come, and an idle replica pulls the history instead of queueing.
    workload = Workload(conversations=64, turns=Dist(kind="uniform", min=6, max=6), system_prefix_tokens=256,
                        conversation_prefix_tokens=Dist(kind="uniform", min=20000, max=30000),
                        user_tokens=Dist(kind="uniform", min=40, max=60),
                        output_tokens=Dist(kind="uniform", min=100, max=200), arrival="poisson", rate=4.0,
                        think_time_s=Dist(kind="exponential", mean=1.0))
    result = Fleet(load_profile("h100-llama-3.1-8b"), 8, "kvrelay", seed=1).run(workload)
    assert len(result.records) == 64 * 6
    modes = {r.mode for r in result.records}
    assert modes == {"local", "pull", "recompute"} and result.counters["pulls"] > 0
    assert all(r.ttft_ms > 0 for r in result.records)


def test_a_queued_request_counts_as_the_prefill_its_plan_expects_until_the_engine_admits_it():
    # What a router sees of an engine's queue: a follow-up turn planned to reuse 48 of its 69 prompt tokens is 21
    # tokens of prefill, not 69, while it waits; once admitted, what it really has left.
    engine = SimEngine("r0", "n0", profile(max_num_seqs=1))
    engine.add(request("busy", list(range(1000, 1040)), 5))
    engine.finish_step(engine.next_step(0.0))  # "busy" takes the engine's one slot, and decodes from now on
    follow_up = request("t2", list(range(69)), 1, planned_reused=48)
    engine.add(follow_up)
    assert engine.prefill_backlog() == (1, 21)
