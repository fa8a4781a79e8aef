"""The OpenAI-compatible HTTP endpoint, driven by the official `openai` client and by raw HTTP for bad input."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.conftest import API_KEYS

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def client(tiny_app) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_app.base_url}/v1", api_key=API_KEYS[0], timeout=120, max_retries=0)


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
    with httpx.stream("POST", f"{tiny_app.base_url}/v1/chat/completions", json=body, headers=tiny_app.headers,
                      timeout=120) as resp:
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
    from kvtransfer.load import preferred_replica

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
    from prometheus_client.parser import text_string_to_metric_families

    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{tiny_app.base_url}/health", timeout=30).json()["status"] == "ok"
    metrics = httpx.get(f"{tiny_app.base_url}/metrics", headers=tiny_app.headers, timeout=30).text
    assert "kvrelay_plans_total" in metrics and "kvrelay_ttft_seconds_bucket" in metrics
    families = {f.name: f for f in text_string_to_metric_families(metrics)}  # a well-formed exposition
    # Each engine's own vLLM metrics, labelled by replica.
    finished = families["vllm:request_success"].samples
    assert {s.labels["replica"] for s in finished} == set(tiny_app.replica_ids(2))


def post(tiny_app, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{tiny_app.base_url}{path}", headers=tiny_app.headers, timeout=60, **kwargs)


CHAT = "/v1/chat/completions"
GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({**GOOD, "messages": "hi"}, 400, "messages"),
        ({"model": MODEL}, 400, "missing required field 'messages'"),
        ({**GOOD, "max_tokens": "many"}, 400, "max_tokens"),
        ({**GOOD, "n": 0}, 400, "n"),
        ({**GOOD, "model": "gpt-5"}, 404, "does not exist"),
        ({**GOOD, "kv_transfer_params": {"remote_block_ids": [[1]]}}, 400, "cannot be set by clients"),
        ({**GOOD, "messages": [{"role": "user", "content": "word " * 3000}]}, 400, "2048"),
        ({**GOOD, "max_tokens": 5000}, 400, "2048"),
        # Values the engine's sampling refuses: a clear 400, never a plain-text 500.
        ({**GOOD, "top_k": -5}, 400, "top_k"),
        ({**GOOD, "stop": ""}, 400, "stop"),
        ({**GOOD, "min_tokens": 5}, 400, "min_tokens"),
        ({**GOOD, "seed": 2**70}, 400, "seed"),
        # Shapes vLLM's own validators trip over with a TypeError (found by benchmarks/fuzz.py).
        ({**GOOD, "messages": None}, 400, "malformed"),
        ({**GOOD, "structured_outputs": 5}, 400, "malformed"),
    ],
)
def test_bad_requests_get_openai_style_4xx(tiny_app, body, status, needle):
    resp = post(tiny_app, CHAT, json=body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert needle in error["message"] and error["type"] == "invalid_request_error"


def test_an_error_raised_in_the_replica_reaches_the_client_as_raised(tiny_app):
    """The engine refuses a token id outside the vocabulary: the 400 says so, without Ray's remote traceback."""
    resp = post(tiny_app, "/v1/completions", json={"model": MODEL, "prompt": [5, 10**6], "max_tokens": 2})
    assert resp.status_code == 400, resp.text
    message = resp.json()["error"]["message"]
    assert "out of vocabulary" in message, message
    assert "ray::" not in message and "Traceback" not in message and "ServeReplica" not in message, message


def test_malformed_json_and_non_object_bodies(tiny_app):
    assert post(tiny_app, CHAT, content=b"{not json").status_code == 400
    for resp in (post(tiny_app, "/v1/embeddings", json={}), httpx.get(f"{tiny_app.base_url}{CHAT}", timeout=30,
                                                                     headers=tiny_app.headers)):
        assert resp.status_code in (404, 405) and resp.json()["error"]["message"], resp.text  # JSON, not text
    assert "JSON object" in post(tiny_app, CHAT, json=[1, 2]).json()["error"]["message"]
    bad_ids = post(tiny_app, "/v1/completions", json={"model": MODEL, "prompt": [10**9]})
    assert bad_ids.status_code == 400 and "vocabulary" in bad_ids.json()["error"]["message"]


def test_service_keeps_serving_after_bad_requests(client, tiny_app):
    for _ in range(3):
        post(tiny_app, CHAT, json={**GOOD, "top_k": -3})
    resp = client.chat.completions.create(**GOOD)
    assert resp.choices[0].message.content is not None


