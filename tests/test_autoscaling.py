"""Autoscaling engine replicas on queue depth, KV cache usage and TTFT: up under load, down when idle, no failures."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import httpx
import pytest

from app.autoscaling import EngineAutoscalingPolicy
from tests.conftest import TINY_ENGINE, run_app


def tick(current: int, queued: float = 0.0, **metrics: dict[str, float]) -> SimpleNamespace:
    """The fields of Serve's AutoscalingContext the policy reads (metrics: name -> {replica: value})."""
    return SimpleNamespace(current_num_replicas=current, total_queued_requests=queued, aggregated_metrics=metrics)


def test_policy_follows_the_worst_signal_against_its_target():
    policy = EngineAutoscalingPolicy(target_ongoing_requests=4, target_kv_cache_usage=0.8, target_ttft_ms=1000)
    calm = tick(2, ongoing_requests={"a": 2, "b": 2}, kv_cache_usage={"a": 0.3, "b": 0.3}, ttft_ms={"a": 300})
    assert policy(calm)[0] == 1  # every signal at half its target or less: shrink
    busy_queue = tick(2, queued=8, ongoing_requests={"a": 4, "b": 4})
    assert policy(busy_queue)[0] == 4  # 16 requests for 2 replicas at a target of 4 each
    full_cache = tick(2, ongoing_requests={"a": 1, "b": 1}, kv_cache_usage={"a": 0.95, "b": 0.85})
    assert policy(full_cache)[0] == 3
    slow_first_token = tick(3, ongoing_requests={"a": 1}, ttft_ms={"a": 200, "b": 2500, "c": 400})
    desired, state = policy(slow_first_token)
    assert desired == 8 and state["ratios"]["ttft_ms"] == 2.5  # one slow replica is enough to grow
    assert policy(tick(2, ongoing_requests={"a": 3, "b": 3}))[0] == 2  # 75% of target: hold steady
    assert policy(tick(3))[0] == 1  # idle: down to the floor Serve enforces (min_replicas)


def test_impossible_autoscaling_config_is_refused_before_anything_starts():
    from pydantic import ValidationError

    from configs.app import AppConfig

    with pytest.raises(ValidationError, match="exceeds max_replicas"):
        AppConfig.model_validate({"pool": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}})
    with pytest.raises(ValidationError, match="starting size"):
        AppConfig.model_validate({"pool": {"num_replicas": 5, "autoscaling": {"max_replicas": 2}}})


@pytest.fixture(scope="module")
def scaling_app(serve_port):
    from ray import serve

    app = run_app(
        "scaling", "/scaling", serve_port,
        pool={"num_replicas": 1, "engine": dict(TINY_ENGINE, model="tiny-llama"), "autoscaling": {
            "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1.0, "target_ttft_ms": 600_000,
            "upscale_delay_s": 1, "downscale_delay_s": 5, "metrics_interval_s": 0.5, "look_back_period_s": 3,
        }},
    )
    app.replica_ids(1)
    yield app
    serve.delete("scaling")


def live_replicas(app) -> list[str]:
    return sorted(r["replica_id"] for r in app.ingress.stats.remote().result()["replicas"])


async def drive(app, concurrency: int, until, timeout_s: float) -> tuple[int, list[str]]:
    """Keep `concurrency` chat requests in flight until `until()` holds; returns (succeeded, failures)."""
    body = {"model": "tiny-llama", "max_tokens": 48, "ignore_eos": True, "temperature": 0}
    done, failures = 0, []
    deadline = time.monotonic() + timeout_s
    stop = asyncio.Event()

    async def client(worker: int, http: httpx.AsyncClient) -> None:
        nonlocal done
        turn = 0
        while not stop.is_set():
            turn += 1
            messages = [{"role": "user", "content": f"client {worker} turn {turn}: " + "tell me a story " * 20}]
            try:
                resp = await http.post(f"{app.base_url}/v1/chat/completions", json=dict(body, messages=messages))
                if resp.status_code == 200:
                    done += 1
                else:
                    failures.append(f"{resp.status_code}: {resp.text[:300]}")
            except httpx.HTTPError as exc:
                failures.append(repr(exc))

    async def watch() -> None:
        while time.monotonic() < deadline and not await asyncio.to_thread(until):
            await asyncio.sleep(1)
        stop.set()

    async with httpx.AsyncClient(timeout=120) as http:
        await asyncio.gather(watch(), *(client(i, http) for i in range(concurrency)))
    return done, failures


def test_load_scales_up_idleness_scales_down_and_no_request_fails(scaling_app):
    assert len(live_replicas(scaling_app)) == 1
    done, failures = asyncio.run(drive(scaling_app, 4, lambda: len(live_replicas(scaling_app)) == 2, 300))
    assert not failures, failures[:3]
    assert len(live_replicas(scaling_app)) == 2, "four requests in flight against a target of one did not scale up"
    assert done > 0

    # One request at a time: half the target across two replicas, so the pool shrinks while it serves.
    done, failures = asyncio.run(drive(scaling_app, 1, lambda: len(live_replicas(scaling_app)) == 1, 300))
    assert not failures, failures[:3]
    survivors = live_replicas(scaling_app)
    assert len(survivors) == 1, "an idle pool did not scale down"
    stats = scaling_app.ingress.stats.remote().result()
    assert stats["directory"]["replicas"] <= 1  # the removed replica's entries were dropped
