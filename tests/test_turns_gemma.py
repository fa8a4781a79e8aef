"""Pulls on tiny Gemma3n with KV-sharing fast prefill, and fast prefill's client-visible limit."""

from __future__ import annotations

import pytest

from tests.conftest import TINY_ENGINE, delete_app, run_app
from tests.test_turns import converse


@pytest.fixture(scope="module")
def gemma_app(serve_port):
    engine = dict(TINY_ENGINE, model="tiny-gemma3n", kv_sharing_fast_prefill=True)
    # Every turn here is forced onto its replica and mode: no placement to calibrate. (With it, its turns would keep
    # the replicas busy, and a forced local turn on a busy replica rightly uses its prefix cache alone rather than
    # wait a step to read its own hold.)
    app = run_app("gemma", "/gemma", serve_port, calibrate=False, pool={"num_replicas": 2, "engine": engine})
    app.replica_ids(2)
    app.ingress.calibrated.remote().result()
    counters = app.ingress.stats.remote().result()["counters"]
    assert not any(name.startswith("plans_") for name in counters), f"calibrate: false ran turns: {counters}"
    yield app
    delete_app("gemma")


def test_pulls_give_the_same_tokens_as_recompute_on_gemma3n_with_fast_prefill(gemma_app):
    assert converse(gemma_app, "pull", seed=2) == converse(gemma_app, "recompute", seed=2)


def test_turns_that_stay_on_the_holder_give_the_same_tokens_as_recompute_on_gemma3n(gemma_app):
    assert converse(gemma_app, "stay", seed=3) == converse(gemma_app, "recompute", seed=3)


def test_prompt_logprobs_on_a_fast_prefill_deployment_is_a_400(gemma_app):
    import httpx

    body = {"model": "tiny-gemma3n", "prompt": "hello", "max_tokens": 2, "prompt_logprobs": 1}
    resp = httpx.post(f"{gemma_app.base_url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 400 and "fast prefill" in resp.json()["error"]["message"]
    ok = httpx.post(f"{gemma_app.base_url}/v1/completions", json={**body, "prompt_logprobs": None}, timeout=60)
    assert ok.status_code == 200
