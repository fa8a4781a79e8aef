"""The planner and cost model as pure functions: no Ray, no engines."""

from __future__ import annotations

import math

import pytest

from kvtransfer.cost_model import CostModel
from kvtransfer.kv_shape import KVShape
from kvtransfer.load import ReplicaView, preferred_replica, with_busy_peers
from kvtransfer.options import STAY_MARGIN_MS, Mode
from kvtransfer.planner import _options, observe_queues, plan_turn
from kvtransfer.policies.kvrelay import STAY_MARGIN
from kvtransfer.types import Hold, HoldId, HoldOffer, LookupResult, ReplicaMatch
from kvtransfer.typical_wait import TypicalWait
from tests.conftest import make_hold

SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
           "head_dim": 64}


def peer(waiting: int = 0, prefill_tokens: int = 0, arrival_rate: float = 0.0) -> ReplicaView:
    """A busy replica beside the planned one on its node: `waiting` requests before their first tokens, with
    `prefill_tokens` prompt tokens to compute, and `arrival_rate` requests a second sent there."""
    return ReplicaView("peer", running=1, waiting=waiting, prefill_tokens=prefill_tokens, arrival_rate=arrival_rate)


def calibrated(prefill_ms_per_token: float = 0.3, pull_fixed_ms: float = 8.0, gb_s: float = 2.0,
               first_pulls_ms: tuple[float, ...] = ()) -> CostModel:
    """A cost model after a start-up calibration whose first pull between each two engines took `first_pulls_ms`."""
    shape = KVShape.from_hf_config(SMOLLM2, "bfloat16", 32)
    cost = CostModel(shape.kv_bytes)
    for ms in first_pulls_ms:
        cost.observe_pull(64, ms)
    cost.learn_handshake()
    for n in (64, 256, 1024, 2048):
        cost.observe_prefill(n, 0, 5.0 + prefill_ms_per_token * n)
    for n in (256, 1024, 4096):
        cost.observe_pull(n, pull_fixed_ms + shape.kv_bytes(n) / (gb_s * 1e6))
    return cost


def with_five_turn_conversations(cost: CostModel) -> CostModel:
    """`cost` after it has seen a dozen conversations of five turns each (what its workload forecast expects)."""
    for _ in range(12):
        for index in range(5):
            cost.workload.observe_turn(index)
    return cost


def hold(replica: str, tokens: int) -> HoldOffer:
    return HoldOffer(replica, tokens, 1e12, make_hold(tokens, f"e-{replica}"))


def lookup(n: int, *matches: ReplicaMatch) -> LookupResult:
    return LookupResult(n, tuple(matches))


def test_kv_bytes_per_token_matches_smollm2_arithmetic():
    shape = KVShape.from_hf_config(SMOLLM2, "bfloat16", 32)
    assert shape.kv_bytes(1) == 2 * 30 * 3 * 64 * 2 == 23040  # 22.5 KiB, as published


def test_kv_sharing_and_sliding_layers_store_less():
    gemma3n = {"num_hidden_layers": 8, "num_kv_shared_layers": 4, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 64, "hidden_size": 256, "sliding_window": 128,
               "layer_types": ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3
               + ["full_attention"]}
    shape = KVShape.from_hf_config(gemma3n, "float32", 32)
    assert (shape.full_layers, shape.sliding_layers) == (1, 3)  # shared layers own no KV
    per_layer_token = 2 * 2 * 64 * 4
    assert shape.kv_bytes(100) == 4 * 100 * per_layer_token
    # Past the window, sliding layers stop growing.
    assert shape.kv_bytes(4000) == (4000 + 3 * (128 + 32)) * per_layer_token


def test_cost_model_recovers_the_linear_costs_it_observed():
    cost = calibrated(prefill_ms_per_token=0.3, pull_fixed_ms=8.0, gb_s=2.0)
    assert cost.recompute_ms(1000) == pytest.approx(305.0, rel=0.02)
    bytes_4k = KVShape.from_hf_config(SMOLLM2, "bfloat16", 32).kv_bytes(4096)
    assert cost.pull_ms(4096) == pytest.approx(8.0 + bytes_4k / 2e6, rel=0.02)
    assert cost.snapshot()["pull"]["bandwidth_gb_s"] == pytest.approx(2.0, rel=0.02)


def test_short_history_is_recomputed_and_long_history_is_pulled():
    cost = calibrated(prefill_ms_per_token=0.3, pull_fixed_ms=30.0)
    replicas = [ReplicaView("a"), ReplicaView("b", running=0)]
    # The holder "a" is gone from the live set: only b can run the turn.
    live_b = [ReplicaView("b")]
    short = plan_turn(64 + 32, lookup(96, ReplicaMatch("a", 64, "hold", 64, hold("a", 64))), live_b, cost)
    assert short.mode is Mode.RECOMPUTE  # holds of dead replicas are never pulled
    live = replicas
    long_hist = lookup(4096 + 32, ReplicaMatch("a", 4096, "hold", 4096, hold("a", 4096)))
    busy_a = [ReplicaView("a", running=0, waiting=30), ReplicaView("b")]
    plan = plan_turn(4096 + 32, long_hist, busy_a, cost)
    assert plan.mode is Mode.PULL and plan.replica_id == "b" and plan.holder == "a"
    assert plan.reused_tokens == 4096
    assert set(plan.estimates_ms) == {"local", "pull", "recompute"}
    # With an idle holder the local prefix hit is cheapest.
    assert plan_turn(4096 + 32, long_hist, live, cost).mode is Mode.LOCAL


def test_a_turn_stays_with_its_history_unless_moving_clearly_pays():
    cost = calibrated(prefill_ms_per_token=0.3, pull_fixed_ms=8.0)
    n = 1024
    history = lookup(n + 32, ReplicaMatch("a", n, "hold", n, hold("a", n)))
    # One request ahead on the holder: waiting for it costs less than 10% of the turn. Stay.
    slightly_busy = [ReplicaView("a", prefill_tokens=64), ReplicaView("b")]
    plan = plan_turn(n + 32, history, slightly_busy, cost)
    estimates = plan.estimates_ms
    assert estimates["pull"] < estimates["local"] < estimates["pull"] / (1 - STAY_MARGIN) + STAY_MARGIN_MS
    assert (plan.replica_id, plan.mode) == ("a", Mode.LOCAL)
    # A long queue on the holder: pulling to the idle replica is far faster, so the turn moves.
    busy = [ReplicaView("a", prefill_tokens=4000), ReplicaView("b")]
    assert (plan_turn(n + 32, history, busy, cost).replica_id, plan_turn(n + 32, history, busy, cost).mode) == (
        "b", Mode.PULL)


def test_a_lone_conversation_stays_on_its_holder_and_reads_its_whole_hold():
    """The holder's prefix cache has only the full blocks of the history; its own hold also has the last partial
    block. Counting only the cache, pulling everything to the idle neighbour looked faster (here 21 tokens at
    2.7 ms each), and a lone conversation moved on every turn. The holder reads its own hold instead."""
    from kvtransfer.planner import reads_hold

    cost = calibrated(prefill_ms_per_token=2.7, pull_fixed_ms=8.0)
    held, full_blocks = 1013, 992
    history = lookup(held + 40, ReplicaMatch("a", held, "hold", full_blocks, hold("a", held)))
    idle = [ReplicaView("a"), ReplicaView("b")]
    plan = plan_turn(held + 40, history, idle, cost)
    assert (plan.replica_id, plan.mode, plan.reused_tokens, plan.cached_tokens) == ("a", Mode.LOCAL, held, full_blocks)
    assert reads_hold(plan) and plan.hold.replica_id == "a" and not plan.superseded
    assert plan.estimates_ms["local"] < plan.estimates_ms["pull"]
    # A hold that adds nothing to the cache is not read (only released once the turn has run).
    whole = lookup(held + 40, ReplicaMatch("a", held, "hold", held, hold("a", held)))
    plan = plan_turn(held + 40, whole, idle, cost)
    assert plan.mode is Mode.LOCAL and not reads_hold(plan) and plan.superseded == (plan.hold,)


def test_a_busy_holder_reads_its_own_hold_only_when_the_partial_block_outweighs_a_step():
    """Reading a hold costs the reading request an engine step before its prefill; on a busy engine that is a decode
    step of the batch (under a multi-turn load, local turns reading their own hold were a step slower than turns
    from the prefix cache alone). Busy, a short partial block is recomputed; a long one is still read."""
    from kvtransfer.planner import reads_hold

    cost = calibrated(prefill_ms_per_token=2.7, pull_fixed_ms=8.0)
    cost.decode_step_ms = 60.0
    full_blocks = 992
    busy = [ReplicaView("a", running=3), ReplicaView("b", running=3)]
    for partial, read in ((5, False), (31, True)):
        held = full_blocks + partial
        history = lookup(held + 40, ReplicaMatch("a", held, "hold", full_blocks, hold("a", held)))
        plan = plan_turn(held + 40, history, busy, cost)
        assert (plan.replica_id, plan.mode) == ("a", Mode.LOCAL), plan
        assert reads_hold(plan) is read and plan.reused_tokens == (held if read else full_blocks), plan
    # Idle, the step is free: even 5 tokens are worth reading.
    held = full_blocks + 5
    plan = plan_turn(held + 40, lookup(held + 40, ReplicaMatch("a", held, "hold", full_blocks, hold("a", held))),
                     [ReplicaView("a"), ReplicaView("b")], cost)
    assert reads_hold(plan) and plan.reused_tokens == held


