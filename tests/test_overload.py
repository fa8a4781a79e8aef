"""Overload and disconnects: a full ingress answers 429 at once, and a client that leaves mid-stream cancels its
engine request and frees its place."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.conftest import TINY_ENGINE, delete_app, run_app


def generated_tokens(base_url: str) -> float:
    """Tokens the engines have generated so far (vLLM's own counter, summed over replicas)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == "vllm:generation_tokens"
               for s in f.samples if s.name.endswith("_total"))


def test_a_full_ingress_answers_429_and_a_client_that_leaves_frees_its_turn(serve_port):
    app = run_app("small", "/small", serve_port, ingress_max_turns=1,
                  pool={"num_replicas": 1, "engine": dict(TINY_ENGINE, model="tiny-llama")})
    try:
        app.replica_ids(1)
        app.ingress.calibrated.remote().result()  # the start-up calibration's own turns are done
        url = f"{app.base_url}/v1/completions"
        short = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 2}
        long = {**short, "max_tokens": 1900, "ignore_eos": True, "stream": True}
        before = generated_tokens(app.base_url)
        with httpx.stream("POST", url, json=long, timeout=60) as streaming:
            assert streaming.status_code == 200
            lines = streaming.iter_lines()
            for _ in range(3):
                next(lines)
            started = time.monotonic()
            refused = httpx.post(url, json=short, timeout=60)
            assert time.monotonic() - started < 5  # at once, not after the running turn
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1", refused.text
            assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        # The client left about 1900 tokens early: the engine stops generating for it (vLLM does not count aborted
        # requests, so watch its token counter settle far below the full answer) and its place is free again.
        time.sleep(3)
        settled = generated_tokens(app.base_url)
        time.sleep(3)
        assert generated_tokens(app.base_url) == settled < before + 1900 - 100, (before, settled)
        assert httpx.post(url, json=short, timeout=60).status_code == 200
    finally:
        delete_app("small")


def test_a_full_engine_queue_answers_429_at_once(serve_port):
    """Each replica runs `max_ongoing_requests` and the ingress queues `max_queued_requests` more for the pool; one
    request beyond both is refused at once rather than queued without bound."""

    app = run_app("queue", "/queue", serve_port,
                  pool={"num_replicas": 1, "max_ongoing_requests": 1, "max_queued_requests": 1,
                        "engine": dict(TINY_ENGINE, model="tiny-llama")})
    try:
        app.replica_ids(1)
        app.ingress.calibrated.remote().result()
        url = f"{app.base_url}/v1/completions"
        long = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 1900, "ignore_eos": True}

        def send(_: int) -> tuple[httpx.Response, float]:
            started = time.monotonic()
            return httpx.post(url, json=long, timeout=120), time.monotonic() - started

        # One runs; then two at once: one waits in the queue, the other finds both full. (Sent all three at once,
        # the running one could still be on its way to the replica when the others arrived: both were refused.)
        with ThreadPoolExecutor(3) as pool:
            running = pool.submit(send, 0)
            time.sleep(2.0)  # it decodes 1,900 tokens: still running when the others come
            later = list(pool.map(send, range(2)))
            answers = [running.result(), *later]
        refused = [(r, s) for r, s in answers if r.status_code == 429]
        assert sorted(r.status_code for r, _ in answers) == [200, 200, 429], [r.text[:200] for r, _ in answers]
        response, seconds = refused[0]
        assert seconds < min(s for r, s in answers if r.status_code == 200)  # at once, not after a turn
        assert response.headers["retry-after"] == "1" and response.json()["error"]["code"] == "rate_limit_exceeded"
    finally:
        delete_app("queue")
