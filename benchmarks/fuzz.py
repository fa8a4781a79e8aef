"""Property-based requests against a live app: whatever a client sends, the answer is never a 5xx and never plain
text, and the app keeps answering correctly afterwards.

Hypothesis draws each request from the shapes of the OpenAI routes (chat, completions, tokenize, detokenize, models):
real fields with values of every JSON type and edge (nulls, negatives, huge integers, empty strings, deep nesting),
unknown fields, fields kvrelay refuses, bodies that are not JSON objects or not JSON at all. Generation stays short
(small `max_tokens` where a request would otherwise decode for long), so the run measures the front door.

    python -m benchmarks.fuzz --n 1000 --out benchmarks/results/fuzz.json

starts a tiny-llama app (two replicas, two API keys) and writes the counts; `tests/test_fuzz.py` runs a bounded
version against the test session's app.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from benchmarks.common import write_result

# Values of every JSON type, weighted towards the edges a validator must catch.
SCALARS = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2**31, 2**63, -(2**63), 2**64]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40), st.sampled_from(["", " ", "\x00", "null", "[]", "\ud7ff" * 3]),
)
JSON = st.recursive(SCALARS, lambda children: st.one_of(
    st.lists(children, max_size=4), st.dictionaries(st.text(max_size=10), children, max_size=4)), max_leaves=12)

ROLES = st.sampled_from(["system", "user", "assistant", "developer", "tool", "function", "", "robot"])
CONTENT = st.one_of(st.text(max_size=60), st.none(), JSON,
                    st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "bogus"]),
                                                    "text": st.text(max_size=30)}), max_size=3))
MESSAGE = st.one_of(st.fixed_dictionaries({"role": ROLES, "content": CONTENT}), JSON)
MESSAGES = st.one_of(st.lists(MESSAGE, min_size=1, max_size=4),
                     st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=60)}),
                              min_size=1, max_size=3),
                     JSON)
PROMPT = st.one_of(st.text(max_size=80), st.lists(st.integers(min_value=-5, max_value=70000), max_size=20),
                   st.lists(st.text(max_size=20), max_size=3), JSON)
SHORT = st.integers(min_value=-3, max_value=8)  # max_tokens values that keep generation short

# Always sent, never null: an unset max_tokens lets a chat answer fill the context, which would make the run about
# decoding (`tests/test_http.py` covers that default).
MAX_TOKENS = st.one_of(SHORT, SCALARS.filter(lambda v: v is not None))
# The sampling and shaping fields both endpoints share, each with plausible and hostile values.
COMMON_FIELDS: dict[str, st.SearchStrategy] = {
    "temperature": st.one_of(st.floats(min_value=-1, max_value=3), SCALARS),
    "top_p": st.one_of(st.floats(min_value=-0.5, max_value=1.5), SCALARS),
    "top_k": st.one_of(st.integers(min_value=-10, max_value=100), SCALARS),
    "min_p": st.one_of(st.floats(min_value=-1, max_value=2), SCALARS),
    "min_tokens": st.one_of(SHORT, SCALARS),
    "n": st.one_of(st.integers(min_value=-1, max_value=3), SCALARS),
    "seed": SCALARS,
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=3), SCALARS),
    "stop_token_ids": st.one_of(st.lists(st.integers(min_value=-5, max_value=70000), max_size=3), SCALARS),
    "logprobs": SCALARS,
    "top_logprobs": st.one_of(st.integers(min_value=-2, max_value=30), SCALARS),
    "prompt_logprobs": st.one_of(st.integers(min_value=-2, max_value=5), SCALARS),
    "logit_bias": st.one_of(st.dictionaries(st.text(max_size=6), st.floats(allow_nan=False, allow_infinity=False),
                                            max_size=3), JSON),
    "presence_penalty": SCALARS, "frequency_penalty": SCALARS, "repetition_penalty": SCALARS,
    "ignore_eos": SCALARS, "stream": st.one_of(st.booleans(), SCALARS),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), JSON),
    "response_format": st.one_of(st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "nope"},
                                                  {"type": "json_schema", "json_schema": {"name": "x"}}]), JSON),
    "user": SCALARS, "cache_salt": SCALARS, "priority": SCALARS, "request_id": SCALARS,
    "kv_transfer_params": JSON, "use_beam_search": SCALARS, "echo": SCALARS,
    "allowed_token_ids": st.one_of(st.lists(st.integers(min_value=-5, max_value=70000), max_size=3), SCALARS),
    "bad_words": st.one_of(st.lists(st.text(max_size=5), max_size=3), SCALARS),
    "truncate_prompt_tokens": st.one_of(st.integers(min_value=-3, max_value=5000), SCALARS),
    "structured_outputs": JSON, "vllm_xargs": JSON,
    "an_unknown_field": JSON,
}
CHAT_FIELDS = {
    **COMMON_FIELDS,
    "max_completion_tokens": MAX_TOKENS,
    "tools": st.one_of(st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": st.text(min_size=1, max_size=8), "parameters": st.just({"type": "object"})})}), max_size=2), JSON),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]), JSON),
    "parallel_tool_calls": SCALARS, "chat_template": SCALARS, "chat_template_kwargs": JSON,
    "add_generation_prompt": SCALARS, "continue_final_message": SCALARS, "documents": JSON,
}
COMPLETION_FIELDS = {**COMMON_FIELDS, "suffix": SCALARS}


def _body(required: dict[str, st.SearchStrategy], optional: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    return st.fixed_dictionaries(required, optional=optional)


# (method, path, body): a body of None is sent without one; bytes are sent as they are.
REQUESTS = st.one_of(
    st.tuples(st.just("POST"), st.just("/v1/chat/completions"),
              _body({"model": st.one_of(st.just("MODEL"), SCALARS), "messages": MESSAGES, "max_tokens": MAX_TOKENS},
                    CHAT_FIELDS)),
    st.tuples(st.just("POST"), st.just("/v1/completions"),
              _body({"model": st.one_of(st.just("MODEL"), SCALARS), "prompt": PROMPT, "max_tokens": MAX_TOKENS},
                    COMPLETION_FIELDS)),
    st.tuples(st.just("POST"), st.sampled_from(["/v1/chat/completions", "/v1/completions", "/tokenize",
                                                "/detokenize"]),
              st.one_of(JSON, st.binary(max_size=40), st.just(b"{"), st.just(b"\xff\xfe"))),
    st.tuples(st.just("POST"), st.just("/tokenize"),
              st.one_of(_body({"model": st.just("MODEL"), "prompt": PROMPT}, {"add_special_tokens": SCALARS}),
                        _body({"model": st.just("MODEL"), "messages": MESSAGES}, {"add_generation_prompt": SCALARS}))),
    st.tuples(st.just("POST"), st.just("/detokenize"),
              _body({"model": st.just("MODEL"), "tokens": st.one_of(st.lists(st.integers(-5, 2**40), max_size=8),
                                                                        JSON)}, {})),
    st.tuples(st.sampled_from(["GET", "DELETE", "PUT"]),
              st.sampled_from(["/v1/models", "/health", "/version", "/nope", "/v1/chat/completions"]), st.none()),
)


@dataclass
class FuzzReport:
    requests: int = 0
    statuses: Counter = field(default_factory=Counter)
    # Responses a client cannot read as OpenAI's error or answer: any 5xx, any body that is not JSON (streams aside).
    server_errors: list[dict[str, Any]] = field(default_factory=list)
    not_json: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {"requests": self.requests, "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
                "server_errors": len(self.server_errors), "not_json": len(self.not_json),
                "examples": (self.server_errors + self.not_json)[:10], "seconds": round(self.seconds, 1)}


def _send(client: httpx.Client, method: str, path: str, body: Any, model: str) -> httpx.Response:
    if isinstance(body, dict) and body.get("model") == "MODEL":
        body = {**body, "model": model}
    if body is None:
        return client.request(method, path)
    if isinstance(body, bytes):
        return client.request(method, path, content=body, headers={"content-type": "application/json"})
    return client.request(method, path, content=json.dumps(body), headers={"content-type": "application/json"})


def _check(report: FuzzReport, method: str, path: str, body: Any, resp: httpx.Response) -> None:
    report.requests += 1
    report.statuses[resp.status_code] += 1
    shown = {"method": method, "path": path, "body": repr(body)[:300], "status": resp.status_code,
             "response": resp.text[:300]}
    if resp.status_code >= 500:
        report.server_errors.append(shown)
    streamed = resp.headers.get("content-type", "").startswith("text/event-stream")
    if streamed:  # an SSE stream ends with [DONE]; a failure of ours inside it is a server error too
        if not resp.text.rstrip().endswith("data: [DONE]"):
            report.not_json.append(shown)
        if '"type":"server_error"' in resp.text.replace(" ", ""):
            report.server_errors.append(shown)
        return
    try:
        json.loads(resp.text)
    except ValueError:
        report.not_json.append(shown)


def fuzz(base_url: str, headers: dict[str, str], model: str, n: int, rng_seed: int = 0,
         timeout_s: float = 120) -> FuzzReport:
    """Send `n` drawn requests (deterministic for a seed) and count what came back."""
    report = FuzzReport()
    started = time.monotonic()
    with httpx.Client(base_url=base_url, headers=headers, timeout=timeout_s) as client:

        @seed(rng_seed)
        @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(request=REQUESTS)
        def one(request: tuple[str, str, Any]) -> None:
            method, path, body = request
            _check(report, method, path, body, _send(client, method, path, body, model))

        one()
    report.seconds = time.monotonic() - started
    return report


def answers_correctly(base_url: str, headers: dict[str, str], model: str, expected: list[int] | None) -> list[int]:
    """A fixed greedy completion's token ids (health first): equal before and after the fuzz when `expected`."""
    with httpx.Client(base_url=base_url, headers=headers, timeout=120) as client:
        assert client.get("/health").status_code == 200
        body = {"model": model, "prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        resp = client.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        tokens = resp.json()["choices"][0]["token_ids"]
    assert len(tokens) == 8 and (expected is None or tokens == expected), (tokens, expected)
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from benchmarks.common import start_app, stop_app
    from model_prep.store import ensure_model

    ensure_model(args.model)
    key = "fuzz-key"
    app = start_app(args.model, pool={"engine": {"dtype": "float32", "max_model_len": 2048,
                                                 "kv_cache_memory_bytes": 64 * 1024**2}},
                    app={"openai": {"api_keys": [key]}})
    try:
        headers = {"Authorization": f"Bearer {key}"}
        before = answers_correctly(app.base_url, headers, args.model, None)
        report = fuzz(app.base_url, headers, args.model, args.n, args.seed)
        answers_correctly(app.base_url, headers, args.model, before)
    finally:
        stop_app(app)
    result = {"n": args.n, "seed": args.seed, "model": args.model, **report.summary(),
              "healthy_and_same_answer_after": True}
    print(json.dumps(result, indent=2))
    write_result(args.out, result)


if __name__ == "__main__":
    main()