def test_crossover_moves_with_the_measured_link_not_a_fixed_threshold():
    fast_link = calibrated(pull_fixed_ms=5.0, gb_s=5.0)
    slow_link = calibrated(pull_fixed_ms=200.0, gb_s=0.05)
    n = 1024
    result = lookup(n + 32, ReplicaMatch("a", n, "hold", 0, hold("a", n)))
    only_b = [ReplicaView("a", waiting=100), ReplicaView("b")]
    assert plan_turn(n + 32, result, only_b, fast_link).mode is Mode.PULL
    assert plan_turn(n + 32, result, only_b, slow_link).mode is Mode.RECOMPUTE


def test_at_least_one_prompt_token_is_computed():
    cost = calibrated()
    result = lookup(100, ReplicaMatch("a", 100, "resident", 100, None))
    plan = plan_turn(100, result, [ReplicaView("a")], cost)
    assert plan.reused_tokens == 99


def test_session_hint_breaks_ties_and_moves_minimally():
    ids = ["r1", "r2", "r3"]
    owner = preferred_replica("conversation-7", ids)
    assert owner in ids and preferred_replica("conversation-7", ids) == owner
    survivors = [r for r in ids if r != owner]
    others = [s for s in (f"c{i}" for i in range(50)) if preferred_replica(s, ids) != owner]
    assert all(preferred_replica(s, survivors) == preferred_replica(s, ids) for s in others)
    cost = calibrated()
    empty = lookup(50)
    views = [ReplicaView(r) for r in ids]
    assert plan_turn(50, empty, views, cost, preferred_replica=owner).replica_id == owner


def test_hold_params_are_rewritten_for_a_pull_and_for_a_release():
    exported = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
                "remote_engine_id": "e", "remote_host": "127.0.0.1", "remote_port": 5600,
                "remote_num_tokens": 40, "remote_request_id": "x", "remote_blocks_expiry_time": None, "tp_size": 1}
    hold = Hold.from_params(exported, HoldId("e", 3))
    assert hold is not None and (hold.engine_id, hold.num_tokens, hold.hold_id) == ("e", 40, HoldId("e", 3))
    pull = hold.pull_params()
    assert (pull["do_remote_prefill"], pull["do_remote_decode"]) == (False, True)
    assert {k: v for k, v in pull.items() if not k.startswith("do_")} == {
        k: v for k, v in exported.items() if not k.startswith("do_")}
    assert hold.release_params()["do_remote_prefill"] is True
    assert Hold.from_params({"do_remote_decode": True}, HoldId("e", 4)) is None


def test_a_pull_onto_a_replica_that_caches_most_of_the_history_must_beat_its_cache_by_the_margin():
    # P/D's shape: "p" caches the history but the last reply (its prefix cache), "d" holds all of it; turns run on
    # "p" only. Pulling the reply saves computing it, minus the pull's fixed cost.
    cost = calibrated(prefill_ms_per_token=0.3, pull_fixed_ms=8.0)
    n, history = 1344, 1296
    for reply in (32, 400):
        cached = history - reply
        found = lookup(n, ReplicaMatch("p", cached, "resident", cached, None),
                       ReplicaMatch("d", history, "hold", history, hold("d", history)))
        views = [ReplicaView("p"), ReplicaView("d")]
        plan = plan_turn(n, found, views, cost, targets={"p"})
        local, pull = plan.estimates_ms["local"], plan.estimates_ms["pull"]
        assert pull < local  # by the estimates alone the pull always wins
        if reply == 32:  # ...by a few ms (its fixed cost eats most of the 32 tokens' compute): not worth it
            assert local - pull < local * STAY_MARGIN + STAY_MARGIN_MS and plan.mode is Mode.LOCAL
        else:  # 400 tokens' compute is worth a pull
            assert plan.mode is Mode.PULL and (plan.holder, plan.reused_tokens) == ("d", history)


def test_baseline_policies_place_turns_by_their_own_rules():
    cost = calibrated()
    views = [ReplicaView("a"), ReplicaView("b", waiting=1), ReplicaView("c")]
    held = lookup(1000, ReplicaMatch("a", 960, "hold", 960, hold("a", 960)),
                  ReplicaMatch("c", 64, "resident", 64, None))
    # Round robin walks the replicas in turn and never pulls; each target uses its own prefix cache.
    rr = [plan_turn(1000, held, views, cost, policy="round_robin", rotation=i) for i in range(3)]
    assert [p.replica_id for p in rr] == ["a", "b", "c"]
    assert [p.mode for p in rr] == [Mode.LOCAL, Mode.RECOMPUTE, Mode.LOCAL]
    # Session affinity: the session's replica, whatever it holds.
    session = plan_turn(1000, held, views, cost, preferred_replica="b", policy="session")
    assert (session.replica_id, session.mode) == ("b", Mode.RECOMPUTE)
    # Prefix affinity: the longest holder; with nothing held anywhere, the least loaded replica.
    assert plan_turn(1000, held, views, cost, policy="prefix_affinity").replica_id == "a"
    nothing = plan_turn(1000, lookup(1000), [ReplicaView("a", running=2), ReplicaView("b")], cost,
                        policy="prefix_affinity")
    assert nothing.replica_id == "b"
    # vLLM's fixed threshold: off the holder, pull whenever the hold adds 64 tokens or more.
    fixed = plan_turn(1000, held, views, cost, policy="fixed_threshold", rotation=1)
    assert (fixed.replica_id, fixed.mode, fixed.holder) == ("b", Mode.PULL, "a")
    short = lookup(100, ReplicaMatch("a", 40, "hold", 32, hold("a", 40)))
    assert plan_turn(100, short, views, cost, policy="fixed_threshold", rotation=1).mode is Mode.RECOMPUTE
    # Every plan still carries every estimate, so a benchmark can show what the choice cost.
    assert set(fixed.estimates_ms) == {"local", "pull", "recompute"} and fixed.reason.startswith("fixed_threshold")


def test_busy_engines_on_the_same_node_slow_a_target_by_the_measured_factor():
    cost = calibrated(prefill_ms_per_token=0.3)
    solo = cost.recompute_ms(1000)
    for n in (200, 500, 1000):  # turns that had their engine to themselves while one peer was busy
        cost.observe_prefill(n, 0, 1.5 * cost.recompute_ms(n), busy_peers=1)
    assert cost.slowdown(1) == pytest.approx(1.5, rel=0.01)
    assert cost.recompute_ms(1000, busy_peers=1) == pytest.approx(1.5 * solo, rel=0.01)
    assert cost.recompute_ms(1000) == pytest.approx(solo)  # the solo fit learned nothing from them
    # A new conversation: "b" is idle but shares a node with busy "a"; "c" is idle on another node.
    views = [ReplicaView("a", running=1), ReplicaView("b", peers=(peer(),)), ReplicaView("c")]
    assert plan_turn(1000, lookup(1000), views, cost).replica_id == "c"
    # With nowhere else to go, staying beside the busy engine's queue beats paying the slowdown on "b".
    plan = plan_turn(1000, lookup(1000), views[:2], cost)
    assert plan.replica_id == "a" and plan.busy_peers == 0


def test_each_node_learns_its_own_contention():
    cost = calibrated(prefill_ms_per_token=0.3)
    cost.set_nodes({"a": "node-1", "b": "node-1", "c": "node-2", "d": "node-2", "e": "node-3"})
    for n in (200, 400, 600, 800):  # node-1's engines share cores: twice as slow beside a busy peer
        cost.observe_prefill(n, 0, 2.0 * cost.recompute_ms(n), busy_peers=1, replica_id="a")
    for n in (200, 400, 600, 800):  # node-2 has cores to spare: 10% slower
        cost.observe_prefill(n, 0, 1.1 * cost.recompute_ms(n), busy_peers=1, replica_id="c")
    assert cost.slowdown(1, "b") == pytest.approx(2.0, rel=0.01)
    assert cost.slowdown(1, "d") == pytest.approx(1.1, rel=0.01)
    # A node with no samples of its own is priced by the fleet's fit (both nodes' samples).
    assert 1.1 < cost.slowdown(1, "e") < 2.0
    assert cost.contention_impact_ms(100, 1, "b") == pytest.approx(100, rel=0.01)
    assert cost.contention_impact_ms(100, 1, "d") == pytest.approx(10, rel=0.05)
    assert set(cost.snapshot()["contention_by_node"]) == {"node-1", "node-2"}


def test_a_prefill_beside_a_peer_busy_for_part_of_it_teaches_the_whole_slowdown():
    truth = calibrated(prefill_ms_per_token=0.3)
    cost = calibrated(prefill_ms_per_token=0.3)
    # Beside a fully busy peer a prefill takes 1.3x as long; most contended turns overlap their peer's work only in
    # part, and slow down by that part of 0.3.
    for share in (1.0, 0.5, 0.25, 0.75):
        for n in (200, 400, 600, 800):
            cost.observe_prefill(n, 0, (1 + 0.3 * share) * truth.recompute_ms(n), busy_peers=share, replica_id="a")
    assert cost.slowdown(1) == pytest.approx(1.3, rel=0.01)
    # A peer busy for a few percent of a prefill leaves a solo sample: it teaches the fit, not the slowdown.
    samples = len(cost.contention.samples)
    cost.observe_prefill(500, 0, truth.recompute_ms(500), busy_peers=0.05, replica_id="a")
    assert len(cost.contention.samples) == samples