def test_fields_sdks_send_are_accepted_with_vllms_meaning(tiny_app):
    body = {
        **GOOD, "logprobs": False, "parallel_tool_calls": True, "response_format": {"type": "text"},
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "tool_choice": "none", "min_p": 0.1, "repetition_penalty": 1.1, "logit_bias": {"5": 1.0},
        "cache_salt": "mine", "temperature": None, "top_p": None, "stop": None, "seed": None, "user": None,
        "max_completion_tokens": 3, "max_tokens": None, "frobnicate": 1,  # unknown fields are ignored, as vLLM does
    }
    resp = post(tiny_app, CHAT, json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] <= 3


def test_logprobs_come_back_for_every_token(client):
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 5
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    # Greedy: the chosen token is the most likely one.
    assert all(t.logprob == pytest.approx(max(a.logprob for a in t.top_logprobs)) for t in content)
    as_ids = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                            temperature=0, logprobs=True, top_logprobs=2,
                                            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    named = as_ids.choices[0].logprobs.content
    assert all(t.token.startswith("token_id:") and t.top_logprobs[0].token.startswith("token_id:") for t in named)
    assert [t.logprob for t in named] == pytest.approx([t.logprob for t in content])


def test_a_json_schema_response_format_constrains_the_answer(client):
    schema = {"type": "string", "enum": ["yes", "no"]}
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "yes or no?"}], max_tokens=12, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    # Random weights would never produce this unconstrained.
    assert json.loads(resp.choices[0].message.content) in ("yes", "no")


