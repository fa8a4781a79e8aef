"""Disaggregated topology: prefill on one replica, P->D over NIXL, decode on another, history pulled back."""

from __future__ import annotations

import random

import pytest

from tests.conftest import TINY_ENGINE, delete_app, run_app
from tests.test_turns import GREEDY, TURNS, user_tokens


@pytest.fixture(scope="module")
def disagg_app(serve_port):
    engine = dict(TINY_ENGINE, model="tiny-llama")
    # As in vLLM PR #32553's experiment, the prefill side keeps no prefix cache: the history can only come back
    # from the decoder, so every later turn must pull it.
    prefill = dict(engine, enable_prefix_caching=False)
    app = run_app("disagg", "/disagg", serve_port, topology="disaggregated",
                  pool={"num_replicas": 1, "engine": prefill}, decode_pool={"num_replicas": 1, "engine": engine})
    app.replica_ids(2)
    app.ingress.calibrated.remote().result(timeout_s=300)
    yield app
    delete_app("disagg")


def test_disaggregated_turns_prefill_hand_over_and_reuse_the_decoders_hold(disagg_app, tiny_app):
    rng = random.Random(7)
    history = user_tokens(rng, 300)
    reference_replica = tiny_app.replica_ids(1)[0]
    stats = disagg_app.ingress.stats.remote().result()["replicas"]
    decoders = {r["replica_id"] for r in stats if r["pool"] == "decode_engines"}
    prefill = next(r["replica_id"] for r in stats if r["pool"] == "engines")
    held = 0  # tokens whose KV the decode replica holds after the previous turn
    # The start-up calibration's recomputes (forced, on the prefill replica) taught the estimates' error already,
    # through the same prefill stage that hands over to the decoder.
    errors = disagg_app.ingress.stats.remote().result()["cost_model"]["estimate_error"]
    assert errors["recompute"]["samples"] >= 3, errors
    taught = sum(kind["samples"] for kind in errors.values())
    for turn in range(TURNS):
        # Later turns pull the history back from the decoder. Forced: on a tiny model recomputing a few hundred
        # tokens costs about what a pull does, so the planner may rightly choose either; this test is about
        # the pull itself — the decoder's hold recorded, found and read whole.
        force = ("pull", prefill) if turn > 0 else None
        result = disagg_app.ingress.turn.remote(history, GREEDY, force).result(timeout_s=120)
        reference = tiny_app.ingress.turn.remote(history, GREEDY, ("recompute", reference_replica)).result(
            timeout_s=120)
        assert result.token_ids == reference.token_ids, turn
        assert result.kvrelay.replica in decoders  # the reply streamed from the decode replica
        # Its first token is the prefill replica's, timed there; the counts are the whole turn's.
        assert result.ttft_ms is not None and result.ttft_ms < result.latency_ms
        assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(history), len(result.token_ids))
        if turn > 0:
            plan = result.kvrelay
            assert (plan.mode, plan.holder) == ("pull", next(iter(decoders))), plan
            assert plan.reused_tokens == result.usage.cached_tokens == held, plan
        # The decoder's hold covers this turn's prompt and output but the last sampled token (no KV yet).
        held = len(history) + len(result.token_ids) - 1
        history = history + result.token_ids + user_tokens(rng, 20)
    # The first turn ran as planned: its prefill stage taught the planner how far off its estimate was, as
    # aggregated turns do; the test's forced pulls taught nothing (only the calibration's forced turns teach).
    errors = disagg_app.ingress.stats.remote().result()["cost_model"]["estimate_error"]
    assert sum(kind["samples"] for kind in errors.values()) == taught + 1, errors


def test_a_one_token_reply_ends_on_the_prefill_replica(disagg_app, tiny_app):
    history = user_tokens(random.Random(8), 200)
    one = disagg_app.ingress.turn.remote(history, {**GREEDY, "max_tokens": 1}).result(timeout_s=120)
    reference = tiny_app.ingress.turn.remote(history, {**GREEDY, "max_tokens": 1}).result(timeout_s=120)
    assert one.token_ids == reference.token_ids and one.finish_reason == "length"
    replicas = disagg_app.ingress.stats.remote().result()["replicas"]
    prefill = {r["replica_id"] for r in replicas if r["pool"] == "engines"}
    assert one.kvrelay.replica in prefill  # nothing was left for a decode replica to do
    assert (one.usage.prompt_tokens, one.usage.completion_tokens) == (len(history), 1)