def test_the_peers_busy_during_a_prefill_count_for_their_share_of_it():
    from actors.replica_api import ReplicaStats
    from app.feedback import Feedback
    from app.inflight import InFlight

    def stats(replica_id: str, node_id: str) -> ReplicaStats:
        return ReplicaStats(replica_id=replica_id, node_id=node_id, running=0, waiting=0, kv_cache_usage=0.0,
                            prefix_cache_hit_rate=0.0, prefill_tok_s=None, decode_tok_s=None, requests_finished=0)

    class Directory:
        def live(self) -> list[ReplicaStats]:
            return [stats("a", "n1"), stats("b", "n1"), stats("c", "n1"), stats("d", "n2")]

    now = [100.0]
    inflight = InFlight(clock=lambda: now[0])
    feedback = Feedback(calibrated(), inflight, Directory().live)
    inflight.started("b", "b1", 0)  # busy before the turn is sent, done 50 ms into its 200
    inflight.started("d", "d1", 0)  # busy throughout, but on another node: shares no cores with "a"
    now[0] = 100.05
    inflight.ended("b", "b1")
    now[0] = 100.1
    inflight.started("c", "c1", 0)  # starts halfway, with two overlapping requests
    inflight.started("c", "c2", 0)
    now[0] = 100.15
    inflight.ended("c", "c1")
    assert inflight.busy_share("b", 100.0, 100.2) == pytest.approx(0.25)
    now[0] = 100.2
    assert inflight.busy_share("c", 100.0, 100.2) == pytest.approx(0.5)
    assert feedback.busy_peers_since("a", 100.0) == pytest.approx(0.75)
    assert inflight.busy_share("b", 100.1, 100.2) == 0.0


def test_heartbeats_are_reconciled_with_what_the_ingress_sent_since():
    from actors.replica_api import ReplicaStats
    from app.inflight import InFlight

    now = [100.0]
    inflight = InFlight(clock=lambda: now[0])

    def heartbeat(at: float, running: int) -> ReplicaStats:
        return ReplicaStats(replica_id="a", at=at, running=running, waiting=0, kv_cache_usage=0.0,
                            prefix_cache_hit_rate=0.0, prefill_tok_s=None, decode_tok_s=None, requests_finished=0)

    inflight.started("a", "r1", 500)
    now[0] = 100.2
    beat = heartbeat(at=100.1, running=2)  # r1 and one request of another ingress
    view = inflight.views([beat])[0]
    assert (view.running, view.prefill_tokens) == (1, 500)  # the other ingress's, plus r1 still prefilling
    inflight.first_token("a", "r1")
    now[0] = 100.3
    inflight.ended("a", "r1")
    # The same (stale) heartbeat still counts r1: it ended since, so only the other request remains.
    assert inflight.views([beat])[0].running == 1
    inflight.started("a", "r2", 40)  # sent after the heartbeat: not in it, known here
    view = inflight.views([beat])[0]
    assert (view.running, view.prefill_tokens) == (1, 40)
    # A request whose replica Serve chose (a P/D decode stage: accounted under none) counts, once it answers,
    # where it ran: the next heartbeat's count of it is then known to be this ingress's, and its end is seen.
    inflight.started("", "r3", 0)
    inflight.moved("", "a", "r3")
    now[0] = 100.5
    inflight.ended("a", "r3")
    later = heartbeat(at=100.45, running=2)  # r2 and r3; the other ingress's request has ended
    view = inflight.views([later])[0]
    assert (view.running, view.prefill_tokens) == (0, 40)  # r3 ended: no phantom load left behind


def test_a_busy_engines_queue_is_what_its_prefills_have_left():
    """A prefill in flight is partly done: the queue a new turn finds is the known prefills less what the engine has
    computed of them since it started the oldest (when it was sent, or when the prefill before it gave its first
    token). Counted whole, a first turn's prefill nearly done made its engine look a whole prefill away, and the
    planner started the idle engine beside it, on two shared cores slower for every turn after."""
    from actors.replica_api import ReplicaStats
    from app.inflight import InFlight

    now = [100.0]
    inflight = InFlight(clock=lambda: now[0])
    beat = ReplicaStats(replica_id="a", at=99.0, running=0, waiting=0, kv_cache_usage=0.0, prefix_cache_hit_rate=0.0,
                        prefill_tok_s=None, decode_tok_s=None, requests_finished=0)
    cost = calibrated(prefill_ms_per_token=0.3)
    whole = cost.queued_prefill_ms(1000, 1)  # about 305 ms
    inflight.started("a", "first", 1000)
    now[0] = 100.2
    view = inflight.views([beat])[0]
    assert (view.prefill_tokens, view.prefill_elapsed_ms) == (1000, pytest.approx(200.0))
    assert cost.queue_ms(view) == pytest.approx(whole - 200.0)
    # A second turn sent meanwhile waits behind the first: the engine starts it once the first gives its first token.
    inflight.started("a", "second", 1000)
    now[0] = 100.4
    inflight.first_token("a", "first")
    now[0] = 100.45
    view = inflight.views([beat])[0]
    assert (view.prefill_tokens, view.prefill_elapsed_ms) == (1000, pytest.approx(50.0))
    step = cost.decode_step_ms  # the first one decodes now: a new prefill also waits a step of it
    assert cost.queue_ms(view) == pytest.approx(whole - 50.0 + step)
    # Longer than the estimate: no prefill is left to wait for, whatever the estimate said.
    now[0] = 101.5
    assert cost.queue_ms(inflight.views([beat])[0]) == pytest.approx(step)
    # Where a view counts only what is left (the fleet study's engines), nothing is taken off.
    assert cost.queue_ms(ReplicaView("a", prefill_tokens=1000, prefilling=1)) == pytest.approx(whole)


def test_the_planner_corrects_for_its_own_measured_error():
    cost = calibrated(prefill_ms_per_token=0.3)
    # A new 1000-token conversation: "a" is busy decoding, "b" idle beside it (so b's engine has a busy peer).
    replicas = [ReplicaView("a", running=2, decode_tok_s=50.0), ReplicaView("b", peers=(peer(),))]
    first = plan_turn(1000, lookup(1000), replicas, cost)
    assert first.replica_id == "b"  # by the fits alone the idle replica looks faster
    assert first.model_ms == first.estimate_ms  # nothing measured yet: no correction
    # Turns run beside a busy engine keep taking 700 ms longer than estimated (more than a's two decoding requests
    # would lose to the prefill); turns alone on the node 10 ms longer (a fixed overhead every option pays), on the
    # busy engine as on an idle one.
    for _ in range(cost.error.MIN_SAMPLES):
        cost.error.observe(Mode.RECOMPUTE, 1, 100.0, 800.0)
        cost.error.observe(Mode.RECOMPUTE, 0, 100.0, 110.0)
        cost.error.observe(Mode.RECOMPUTE, 0, 100.0, 110.0, busy_target=True)
    corrected = plan_turn(1000, lookup(1000), replicas, cost)
    assert corrected.replica_id == "a"
    assert corrected.estimates_ms["recompute"] == pytest.approx(corrected.model_ms + 10.0, abs=0.01)
    assert cost.snapshot()["estimate_error"]["recompute_busy_node"] == {"offset_ms": 700.0, "uncertainty_ms": 0.0,
                                                                       "samples": 8}


def test_an_option_without_its_own_error_samples_pays_the_overhead_measured_for_all():
    cost = calibrated(prefill_ms_per_token=0.3)
    for _ in range(cost.error.MIN_SAMPLES):
        cost.error.observe(Mode.LOCAL, 0, 20.0, 35.0)  # every local turn took 15 ms more than its estimate
    # A kind never measured is not made cheaper than the measured ones by the overhead they were charged.
    assert cost.error.offset_ms(Mode.PULL, 1) == cost.error.offset_ms(Mode.LOCAL, 0) == 15.0
    assert cost.error.corrected(Mode.RECOMPUTE, 0, 4.0) == 19.0
    assert cost.error.corrected(Mode.LOCAL, 0, 100.0) == 115.0


def contended(slowdown_per_busy_peer: float) -> CostModel:
    """A calibrated model that has measured turns running `1 + slowdown_per_busy_peer` times slower beside one
    busy engine on their node."""
    cost = calibrated(prefill_ms_per_token=0.3)
    for n in (200, 500, 1000):
        cost.observe_prefill(n, 0, (1 + slowdown_per_busy_peer) * cost.recompute_ms(n), busy_peers=1)
    return cost


def test_an_idle_engine_beside_busy_ones_pays_for_the_first_tokens_it_would_delay():
    # "a" decodes three requests while four more wait for their first tokens (300 prompt tokens in all), and gets 2
    # requests a second; "b" is idle on the same node.
    views = [ReplicaView("a", running=3, prefill_tokens=300, prefilling=4, arrival_rate=2.0),
             ReplicaView("b", peers=(peer(4, 300, 2.0),))]
    turn = dict(num_tokens=200, lookup=lookup(200), replicas=views, output_tokens=32)
    # Where engines do not slow each other (nothing measured), the idle engine's first token comes sooner.
    independent = plan_turn(**turn, cost=calibrated(prefill_ms_per_token=0.3))
    assert independent.replica_id == "b" and independent.impact_ms == 0.0
    # Where they slow each other by half, starting on "b" would delay a's four waiting first tokens (by half of its
    # 95 ms backlog each) and those of the requests arriving there meanwhile: the turn joins "a", though its own
    # first token comes later there.
    cost = contended(0.5)
    joined = plan_turn(**turn, cost=cost)
    assert joined.replica_id == "a" and joined.estimate_ms > joined.estimates_ms["recompute"]
    # Joining "a" has its price too: requests arriving there (2 a second) wait for its 65 ms prefill.
    assert joined.impact_ms == pytest.approx(2.0 / 1e3 * cost.recompute_ms(200) ** 2 / 2, rel=0.01)
    # Behind a long backlog on "a", the idle engine is worth the slowdown, and the plan says what it costs: a's
    # four waiting requests are slowed for as long as the turn keeps "b" busy (its prefill, then its decode), and
    # those arriving meanwhile for half of that on average.
    queued = [views[0]._replace(prefill_tokens=8000), views[1]._replace(peers=(peer(4, 8000, 2.0),))]
    moved = plan_turn(200, lookup(200), queued, cost, output_tokens=32)
    occupancy = moved.estimate_ms + 32 * cost.decode_step_ms
    assert moved.replica_id == "b" and moved.impact_ms == pytest.approx(
        0.5 * 4 * occupancy + 0.5 * (2.0 / 1e3 * occupancy) * occupancy / 2, rel=0.01)
    assert "delaying others' first tokens" in moved.reason
    # Where engines slow each other less (10%), a long prefill would hold "a" for a second while everything
    # arriving there waited for it: the idle engine is worth its contention.
    assert plan_turn(3000, lookup(3000), views, contended(0.1), output_tokens=32).replica_id == "b"