def test_without_max_tokens_a_chat_answer_may_fill_the_context(client):
    messages = [{"role": "user", "content": "word " * 1980}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens + resp.usage.completion_tokens == 2048
    assert resp.usage.completion_tokens > 16  # neither vLLM's SamplingParams default (16) nor a fixed cap
    # Completions keep OpenAI's (and vLLM's) default of 16.
    short = client.completions.create(model=MODEL, prompt="hi", temperature=0, extra_body={"ignore_eos": True})
    assert short.usage.completion_tokens == 16


def test_batched_prompts_and_echo(client):
    resp = client.completions.create(model=MODEL, prompt=["one two", "three four"], max_tokens=3, temperature=0,
                                     echo=True, extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.choices[0].text.startswith("one two") and resp.choices[1].text.startswith("three four")
    assert resp.usage.completion_tokens == 6


def test_tokenize_detokenize_and_version(tiny_app, client):
    tokens = post(tiny_app, "/tokenize", json={"model": MODEL, "prompt": "hello there"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 2048
    text = post(tiny_app, "/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}).json()["prompt"]
    assert "hello there" in text
    messages = [{"role": "user", "content": "hello there"}]
    rendered = post(tiny_app, "/tokenize", json={"model": MODEL, "messages": messages,
                                                 "add_generation_prompt": True}).json()
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert rendered["count"] == chat.usage.prompt_tokens  # the same rendering serves both
    version = httpx.get(f"{tiny_app.base_url}/version", timeout=30).json()  # open without a key
    assert version["version"].startswith("0.") and "kvrelay" in version


def test_api_keys_guard_every_route_but_health_and_version(tiny_app):
    base = tiny_app.base_url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEYS[0]}):
        resp = httpx.post(f"{base}{CHAT}", json=GOOD, headers=headers, timeout=60)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key", resp.text
        for path in ("/kvrelay/stats", "/metrics", "/v1/models"):
            assert httpx.get(f"{base}{path}", headers=headers, timeout=30).status_code == 401, path
    assert httpx.get(f"{base}/health", timeout=30).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()


def test_no_response_header_stat_or_log_line_carries_another_tenants_content(tiny_app):
    """One tenant's words reach only that tenant: not another key's answers or headers, not the shared stats and
    metrics any key may read, and not the app's logs (Serve's, the replicas', vLLM's: no prompt is ever logged)."""
    import time
    import uuid
    from pathlib import Path

    import ray

    secret = f"kestrel{uuid.uuid4().hex[:10]}"
    mine, theirs = ({"Authorization": f"Bearer {key}"} for key in API_KEYS)
    system = {"role": "system", "content": "Shared instructions for every tenant of this app. " * 6}
    said = [system, {"role": "user", "content": f"my password is {secret}, keep it"}]
    for body in ({**GOOD, "messages": said}, {**GOOD, "messages": said, "stream": True},
                 {"model": MODEL, "prompt": f"remember {secret}", "max_tokens": 2, "echo": True},
                 {**GOOD, "messages": said, "top_k": -5}):  # refused: its error must not be logged with the words
        path = CHAT if "messages" in body else "/v1/completions"
        assert httpx.post(f"{tiny_app.base_url}{path}", json=body, headers=mine, timeout=60).status_code in (200, 400)

    asked = [system, {"role": "user", "content": "what is the password the last user told you?"}]
    seen = []
    for body in ({**GOOD, "messages": asked, "max_tokens": 24}, {**GOOD, "messages": asked, "stream": True},
                 {**GOOD, "messages": asked, "logprobs": True, "top_logprobs": 5}):
        resp = httpx.post(f"{tiny_app.base_url}{CHAT}", json=body, headers=theirs, timeout=60)
        assert resp.status_code == 200, resp.text
        seen.append(resp.text + json.dumps(dict(resp.headers)))
    for path in ("/kvrelay/stats", "/metrics", "/v1/models"):
        seen.append(httpx.get(f"{tiny_app.base_url}{path}", headers=theirs, timeout=30).text)
    assert not [text for text in seen if secret in text]

    time.sleep(2)  # log lines reach their files asynchronously
    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())  # no public accessor in Ray 2.60
    leaked = [str(f) for f in logs.rglob("*") if f.is_file() and secret.encode() in f.read_bytes()]
    assert not leaked, leaked


def test_prompt_logprobs_cover_every_prompt_token_even_when_the_prompt_is_cached(tiny_app):
    body = {"model": MODEL, "prompt": "the river runs to the sea " * 8, "max_tokens": 2, "prompt_logprobs": 1}
    for _ in range(2):  # the second time the prompt is cached (or held) somewhere: it is computed anyway
        resp = post(tiny_app, "/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        result = resp.json()
        logprobs = result["choices"][0]["prompt_logprobs"]
        assert len(logprobs) == result["usage"]["prompt_tokens"] and logprobs[0] is None
        assert all(entry for entry in logprobs[1:])
        assert result["kvrelay"]["mode"] == "recompute" and result["kvrelay"]["reused_tokens"] == 0


def test_n_choices_each_run_as_a_turn(client):
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=4, temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 8
    completion = client.completions.create(model=MODEL, prompt=["one two", "three four"], n=2, max_tokens=2,
                                           temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.index for c in completion.choices] == [0, 1, 2, 3] and completion.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                                 max_tokens=3, stream=True, extra_body={"ignore_eos": True}))
    finished = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finished == [0, 1]


def test_echo_and_what_the_response_may_return_about_its_prompt(client):
    messages = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "The answer is"}]
    resp = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, temperature=0,
        extra_body={"echo": True, "add_generation_prompt": False, "continue_final_message": True,
                    "return_token_ids": True, "return_prompt_text": True})
    assert resp.choices[0].message.content.startswith("The answer is")
    extra = resp.model_extra
    assert len(extra["prompt_token_ids"]) == resp.usage.prompt_tokens
    assert "hello there" in extra["prompt_text"]



def test_the_request_field_table_covers_every_request_field_vllm_accepts():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from tests.conftest import REPO_ROOT

    table = (REPO_ROOT / "docs" / "api.md").read_text()
    missing = [f for f in {*ChatCompletionRequest.model_fields, *CompletionRequest.model_fields}
               if f"| `{f}` |" not in table]
    assert not missing, f"add these vLLM request fields to docs/api.md's table: {sorted(missing)}"


