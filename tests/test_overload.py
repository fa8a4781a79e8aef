"""Overload and disconnects: a full ingress answers 429 at once, and a client that leaves mid-stream cancels its
engine request and frees its place.

The apps here test admission, not placement: they start without the start-up calibration (`calibrate: false`), so
no calibration turn holds the one place each test fills."""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import httpx

from tests.conftest import TINY_ENGINE, delete_app, run_app


def generated_tokens(base_url: str) -> float:
    """Tokens the engines have generated so far (vLLM's own counter, summed over replicas)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == "vllm:generation_tokens"
               for s in f.samples if s.name.endswith("_total"))


def test_a_full_ingress_answers_429_and_a_client_that_leaves_frees_its_turn(serve_port):
    app = run_app("small", "/small", serve_port, ingress_max_turns=1, calibrate=False,
                  pool={"num_replicas": 1, "engine": dict(TINY_ENGINE, model="tiny-llama")})
    try:
        app.replica_ids(1)
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

    app = run_app("queue", "/queue", serve_port, calibrate=False,
                  pool={"num_replicas": 1, "max_ongoing_requests": 1, "max_queued_requests": 1,
                        "engine": dict(TINY_ENGINE, model="tiny-llama")})
    try:
        app.replica_ids(1)
        url = f"{app.base_url}/v1/completions"
        short = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 2}
        long = {**short, "max_tokens": 1900, "ignore_eos": True, "stream": True}

        def send(_: int) -> tuple[httpx.Response, float]:
            started = time.monotonic()
            return httpx.post(url, json=short, timeout=120), time.monotonic() - started

        # One runs (its first token streamed: it holds the replica's one place); then two at once: one waits in the
        # queue, the other finds both full and is refused at once. The running turn's client then leaves, which
        # frees the replica for the queued one. (Sent all three at once, the running one could still be on its way
        # to the replica when the others arrived: both were refused.)
        with ThreadPoolExecutor(2) as pool, httpx.stream("POST", url, json=long, timeout=120) as running:
            assert running.status_code == 200
            lines = running.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
            later = [pool.submit(send, i) for i in range(2)]
            first, _ = wait(later, timeout=60, return_when=FIRST_COMPLETED)
            assert first, "neither turn sent beside the running one was answered within 60 s"
            response, seconds = next(iter(first)).result()
            assert response.status_code == 429, response.text[:200]
            assert response.headers["retry-after"] == "1" and response.json()["error"]["code"] == "rate_limit_exceeded"
            assert not all(f.done() for f in later), "the queued turn was answered while the running one still ran"
        # The running turn's client left: the queued turn runs now and is answered.
        queued = [f.result() for f in later if f.result()[0].status_code != 429]
        assert len(queued) == 1 and queued[0][0].status_code == 200, [f.result()[0].text[:200] for f in later]
        assert seconds < queued[0][1]  # refused at once, not after a turn
    finally:
        delete_app("queue")