def test_requests_that_only_decode_beside_an_idle_engine_cost_it_only_the_first_tokens_arriving_there():
    # "a" decodes three requests, none waits for a first token: the idle "b" slows their replies, not their first
    # tokens. With requests arriving at "a" now and then (one every 4 s), a turn faster on "b" goes there.
    cost = contended(0.1)
    sparse = [ReplicaView("a", running=3, arrival_rate=0.25),
              ReplicaView("b", peers=(peer(0, 0, 0.25),))]
    plan = plan_turn(200, lookup(200), sparse, cost, output_tokens=32)
    occupancy = plan.estimate_ms + 32 * cost.decode_step_ms
    assert plan.replica_id == "b" and plan.estimate_ms == pytest.approx(1.1 * cost.recompute_ms(200), rel=0.01)
    assert plan.impact_ms == pytest.approx(0.1 * (0.25 / 1e3 * occupancy) * occupancy / 2, rel=0.01)
    # With 8 requests a second arriving at "a", every one of them would get its first token later while "b" works:
    # the turn joins "a" (a saturated node serves more on one engine than on two that slow each other).
    busy = [ReplicaView("a", running=3, arrival_rate=8.0),
            ReplicaView("b", peers=(peer(0, 0, 8.0),))]
    assert plan_turn(200, lookup(200), busy, cost, output_tokens=32).replica_id == "a"


def test_a_turn_on_an_idle_engine_is_priced_for_the_turns_its_conversation_will_bring_there():
    # "a" decodes three requests, one more waits for its first 300 tokens, and 2 requests a second arrive there; "b"
    # is idle on the same node, and engines there slow each other by 10%.
    views = [ReplicaView("a", running=3, prefill_tokens=300, prefilling=1, arrival_rate=2.0),
             ReplicaView("b", peers=(peer(1, 300, 2.0),))]
    one_shot, conversations = contended(0.1), contended(0.1)
    for _ in range(12):
        for first in range(5):  # conversations of five turns: four of five turns continue one
            conversations.workload.observe_turn(first)
            one_shot.workload.observe_turn(0)
    assert one_shot.workload.expected_future_turns() == 0.0
    assert conversations.workload.expected_future_turns() == pytest.approx(4.0, rel=0.05)
    # Knowing the turn's place in its conversation: a first turn brings four more, a third two, a last none.
    assert [conversations.workload.expected_future_turns(i) for i in (0, 2, 4)] == [4.0, 2.0, 0.0]
    assert one_shot.workload.expected_future_turns(0) == 0.0
    # One-shot requests: the turn's own occupancy of "b" is all it costs "a"; its first token comes sooner on "b".
    alone = plan_turn(600, lookup(600), views, one_shot, output_tokens=24)
    assert alone.replica_id == "b"
    # A conversation's first turn on "b" keeps "b" decoding beside "a" for four more turns, each slowing the
    # requests arriving at "a" meanwhile; on "a" its later turns join a batch the engine steps anyway: it joins "a".
    founded = plan_turn(600, lookup(600), views, conversations, output_tokens=24)
    decode = 24 * conversations.decode_step_ms
    assert founded.replica_id == "a"
    on_b = next(o for o in _options(600, lookup(600), views, conversations, output_tokens=24) if o.replica_id == "b")
    future = conversations.workload.expected_future_turns()
    assert on_b.impact_ms == pytest.approx(alone.impact_ms + 0.1 * (future * 2.0 / 1e3 * decode) * decode / 2, rel=0.02)


def test_a_plan_reads_each_nodes_busy_engines_once_and_prices_impact_as_their_sum(monkeypatch):
    # 32 replicas on one node, every other one busy with prefills queued of different lengths; four of them hold
    # the prompt, so each idle target has up to five options, each priced against the 16 busy engines.
    cost = contended(0.1)
    for _ in range(4):
        for index in range(3):
            cost.workload.observe_turn(index)
    views = with_busy_peers(
        [ReplicaView(f"r{i}", running=1, waiting=i % 3, prefill_tokens=(i % 5) * 400, prefilling=i % 2,
                     arrival_rate=0.1 * i) if i % 2 else ReplicaView(f"r{i}") for i in range(32)],
        {f"r{i}": "n" for i in range(32)})
    matches = [ReplicaMatch(r, n, "hold", 0, hold(r, n)) for r, n in (("r1", 900), ("r4", 700), ("r7", 500))]
    calls = []
    queued_prefill_ms = cost.queued_prefill_ms
    monkeypatch.setattr(cost, "queued_prefill_ms", lambda *a, **k: calls.append(a) or queued_prefill_ms(*a, **k))
    options = _options(1000, lookup(1000, *matches), views, cost, output_tokens=24, turn_index=0)
    # Once per replica for its own queue, and once per busy engine for the idle targets beside it: not per option.
    assert len(calls) <= 32 + 16 < len(options)
    # Each idle option's impact is still the sum over the busy engines beside it (`CostModel.contention_impact_ms`).
    later, future = 24 * cost.decode_step_ms, cost.workload.expected_future_turns(0)
    busy = [v._replace(peers=()) for v in views if not v.idle]
    assert future > 0 and len(options) > 64
    for o in options:
        target = next(v for v in views if v.replica_id == o.replica_id)
        stays = sum(cost.contention_impact_ms(later / 2, future * p.arrival_rate / 1e3 * later, o.replica_id)
                    for p in target.peers)
        if not target.idle:
            assert target.peers == tuple(p for p in busy if p.replica_id != o.replica_id)
            continue
        assert target.peers == tuple(busy)
        # Its occupancy of the target: the prefill of what it does not reuse, then its decode.
        occupancy = cost.recompute_ms(1000 - o.reused_tokens, o.reused_tokens, 16, o.replica_id) + later
        expected = stays + sum(
            cost.contention_impact_ms(min(occupancy, queued_prefill_ms(p.prefill_tokens, p.awaiting_first_token)),
                                      p.awaiting_first_token, o.replica_id)
            + cost.contention_impact_ms(occupancy / 2, p.arrival_rate / 1e3 * occupancy, o.replica_id)
            for p in target.peers)
        assert o.impact_ms == pytest.approx(expected, rel=1e-9)


def test_a_conversation_on_an_idle_engine_is_pulled_to_the_busy_one_when_it_would_delay_its_first_tokens():
    n = 1024
    history = lookup(n + 64, ReplicaMatch("b", n, "hold", n, hold("b", n)))
    # "a" has four requests waiting for their first tokens; engines that slow each other by half.
    views = [ReplicaView("a", running=3, prefill_tokens=300, prefilling=4),
             ReplicaView("b", peers=(peer(4, 300),))]
    consolidated = plan_turn(n + 64, history, views, contended(0.5), output_tokens=32)
    assert (consolidated.replica_id, consolidated.mode, consolidated.holder) == ("a", Mode.PULL, "b")
    # When "a" only decodes and nothing arrives there, nobody's first token waits on it: the turn stays with its
    # history.
    decoding = [ReplicaView("a", running=3), ReplicaView("b", peers=(peer(),))]
    stays = plan_turn(n + 64, history, decoding, contended(0.5), output_tokens=32)
    assert (stays.replica_id, stays.mode) == ("b", Mode.LOCAL)
    # Engines that do not slow each other: the turn stays with its history.
    independent = plan_turn(n + 64, history, views, calibrated(prefill_ms_per_token=0.3), output_tokens=32)
    assert (independent.replica_id, independent.mode) == ("b", Mode.LOCAL)


def test_of_two_busy_engines_the_one_with_less_traffic_drains_into_the_other():
    n = 1024
    cost = contended(0.1)
    for _ in range(12):
        for first in range(5):  # conversations of five turns
            cost.workload.observe_turn(first)
    on_b = lookup(n + 64, ReplicaMatch("b", n, "hold", n, hold("b", n)))
    # Both engines decode: "a" four conversations' turns (2 requests a second arrive there), "b" one other
    # conversation's (0.5 a second). A conversation living on "b" keeps "b" decoding beside "a" for its four more
    # turns, slowing a's arrivals each time; on "a" its turns slow b's fewer arrivals: it moves to "a", pulling its
    # history, though this turn's own first token comes a little later there. So "b" drains.
    views = [ReplicaView("a", running=4, arrival_rate=2.0, peers=(peer(0, 0, 0.5),)),
             ReplicaView("b", running=1, arrival_rate=0.5, peers=(peer(0, 0, 2.0),))]
    moved = plan_turn(n + 64, on_b, views, cost, output_tokens=24)
    assert (moved.replica_id, moved.mode, moved.holder) == ("a", Mode.PULL, "b")
    assert moved.estimate_ms > moved.estimates_ms["local"]
    stay = next(o for o in _options(n + 64, on_b, views, cost, output_tokens=24) if o.mode is Mode.LOCAL)
    decode = 24 * cost.decode_step_ms
    assert stay.impact_ms == pytest.approx(
        0.5 / 1e3 * stay.model_ms**2 / 2 + 0.1 * (4.0 * 2.0 / 1e3 * decode) * decode / 2, rel=0.05)
    # A conversation on the busier engine stays there.
    on_a = lookup(n + 64, ReplicaMatch("a", n, "hold", n, hold("a", n)))
    assert (plan_turn(n + 64, on_a, views, cost, output_tokens=24).replica_id,) == ("a",)
    # With the same traffic on both, moving saves nothing: the turn stays with its history (no ping-pong).
    even = [views[0]._replace(arrival_rate=1.0, peers=(peer(0, 0, 1.0),)),
            views[1]._replace(running=4, arrival_rate=1.0, peers=(peer(0, 0, 1.0),))]
    stays = plan_turn(n + 64, on_b, even, cost, output_tokens=24)
    assert (stays.replica_id, stays.mode) == ("b", Mode.LOCAL)