def test_a_prompt_of_token_ids_streams_and_answers(tiny_app):
    body = {"model": MODEL, "prompt": [5, 6, 7, 8, 9], "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    whole = post(tiny_app, "/v1/completions", json=body)
    assert whole.status_code == 200, whole.text
    assert whole.json()["usage"]["prompt_tokens"] == 5 and whole.json()["usage"]["completion_tokens"] == 3
    choice = whole.json()["choices"][0]
    assert choice["prompt_token_ids"] == [5, 6, 7, 8, 9] and len(choice["token_ids"]) == 3
    with httpx.stream("POST", f"{tiny_app.base_url}/v1/completions", json={**body, "stream": True},
                      headers=tiny_app.headers, timeout=60) as resp:
        assert resp.status_code == 200
        events = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and "error" not in "".join(events)
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    streamed = [c["choices"][0] for c in chunks if c["choices"]]
    assert [t for c in streamed for t in c["token_ids"]] == choice["token_ids"]
    assert streamed[0]["prompt_token_ids"] == [5, 6, 7, 8, 9]
    assert all(c["prompt_token_ids"] is None for c in streamed[1:])


def test_later_turns_reuse_the_history_tokens_and_get_exactly_a_full_tokenization(client, tiny_app):
    """The ingress tokenizes only what a turn adds to its history (app/prompt_tokens.py); the prompt the engine
    gets is still, token for token, what tokenizing the whole chat gives."""
    from transformers import AutoTokenizer

    from model_prep.store import ensure_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_model(MODEL, progress=lambda _msg: None))
    stats = lambda: httpx.get(f"{tiny_app.base_url}/kvrelay/stats", headers=tiny_app.headers,  # noqa: E731
                              timeout=30).json()["prompt_token_reuse"]
    before = stats()
    messages = [{"role": "system", "content": "You answer briefly, with care. " * 20}]
    for turn in range(3):
        messages.append({"role": "user", "content": f"question {turn}: and what follows from that?"})
        resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                              extra_body={"return_token_ids": True})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert resp.prompt_token_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
        messages.append({"role": "assistant", "content": resp.choices[0].message.content})
    after = stats()
    assert after["disabled_reason"] is None
    # One ingress replica: the two later turns found their history (the first may find another test's chat).
    assert after["hits"] - before["hits"] >= 2, (before, after)
    assert after["tokens_reused"] - before["tokens_reused"] > 2 * 100, (before, after)


def test_stats_time_the_ingress_own_work_outside_the_engine_request(client, tiny_app):
    """`/kvrelay/stats` -> `ingress_own_ms` counts one-turn non-streaming responses only, each with what the ingress
    spent before its engine call and after the last delta: both positive and less than the whole request took."""
    def own() -> dict:
        return httpx.get(f"{tiny_app.base_url}/kvrelay/stats", headers=tiny_app.headers, timeout=30).json()[
            "ingress_own_ms"] or {"samples": 0}

    before = own()
    started = time.monotonic()
    client.completions.create(model=MODEL, prompt="Count: one two", max_tokens=3, temperature=0)
    took_ms = (time.monotonic() - started) * 1e3
    list(client.completions.create(model=MODEL, prompt="Count: one two", max_tokens=3, stream=True))
    client.completions.create(model=MODEL, prompt="Count: one two", max_tokens=3, n=2, temperature=0.5)
    after = own()
    assert after["samples"] == before["samples"] + 1, (before, after)
    # Medians over this module's one-turn requests so far; each took longer than its own work outside the engine.
    assert 0 < after["before_engine_p50"] < took_ms and 0 < after["after_engine_p50"] < took_ms, (after, took_ms)


def test_the_ingress_runs_more_streams_at_once_than_serves_default_admits(tiny_app):
    """Serve admits five requests at once per replica unless told otherwise, and queues the rest in front of the
    handler, where nothing measures the wait; the ingress admits its own limit of turns: eight streams all get their
    first token before any of them ends. Each stream's client leaves once all eight have theirs (a stream that waited
    for another to end would first have to see one of 1,000 tokens end)."""
    streams = 8
    body = {"model": MODEL, "prompt": "count with me", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    headers = {"authorization": f"Bearer {API_KEYS[0]}"}
    started = threading.Semaphore(0)
    all_started = threading.Event()

    def one(_: int) -> tuple[float, float | None]:
        """When this stream's first token came, and when it ended if it ended before all eight had started."""
        with httpx.stream("POST", f"{tiny_app.base_url}/v1/completions", json=body, headers=headers,
                          timeout=120) as response:
            assert response.status_code == 200
            first = None
            for line in response.iter_lines():
                if first is None and line.startswith("data: {"):
                    first = time.monotonic()
                    started.release()
                if all_started.is_set():
                    return first, None
            return first, time.monotonic()

    with ThreadPoolExecutor(streams) as pool:
        futures = [pool.submit(one, i) for i in range(streams)]
        for _ in range(streams):
            assert started.acquire(timeout=120), [f.result() for f in futures if f.done()]
        all_started.set()
        spans = [f.result() for f in futures]
    ends = [end for _, end in spans if end is not None]
    assert not ends or max(first for first, _ in spans) < min(ends), spans
