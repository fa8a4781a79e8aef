"""The OpenAI-style HTTP endpoint, driven by the official `openai` client and by raw HTTP for bad input."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def client(tiny_app) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_app.base_url}/v1", api_key="test-key", timeout=120, max_retries=0)


def test_chat_completion(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=8, temperature=0
    )
    assert resp.choices[0].message.role == "assistant"
    assert resp.usage.completion_tokens == 8 or resp.choices[0].finish_reason == "stop"
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    plan = resp.model_extra["kvrelay"]
    assert plan["mode"] in ("local", "pull", "recompute") and "recompute" in plan["estimates_ms"]


def test_chat_streaming_matches_non_streaming(client):
    messages = [{"role": "user", "content": "count with me: one two three"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 10
    assert "kvrelay" in chunks[-1].model_extra
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"


def test_completions_streaming_and_not(client):
    whole = client.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="the quick brown fox", max_tokens=6, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == whole.choices[0].text and whole.usage.completion_tokens == 6


def test_sse_wire_format_ends_with_done(tiny_app):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{tiny_app.base_url}/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert json.loads(resp.headers["x-kvrelay-plan"])["mode"] in ("local", "pull", "recompute")
        events = [line for line in resp.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "chat.completion.chunk"


def test_four_turn_conversation_reuses_kv_on_turns_two_to_four(client):
    messages = [{"role": "system", "content": "You are a helpful assistant. " * 20}]
    for turn in range(4):
        messages.append({"role": "user", "content": f"question number {turn}: tell me more"})
        resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
        reused = resp.model_extra["kvrelay"]["reused_tokens"]
        cached = resp.usage.prompt_tokens_details.cached_tokens
        if turn == 0:
            assert cached == 0
        else:
            assert reused > 0 and cached > 0, (turn, resp.model_extra["kvrelay"])
        messages.append({"role": "assistant", "content": resp.choices[0].message.content})


def test_session_header_is_a_placement_hint(client, tiny_app):
    from app.turns import preferred_replica

    ids = tiny_app.replica_ids(2)
    # Two sessions whose hash prefers different replicas: a planner ignoring the hint could not place both.
    sessions = {}
    for name in (f"session-{i}" for i in range(100)):
        sessions.setdefault(preferred_replica(name, ids), name)
        if len(sessions) == 2:
            break
    for replica, session in sessions.items():
        for i in range(3):
            resp = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": f"short {session} {i}"}], max_tokens=2,
                extra_headers={"X-Session-Id": session})
            plan = json.loads(resp.headers["x-kvrelay-plan"])
            assert plan["replica"] == replica, f"{session} turn {i}: {plan}"


def test_models_health_and_metrics(tiny_app, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{tiny_app.base_url}/health", timeout=30).json()["status"] == "ok"
    metrics = httpx.get(f"{tiny_app.base_url}/metrics", timeout=30).text
    assert "kvrelay_plans_total" in metrics and "kvrelay_ttft_seconds_bucket" in metrics


def post(tiny_app, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{tiny_app.base_url}{path}", timeout=60, **kwargs)


CHAT = "/v1/chat/completions"
GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({**GOOD, "messages": "hi"}, 400, "messages"),
        ({"model": MODEL}, 400, "missing required field 'messages'"),
        ({**GOOD, "frobnicate": 1}, 400, "unknown field 'frobnicate'"),
        ({**GOOD, "max_tokens": "many"}, 400, "max_tokens"),
        ({**GOOD, "n": 2}, 400, "only n=1"),
        ({**GOOD, "model": "gpt-5"}, 404, "not served here"),
        ({**GOOD, "kv_transfer_params": {"remote_block_ids": [[1]]}}, 400, "cannot be set by clients"),
        ({**GOOD, "messages": [{"role": "user", "content": "word " * 3000}]}, 400, "context is 2048 tokens"),
        ({**GOOD, "max_tokens": 5000}, 400, "context is 2048 tokens"),
        # Values the engine's sampling refuses: a clear 400, never a plain-text 500.
        ({**GOOD, "top_k": -5}, 400, "top_k"),
        ({**GOOD, "stop": ""}, 400, "stop"),
        ({**GOOD, "min_tokens": 5}, 400, "min_tokens"),
        ({**GOOD, "seed": 2**70}, 400, "seed"),
    ],
)
def test_bad_requests_get_openai_style_4xx(tiny_app, body, status, needle):
    resp = post(tiny_app, CHAT, json=body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert needle in error["message"] and error["type"] == "invalid_request_error"


def test_malformed_json_and_non_object_bodies(tiny_app):
    assert post(tiny_app, CHAT, content=b"{not json").status_code == 400
    assert "JSON object" in post(tiny_app, CHAT, json=[1, 2]).json()["error"]["message"]
    bad_ids = post(tiny_app, "/v1/completions", json={"model": MODEL, "prompt": [10**9]})
    assert bad_ids.status_code == 400 and "token ids" in bad_ids.json()["error"]["message"]


def test_service_keeps_serving_after_bad_requests(client, tiny_app):
    for _ in range(3):
        post(tiny_app, CHAT, json={**GOOD, "n": 3})
    resp = client.chat.completions.create(**GOOD)
    assert resp.choices[0].message.content is not None