def test_two_engines_holding_two_conversations_each_drain_one_into_the_other():
    from actors.replica_api import ReplicaStats
    from app.inflight import InFlight
    from kvtransfer.load import with_busy_peers
    from kvtransfer.prefix_key import PrefixKey, Scope

    n = 1024
    # Prefills 1.3x slower beside a busy engine, a 58 ms decode step: today's quick multi-turn workload measured
    # 0.28 and 58.4 (a run committed in 91af383, its `cost_model`).
    cost = contended(0.3)
    cost.decode_step_ms = 58.0
    for _ in range(12):
        for index in range(6):  # conversations of six turns
            cost.workload.observe_turn(index)
    scope = Scope("m", "")

    def prompt(conversation: int, turn: int) -> PrefixKey:  # each turn's prompt starts with the previous one's
        return PrefixKey.build([1 + conversation] * (n + 64 * turn), scope, 16)

    # The last ten seconds: conversations 0 and 1 ran two turns each on "a", 2 and 3 two each on "b". Each engine
    # is decoding one of them now, and has had the same traffic.
    now = [100.0]
    inflight = InFlight(clock=lambda: now[0])
    for turn in range(2):
        for conversation, replica in enumerate("aabb"):
            key = prompt(conversation, turn)
            inflight.started(replica, f"{conversation}-{turn}", 64, key.prompt_end(key.num_tokens))
            now[0] += 1.0
    for conversation, replica in enumerate("aabb"):
        if conversation % 2:
            inflight.ended(replica, f"{conversation}-1")

    def stats(replica_id: str) -> ReplicaStats:
        return ReplicaStats(replica_id=replica_id, node_id="n1", running=0, waiting=0, kv_cache_usage=0.0,
                            prefix_cache_hit_rate=0.0, prefill_tok_s=None, decode_tok_s=None, requests_finished=0)

    # Conversation 3's next turn, its history on "b". Staying keeps "b" busy beside "a" for its later turns, slowing
    # the two conversations that arrive at "a"; moving to "a" slows only conversation 2, which stays on "b": its own
    # turns on "b" are not traffic it would slow there. So it pulls its history to "a" ...
    on_b = lookup(n + 128, ReplicaMatch("b", n + 64, "hold", n + 64, hold("b", n + 64)))
    views_before_move = with_busy_peers(inflight.views([stats(r) for r in "ab"], prompt(3, 2)), {"a": "n1", "b": "n1"})
    assert [v.arrival_rate for v in views_before_move] == [pytest.approx(0.4), pytest.approx(0.2)]
    moved = plan_turn(n + 128, on_b, views_before_move, cost, output_tokens=24, turn_index=2)
    assert (moved.replica_id, moved.mode, moved.holder) == ("a", Mode.PULL, "b")
    # ... where, counted with its own, the two engines' traffic looked the same and it stayed beside "a".
    counted_with_own = with_busy_peers(inflight.views([stats(r) for r in "ab"]), {"a": "n1", "b": "n1"})
    stays = plan_turn(n + 128, on_b, counted_with_own, cost, output_tokens=24, turn_index=2)
    assert (stays.replica_id, stays.mode) == ("b", Mode.LOCAL)
    # Were it its last turn (the sixth: recent conversations brought none after it), it would stay on "b": moving
    # buys nothing for turns that will not come.
    last = plan_turn(n + 128, on_b, views_before_move, cost, output_tokens=24, turn_index=5)
    assert (last.replica_id, last.mode) == ("b", Mode.LOCAL)
    # Its next turn stays on "a" (no ping-pong): going back would slow a's two other conversations.
    key = prompt(3, 2)
    inflight.started("a", "3-2", 64, key.prompt_end(key.num_tokens))
    now[0] += 1.0
    inflight.ended("a", "3-2")
    on_a = lookup(n + 192, ReplicaMatch("a", n + 128, "hold", n + 128, hold("a", n + 128)))
    views = with_busy_peers(inflight.views([stats(r) for r in "ab"], prompt(3, 3)), {"a": "n1", "b": "n1"})
    assert (plan_turn(n + 192, on_a, views, cost, output_tokens=24, turn_index=3).replica_id,) == ("a",)


def test_prompts_queued_on_a_replica_are_priced_as_separate_prompts_prefilled_together():
    cost = CostModel(KVShape.from_hf_config(SMOLLM2, "bfloat16", 32).kv_bytes)
    for n in (256, 512, 1024, 2048, 4096):
        for context in (0, 1024):  # 40 ms fixed, 0.5 ms a token, attention 0.1 ms per token and 1k tokens before it
            cost.observe_prefill(n, context, 40 + 0.5 * n + 0.1 * n * (context + n / 2) / 1e3)
    # Eight 1k-token prompts wait on the replica: every token's cost, attention within each prompt, the fixed cost
    # once (vLLM prefills them in the same steps). As one 8k-token prompt, attention over all of them would add
    # 2.8 s that no step spends.
    queued = ReplicaView("a", prefill_tokens=8000, prefilling=8)
    assert cost.queue_ms(queued) == pytest.approx(40 + 0.5 * 8000 + 8 * 0.1 * 1000 * 500 / 1e3, rel=0.01)
    assert cost.recompute_ms(8000) == pytest.approx(40 + 0.5 * 8000 + 0.1 * 8000 * 4000 / 1e3, rel=0.01)
    # One queued prompt is just its own prefill.
    assert cost.queue_ms(ReplicaView("a", prefill_tokens=1000, prefilling=1)) == pytest.approx(
        cost.recompute_ms(1000))


def test_busy_peers_are_the_busy_engines_on_the_same_node_only():
    from kvtransfer.load import with_busy_peers

    views = [ReplicaView("a", running=2, prefill_tokens=10, prefilling=1, arrival_rate=1.5), ReplicaView("b"),
             ReplicaView("c", running=1), ReplicaView("d", running=4)]
    out = {v.replica_id: v for v in with_busy_peers(views, {"a": "n1", "b": "n1", "c": "n2", "d": "n1"})}
    # "b" sees two busy engines beside it: a's waiting request and arrivals, d's decoding batch.
    assert (out["b"].busy_peers, out["b"].peers) == (2, (views[0], views[3]))
    assert out["b"].peers[0].awaiting_first_token == 1
    assert (out["a"].busy_peers, out["a"].peers) == (1, (views[3],))
    assert (out["c"].busy_peers, out["c"].peers) == (0, ())


def test_a_turn_is_expected_to_decode_what_recent_turns_did_within_its_limit():
    cost = calibrated()
    assert cost.workload.expected_output_tokens(256) == 256  # nothing measured: the limit
    for _ in range(50):
        cost.workload.observe_output(20)
    assert cost.workload.expected_output_tokens(256) == 20
    assert cost.workload.expected_output_tokens(8) == 8


def test_a_first_pull_between_two_replicas_pays_the_measured_handshake():
    # At start-up the first pull of each pair took about half a second; the link's fit learned from the rest.
    cost = calibrated(prefill_ms_per_token=0.3, first_pulls_ms=(450.0, 550.0))
    assert cost.handshake_ms == 500.0 and cost.pull.coef[0] == pytest.approx(8.0, rel=0.05)
    n = 2048
    history = lookup(n + 32, ReplicaMatch("a", n, "hold", n, hold("a", n)))
    # The holder has one request's prefill queued: pulling to the idle "b" saves about 300 ms...
    views = [ReplicaView("a", prefill_tokens=1000), ReplicaView("b")]
    assert plan_turn(n + 32, history, views, cost, met={("b", "a")}).mode is Mode.PULL
    # ...which a first pull from "a" to "b" would spend on the handshake: stay.
    first = plan_turn(n + 32, history, views, cost, met=set())
    assert (first.replica_id, first.mode) == ("a", Mode.LOCAL)
    assert first.estimates_ms["pull"] > plan_turn(n + 32, history, views, cost, met={("b", "a")}).estimates_ms["pull"]


def test_a_replica_measured_slower_than_the_rest_is_estimated_slower():
    cost = calibrated(prefill_ms_per_token=0.3)
    truth = calibrated(prefill_ms_per_token=0.3)  # what "fast" takes; "slow" takes twice as long
    for _ in range(4):
        for n in (200, 300, 400, 500, 600, 700):
            cost.observe_prefill(n, 0, 2 * truth.recompute_ms(n), replica_id="slow")
            cost.observe_prefill(n, 0, truth.recompute_ms(n), replica_id="fast")
    # The fleet's fit now describes the mix of both; fit x factor describes each replica.
    assert cost.recompute_ms(1000, replica_id="slow") == pytest.approx(2 * 305.0, rel=0.15)
    assert cost.recompute_ms(1000, replica_id="fast") == pytest.approx(305.0, rel=0.15)
    # A conversation held on "slow" whose new turn is long is pulled to "fast" rather than computed on "slow".
    n = 1024
    history = lookup(n + 512, ReplicaMatch("slow", n, "hold", n, hold("slow", n)))
    plan = plan_turn(n + 512, history, [ReplicaView("slow"), ReplicaView("fast")], cost)
    assert (plan.replica_id, plan.mode) == ("fast", Mode.PULL)
    speeds = cost.snapshot()["replica_speed"]
    assert speeds["slow"] > 1.5 * speeds["fast"]
    # Short prefills say more about the fit's overheads than about a replica: they teach no speed.
    for _ in range(10):
        cost.observe_prefill(20, 0, 10 * cost.recompute_ms(20), replica_id="fast")
    assert cost.snapshot()["replica_speed"]["fast"] == speeds["fast"]


def test_a_replica_that_works_beside_a_busy_one_teaches_the_slowdown_not_a_slower_speed():
    truth = calibrated(prefill_ms_per_token=0.3)
    # "b" only ever works while another engine is busy, and beside it takes 1.3x as long as alone. The start-up
    # calibration's contended prefills had measured no slowdown (its busy engine was barely working).
    cost = calibrated(prefill_ms_per_token=0.3)
    for n in (64, 256, 1024):
        cost.observe_prefill(n, 0, truth.recompute_ms(n), busy_peers=1, replica_id="a")
    for _ in range(12):
        for n in (200, 300, 400, 500, 600, 700):
            cost.observe_prefill(n, 0, 1.3 * truth.recompute_ms(n), busy_peers=1, replica_id="b")
    assert cost.slowdown(1) == pytest.approx(1.3, rel=0.03)
    # It has never run alone: nothing says it is slower than the fleet.
    assert cost.speed_factor("b") == 1.0
    assert cost.recompute_ms(1000, busy_peers=1, replica_id="b") == pytest.approx(1.3 * truth.recompute_ms(1000),
                                                                                rel=0.05)
    # "c" is 1.2x slower than the fleet alone, and 1.3x that beside a busy engine: both are learned.
    cost = calibrated(prefill_ms_per_token=0.3)
    for _ in range(4):
        for n in (200, 300, 400, 500, 600, 700):
            cost.observe_prefill(n, 0, truth.recompute_ms(n), replica_id="a")
            cost.observe_prefill(n, 0, 1.2 * truth.recompute_ms(n), replica_id="c")
            cost.observe_prefill(n, 0, 1.2 * 1.3 * truth.recompute_ms(n), busy_peers=1, replica_id="c")
    assert cost.slowdown(1) == pytest.approx(1.3, rel=0.05)
    assert cost.recompute_ms(1000, replica_id="c") == pytest.approx(1.2 * truth.recompute_ms(1000), rel=0.1)
    # "d" has measured itself alone at 0.8 of the start-up fit, and the fit has moved only part of the way (its
    # window still holds the start-up samples): "d" is faster than the fit. "e" has only worked beside a busy
    # engine, 1.3x slower than "d" alone: it is taken to run like "d" alone, and its prefills teach the 0.3.
    cost = calibrated(prefill_ms_per_token=0.3)
    for _ in range(5):
        for n in (64, 256, 1024, 2048):
            cost.observe_prefill(n, 0, truth.recompute_ms(n))
    for n in (200, 300, 400, 500, 600, 700):
        cost.observe_prefill(n, 0, 0.8 * truth.recompute_ms(n), replica_id="d")
    assert cost.speed_factor("d") < 0.9
    for _ in range(12):
        for n in (200, 300, 400, 500, 600, 700):
            cost.observe_prefill(n, 0, 1.3 * 0.8 * truth.recompute_ms(n), busy_peers=1, replica_id="e")
    assert cost.speed_factor("e") == cost.speed_factor("d")
    # (Taken at the fit's face value, "e" would teach 0.11.)
    assert cost.slowdown(1) == pytest.approx(1.3, rel=0.1)


def test_an_option_without_its_own_error_samples_pays_what_its_pool_measured():
    cost = calibrated(prefill_ms_per_token=0.3)
    # As after the start-up calibration: many recomputes alone on the node (10 ms over), many beside a busy peer
    # (the contention fit's miss on top: 60 ms over), three local turns.
    for _ in range(cost.error.MIN_SAMPLES):
        cost.error.observe(Mode.RECOMPUTE, 0, 100.0, 110.0)
    for _ in range(12):
        cost.error.observe(Mode.RECOMPUTE, 1, 100.0, 160.0)
    for _ in range(3):
        cost.error.observe(Mode.LOCAL, 0, 20.0, 25.0)
    # A local turn alone on the node is charged what turns alone measured (the median over all would be 60 ms),
    # and a pull beside a busy peer what turns beside one measured.
    assert cost.error.offset_ms(Mode.LOCAL, 0) == 10.0
    assert cost.error.offset_ms(Mode.PULL, 1) == 60.0
    assert cost.snapshot()["estimate_error"]["local"] == {"offset_ms": 10.0, "uncertainty_ms": 5.0, "samples": 3}


def test_a_departure_the_estimates_cannot_tell_from_their_own_error_keeps_the_affinity_choice():
    # The P/D shape above with a 400-token reply: by its estimates a pull beats the prefix cache by more than the
    # stay margin. Then the turns measured show estimates off by up to 150 ms either way: the gain is within that.
    cost = calibrated(prefill_ms_per_token=0.3, pull_fixed_ms=8.0)
    n, history, cached = 1344, 1296, 896
    found = lookup(n, ReplicaMatch("p", cached, "resident", cached, None),
                   ReplicaMatch("d", history, "hold", history, hold("d", history)))
    views = [ReplicaView("p"), ReplicaView("d")]
    assert plan_turn(n, found, views, cost, targets={"p"}).mode is Mode.PULL
    for i in range(2 * cost.error.MIN_SAMPLES):
        for mode in (Mode.LOCAL, Mode.PULL):
            cost.error.observe(mode, 0, 100.0, 100.0 + (150.0 if i % 2 else -30.0))
    assert cost.error.uncertainty_ms(Mode.PULL, 0) == pytest.approx(90.0)
    unsure = plan_turn(n, found, views, cost, targets={"p"})
    assert unsure.mode is Mode.LOCAL and unsure.replica_id == "p"
    # Well-calibrated estimates (the same offset, no spread) let the clearly faster pull go ahead again.
    for _ in range(64):
        for mode in (Mode.LOCAL, Mode.PULL):
            cost.error.observe(mode, 0, 100.0, 160.0)
    assert cost.error.uncertainty_ms(Mode.PULL, 0) == 0.0
    assert plan_turn(n, found, views, cost, targets={"p"}).mode is Mode.PULL


def test_replicas_with_a_gpu_each_do_not_slow_each_other_or_split_the_estimate_error():
    shape = KVShape.from_hf_config(SMOLLM2, "bfloat16", 32)
    for shared in (True, False):
        cost = CostModel(shape.kv_bytes, shared_compute=shared)
        cost.contention.observe((1.0,), 0.3)
        for _ in range(cost.error.MIN_SAMPLES):
            cost.error.observe(Mode.RECOMPUTE, 1, 100.0, 700.0)  # first turns under load beside busy engines
        views = [ReplicaView("a", peers=(peer(waiting=1, prefill_tokens=500),))]
        plan = plan_turn(500, lookup(500), views, cost)
        if shared:  # CPU replicas of one node: a busy peer slows the turn and its error is its own kind
            assert plan.busy_peers == 1 and cost.slowdown(1) == pytest.approx(1.3)
            assert plan.estimate_ms == pytest.approx(plan.model_ms + 600.0)
        else:  # a GPU each: the node's other busy GPUs change nothing, the estimate is the one without them
            assert plan.busy_peers == 0 and cost.slowdown(1) == 1.0
            alone = plan_turn(500, lookup(500), [ReplicaView("a")], cost)
            assert (plan.model_ms, plan.estimate_ms) == (alone.model_ms, alone.estimate_ms)


def test_idle_replicas_alike_share_new_conversations_between_them():
    cost = calibrated()
    views = [ReplicaView(f"r{i}") for i in range(16)]
    chosen = {plan_turn(300, lookup(300), views, cost, rotation=turn).replica_id for turn in range(64)}
    assert len(chosen) >= 12  # not every new conversation on the first idle replica listed


def test_a_first_turn_is_not_held_to_the_replica_caching_a_shared_system_prompt():
    # "a" caches the 2,000-token system prompt every conversation of a tenant starts with, and is busy; "b" is idle.
    # A later turn of a conversation living on "a" would stay there unless moving is clearly faster; a first turn has
    # no history of its own there, so it goes where its first token comes soonest.
    cost = calibrated(prefill_ms_per_token=0.05)
    found = lookup(2100, ReplicaMatch("a", 2000, "resident", 2000, None))
    views = [ReplicaView("a", running=4, decode_tok_s=20.0, prefill_tokens=1000, prefilling=2), ReplicaView("b")]
    later = plan_turn(2100, found, views, cost, turn_index=3)
    first = plan_turn(2100, found, views, cost, turn_index=0)
    assert first.estimate_ms < later.estimate_ms
    assert (later.replica_id, first.replica_id) == ("a", "b")


def test_a_first_turn_leaves_the_replica_caching_its_system_prompt_only_for_a_gain_beyond_the_estimates_error():
    # As above, the first turn is faster on idle "b" by its estimates. Then turns measured show estimates off by up to
    # 10 s either way (first turns queued behind a burst on two shared cores): the gain is within that, so the
    # conversation starts where prefix affinity would start it, on "a"; with the spread gone it goes to "b" again.
    cost = calibrated(prefill_ms_per_token=0.05)
    found = lookup(2100, ReplicaMatch("a", 2000, "resident", 2000, None))
    views = [ReplicaView("a", running=4, decode_tok_s=20.0, prefill_tokens=1000, prefilling=2), ReplicaView("b")]
    options = {o.replica_id: o for o in _options(2100, found, views, cost, turn_index=0)}
    assert plan_turn(2100, found, views, cost, turn_index=0).replica_id == "b"
    gain = options["a"].cost_ms - options["b"].cost_ms
    assert 0 < gain < 10_000

    def observe(spread_ms: float) -> None:  # a whole window of turns, every kind
        for i in range(cost.error.window):
            for mode in Mode:
                for busy_peers, busy_target in ((0, False), (1, False), (0, True), (1, True)):
                    cost.error.observe(mode, busy_peers, 100.0, 12_000.0 + (spread_ms if i % 2 else -spread_ms),
                                       busy_target)

    observe(10_000.0)
    assert plan_turn(2100, found, views, cost, turn_index=0).replica_id == "a"
    observe(0.0)
    assert plan_turn(2100, found, views, cost, turn_index=0).replica_id == "b"


def busy_holder_cost(extra_ms: float) -> CostModel:
    """`calibrated()` that has also seen pulls from a busy holder take `extra_ms` beyond its link fit."""
    cost = calibrated(prefill_ms_per_token=0.3, pull_fixed_ms=8.0)
    for n in (256, 512, 1024):
        cost.observe_pull(n, cost.pull_ms(n) + extra_ms, holder_busy=True)
    return cost


def test_a_pull_from_a_busy_holder_costs_what_such_pulls_took():
    idle_fit = calibrated(prefill_ms_per_token=0.3, pull_fixed_ms=8.0)
    cost = busy_holder_cost(80.0)
    busy, idle = ReplicaView("a", running=4), ReplicaView("a")
    # The busy holders' pulls taught their own term and left the link fit as the idle holders' pulls made it.
    assert cost.pull.coef == pytest.approx(idle_fit.pull.coef)
    assert cost.pull_ms(256, busy) == pytest.approx(idle_fit.pull_ms(256) + 80.0, rel=0.01)
    assert cost.pull_ms(256, idle) == cost.pull_ms(256) == pytest.approx(idle_fit.pull_ms(256))
    assert cost.snapshot()["holder_load"]["busy_holder_ms"] == pytest.approx(80.0, rel=0.01)
    # Off the holder, a 256-token history with 256 new tokens: recomputing all 513 takes about 160 ms, and pulling
    # the history then computing the rest about 95 from an idle holder, but about 175 from this busy one.
    history = lookup(513, ReplicaMatch("a", 256, "hold", 256, hold("a", 256)))
    from_idle = plan_turn(513, history, [idle, ReplicaView("b")], cost, targets=["b"])
    from_busy = plan_turn(513, history, [busy, ReplicaView("b")], cost, targets=["b"])
    assert (from_idle.mode, from_idle.holder_busy) == (Mode.PULL, False)
    assert from_busy.mode is Mode.RECOMPUTE
    assert from_busy.estimates_ms["pull"] == pytest.approx(from_idle.estimates_ms["pull"] + 80.0, rel=0.01)
    # A pull planned from the busy holder says so: what it measures teaches the busy holders' term.
    forced = plan_turn(513, history, [busy, ReplicaView("b")], cost, force=(Mode.PULL, "b"))
    assert (forced.mode, forced.holder_busy) == (Mode.PULL, True)


def test_a_busy_holder_costs_nothing_extra_until_its_pulls_measure_slower():
    # The prior: nothing learned from busy holders yet, a pull is priced by the link fit alone.
    cost = calibrated()
    assert cost.pull_ms(1024, ReplicaView("a", running=4)) == cost.pull_ms(1024)
    # Holders that serve reads as fast when busy (RDMA: the NIC reads, not the holder's CPU) keep it at 0, even
    # where those pulls come a little faster than the link fit says.
    for n in (256, 512, 1024):
        cost.observe_pull(n, cost.pull_ms(n) - 0.5, holder_busy=True)
    assert cost.pull_ms(1024, ReplicaView("a", running=4)) == cost.pull_ms(1024)


def test_pd_with_one_prefill_replica_keeps_pulling_long_histories_back_from_the_busy_decoder():
    # P/D with one prefill replica: the start-up calibration measures no pull (it needs two replicas to pull
    # between), and every history is held by the decode replica, busy decoding. A 70B model's KV (320 KiB a token)
    # comes back in 150 ms + bytes at 80 GB/s, far under the prior's 1 GB/s.
    kv_bytes = 327_680
    cost = CostModel(lambda n: n * kv_bytes, shared_compute=False)
    for n in (64, 256, 1024, 2048, 4096, 8192):
        cost.observe_prefill(n, 0, 20.0 + 0.0714 * n)
    decoder, prefill = ReplicaView("d", running=2, decode_tok_s=45.0), ReplicaView("p")
    for n in (3000, 5000, 7000):
        cost.observe_pull(n, 150.0 + n * kv_bytes / 80e6, holder_busy=True)
    # The next turn: an 8,000-token history on the decoder and 140 new tokens. Recomputing takes about 600 ms;
    # pulling back what those pulls took (about 180 ms) and computing the rest, about 210.
    history = lookup(8140, ReplicaMatch("d", 8000, "hold", 8000, hold("d", 8000)))
    plan = plan_turn(8140, history, [decoder, prefill], cost, targets=["p"], turn_index=3)
    assert plan.mode is Mode.PULL
    assert plan.estimates_ms["pull"] == pytest.approx(150.0 + 8000 * kv_bytes / 80e6 + 20.0 + 0.0714 * 140, rel=0.1)


def test_a_replicas_typical_wait_is_its_queue_averaged_over_time_and_its_marginal_cost_grows_with_it():
    waits = TypicalWait()
    waits.observe(0.0, {"a": 100.0, "b": 0.0}, service_ms=50.0)
    waits.observe(0.0 + TypicalWait.TAU_S, {"a": 0.0})  # one time constant later "a" is found empty
    assert waits.ms("a") == pytest.approx(100.0 * math.exp(-1))
    assert waits.ms("b") == 0.0 and waits.ms("never-seen") == 0.0
    # M/M/1: a turn waits W and adds W / (1 - utilization) = W (1 + W / S) to the others' waits.
    w = waits.ms("a")
    assert waits.marginal_ms("a") == pytest.approx(w * (2 + w / 50.0))


def test_a_first_turn_founds_its_conversation_where_its_later_turns_will_wait_least():
    # Two idle replicas; "a" caches the tenant's 3,000-token system prompt, "b" nothing. Conversations run five turns.
    cost = with_five_turn_conversations(calibrated())
    views = [ReplicaView("a"), ReplicaView("b")]
    system_prompt = lookup(3200, ReplicaMatch("a", 3000, "resident", 3000, None))
    # By this turn's own first token, "a" (3,000 tokens cached) wins by far.
    assert plan_turn(3200, system_prompt, views, cost, turn_index=0).replica_id == "a"
    # But turns have lately found 400 ms of queue on "a" and none on "b": the conversation's four later turns would
    # wait there, and add to the others' waits; it starts on "b" and keeps its history there.
    cost.typical_wait.observe(0.0, {"a": 400.0, "b": 0.0}, service_ms=100.0)
    founded = plan_turn(3200, system_prompt, views, cost, turn_index=0)
    assert founded.replica_id == "b"
    on_a = next(o for o in _options(3200, system_prompt, views, cost, turn_index=0) if o.replica_id == "a")
    assert on_a.later_turns_ms == pytest.approx(4 * 400.0 * (2 + 400.0 / 100.0))
    # A later turn's history is where it is: the typical waits do not move it (the stay rule decides).
    later = lookup(3200, ReplicaMatch("a", 3100, "resident", 3100, None))
    assert plan_turn(3200, later, views, cost, turn_index=2).replica_id == "a"
    # Planning records nothing; the dispatched turn's plan teaches the queues it found.
    assert founded.queues_ms == {"a": 0.0, "b": 0.0}
    observe_queues(cost, founded, TypicalWait.TAU_S)
    assert cost.typical_wait.ms("a") == pytest.approx(400.0 * math.exp(-1))


def test_a_first_turn_prices_its_later_turns_computing_beside_the_busy_engines_of_its_home_node():
    # CPU engines of one node that slow each other by 40%; "a" serves the other conversations (turns have waited
    # 200 ms there), "b" beside it is idle. Conversations run five turns; a turn computes 1 s on average.
    cost = with_five_turn_conversations(calibrated(prefill_ms_per_token=1.0))
    cost.contention.observe((1.0,), 0.4)
    cost.typical_wait.observe(0.0, {"a": 200.0, "b": 0.0}, service_ms=1000.0)
    views = with_busy_peers([ReplicaView("a", running=3, decode_tok_s=10.0), ReplicaView("b")],
                            {"a": "node", "b": "node"})
    options = {o.replica_id: o for o in _options(900, lookup(900), views, cost, turn_index=0)}
    # On "b" each of its four later turns computes beside busy "a", 0.4 x 1 s slower; on "a" it waits its queue.
    assert options["b"].later_turns_ms == pytest.approx(4 * 0.4 * 1000.0)
    assert options["a"].later_turns_ms == pytest.approx(4 * 200.0 * (2 + 200.0 / 1000.0))
    assert plan_turn(900, lookup(900), views, cost, turn_index=0).replica_id == "a"
    # A second turn pulling its history from "a" to "b" moves the conversation's three turns after it there too.
    second = lookup(1000, ReplicaMatch("a", 900, "resident", 900, hold("a", 900)))
    pull = next(o for o in _options(1000, second, views, cost, turn_index=1) if o.mode is Mode.PULL)
    assert (pull.replica_id, pull.later_turns_ms) == ("b", pytest.approx(3 * 0.4 * 1000.0))
    # A GPU each: nothing beside "b" slows its later turns, and the conversation starts there, where none wait.
    cost.shared_compute = False
    views = with_busy_peers([ReplicaView("a", running=3, decode_tok_s=10.0), ReplicaView("b")],
                            {"a": "node", "b": "node"}, shared_compute=False)
    assert next(o for o in _options(900, lookup(900), views, cost, turn_index=0)
                if o.replica_id == "b").later_turns_ms == 0.0
    assert plan_turn(900, lookup(900), views, cost, turn_index=0).replica_id == "b"


def test_a_first_turn_caches_a_popular_shared_prompt_where_later_turns_wait_less_than_where_it_is_cached():
    # "a" caches the tenant's 3,000-token system prompt, "b" does not, and turns have lately waited 60 ms on "a" and
    # none on "b". By the later turns' waits alone, starting on "b" is not worth computing the prompt there (about
    # 900 ms against four later turns' 4 x 60 x 2.6 ms). But the first turns sharing the prompt next would find it
    # cached on "b" too: where it comes often and "b" keeps its blocks, that recompute is spared them.
    cost = with_five_turn_conversations(calibrated())
    cost.typical_wait.observe(0.0, {"a": 60.0, "b": 0.0}, service_ms=100.0)
    views = [ReplicaView("a"), ReplicaView("b")]
    found = lookup(3200, ReplicaMatch("a", 3000, "resident", 3000, None))
    prompt = b"system-prompt-01"
    assert plan_turn(3200, found, views, cost, turn_index=0, shared_prefix=prompt).replica_id == "a"  # never seen
    caches = {"a": (10_000, 0), "b": (10_000, 0)}  # neither cache has evicted a block in the ten minutes watched
    cost.shared_prefixes.observe_caches(lambda: caches, 0.0)
    for i in range(120):  # two first turns a second start with the prompt
        cost.shared_prefixes.observe_first_turn(prompt, 540.0 + i / 2)
    cost.shared_prefixes.observe_caches(lambda: caches, 600.0)
    assert cost.shared_prefixes.reuse_probability(prompt, "b", 2) > 0.99
    plan = plan_turn(3200, found, views, cost, turn_index=0, shared_prefix=prompt)
    assert (plan.replica_id, plan.mode, plan.shared_prefix) == ("b", Mode.RECOMPUTE, prompt)
    on_b = next(o for o in _options(3200, found, views, cost, turn_index=0, shared_prefix=prompt)
                if o.replica_id == "b")
    spared = cost.recompute_ms(3200) - cost.recompute_ms(200, 3000)
    assert on_b.seeds_ms == pytest.approx(spared, rel=0.01)
    # Seeding alone moves nothing: with the waits alike, the turn starts where the prompt is cached.
    cost.typical_wait.observe(600.0, {"a": 0.0, "b": 0.0})
    cost.typical_wait.observe(1200.0, {"a": 0.0, "b": 0.0})
    assert plan_turn(3200, found, views, cost, turn_index=0, shared_prefix=prompt).replica_id == "a"
    # A later turn's history is its own, not a shared prefix: it has nothing to seed.
    assert plan_turn(3200, found, views, cost, turn_index=2, shared_prefix=prompt).shared_prefix is None


def test_in_pd_a_first_turn_starts_on_the_prefill_replica_free_now_whatever_queues_it_had():
    # P/D: the decode pool holds each conversation's history, and each later turn starts wherever the prefill pool
    # has room; the first turn's prefill replica is no home for them, and its usual queue is no wait of theirs.
    cost = with_five_turn_conversations(calibrated())
    # Turns have lately found 400 ms of queue on "a" and none on "b"; now "b" prefills 1,000 tokens and "a" is free.
    cost.typical_wait.observe(0.0, {"a": 400.0, "b": 0.0}, service_ms=100.0)
    views = [ReplicaView("a"), ReplicaView("b", prefill_tokens=1000, prefilling=1)]
    first = lookup(2000)
    plan = plan_turn(2000, first, views, cost, turn_index=0, founds_home=False)
    assert plan.replica_id == "a"
    assert plan.estimate_ms < plan_turn(2000, first, views, cost, force=(Mode.RECOMPUTE, "b")).estimate_ms
    # Where the target keeps the history, the later turns' waits on "a" are the first turn's to weigh.
    assert plan_turn(2000, first, views, cost, turn_index=0).replica_id == "b"


def test_turns_on_a_busy_cpu_engine_are_corrected_by_what_such_turns_measured():
    """Where engines share a node's CPUs, a turn on the busy engine misses its estimate by more than one on the idle
    engine beside it (the busy engine's processes take the CPU its prefill needs): measured on tiny-llama, 126 ms
    against 52 estimated. Its error is its own kind, so the planner stops sending turns to the busy engine that their
    fits alone make look cheaper; with a GPU per engine there is no such kind."""
    shape = KVShape.from_hf_config(SMOLLM2, "bfloat16", 32)
    for shared in (True, False):
        cost = CostModel(shape.kv_bytes, shared_compute=shared)
        for n in (64, 256, 1024):
            cost.observe_prefill(n, 0, 5.0 + 0.3 * n)
        cost.contention.observe((1.0,), 1.5)  # as the calibration measured it beside four decoding streams
        busy = ReplicaView("b", running=4, decode_tok_s=80.0)
        holder = ReplicaView("h", peers=(busy,))
        history = lookup(64 + 128, ReplicaMatch("h", 64, "cached", 64, None))
        assert plan_turn(64 + 128, history, [holder, busy], cost, targets={"b"}).busy_target is shared
        if shared:  # by the fits the busy engine looks faster than the slowed-down holder
            assert plan_turn(64 + 128, history, [holder, busy], cost).replica_id == "b"
        for _ in range(cost.error.MIN_SAMPLES):
            cost.error.observe(Mode.RECOMPUTE, 0, 50.0, 125.0, busy_target=True)  # on the busy engine: +75 ms
            cost.error.observe(Mode.LOCAL, 1, 60.0, 55.0)  # on the idle engine beside it: -5 ms
            cost.error.observe(Mode.RECOMPUTE, 0, 50.0, 50.0)  # alone on the node: as estimated
        on_busy = plan_turn(64 + 128, history, [holder, busy], cost, targets={"b"})
        if shared:
            assert on_busy.estimate_ms == pytest.approx(on_busy.model_ms + 75.0)
            assert plan_turn(64 + 128, history, [holder, busy], cost).replica_id == "h"
        else:  # a GPU each: the busy engine's turns are corrected as any turn alone on its node
            assert on_busy.estimate_ms == pytest.approx(on_busy.model_ms)


def test_a_turn_reading_a_hold_pays_the_measured_time_to_take_it_from_the_directory():
    """A pull (or a read of the target's own hold) is sent only once its hold is taken from the directory's actor:
    10-35 ms on a loaded two-core machine (tiny-llama, timed per stage). Measured, that time is
    priced, so a pull that beats recomputing by less no longer wins."""
    cost = calibrated()
    history = lookup(64 + 32, ReplicaMatch("a", 64, "hold", 64, hold("a", 64)))
    replicas = [ReplicaView("a", running=8, prefill_tokens=4000, prefilling=2), ReplicaView("b")]
    before = plan_turn(64 + 32, history, replicas, cost, targets={"b"})
    gain = before.estimates_ms[Mode.RECOMPUTE] - before.estimates_ms[Mode.PULL]
    assert before.mode is Mode.PULL and 0 < gain < 30.0
    cost.observe_take_hold(30.0)
    after = plan_turn(64 + 32, history, replicas, cost, targets={"b"})
    assert after.estimates_ms[Mode.PULL] == pytest.approx(before.estimates_ms[Mode.PULL] + 30.0, abs=0.01)
    assert after.mode is Mode.RECOMPUTE


def test_first_turns_start_where_prefix_affinity_would_until_the_forecast_knows_whether_conversations_go_on():
    # Two CPU engines of one node that slow each other; "a" has three first turns to prefill, "b" is idle, nothing
    # is cached. By the estimates the fourth first turn is faster on "b" (priced as one-shot traffic); but its
    # conversation's later turns would run there beside "a", for as many turns as the forecast cannot yet tell.
    def cost_with(shared: bool, forecast: bool) -> CostModel:
        cost = calibrated(prefill_ms_per_token=3.0)
        cost.shared_compute = shared
        cost.contention.observe((1.0,), 0.4)
        return with_five_turn_conversations(cost) if forecast else cost

    views = with_busy_peers([ReplicaView("a", prefill_tokens=3000, prefilling=3), ReplicaView("b")],
                            {"a": "node", "b": "node"})

    def first_turn(cost: CostModel) -> str:
        return plan_turn(1000, lookup(1000), views, cost, turn_index=0).replica_id

    assert first_turn(cost_with(shared=True, forecast=False)) == "a"  # where prefix affinity starts it
    assert plan_turn(1000, lookup(1000), views, cost_with(True, False), turn_index=0,
                     policy="prefix_affinity").replica_id == "a"
    assert first_turn(cost_with(shared=True, forecast=True)) == "b"  # priced for its later turns: it pays
    assert first_turn(cost_with(shared=False, forecast=False)) == "b"  # a GPU each: no later turn is slowed
