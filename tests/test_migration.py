"""A turn whose replica dies before its last token continues on another replica: the client sees one stream, each
token once, and under greedy decoding exactly the tokens of an undisturbed run (request migration)."""

from __future__ import annotations

import json
import random
import time

import httpx
import psutil

from tests.conftest import ServedApp

MODEL = "tiny-llama"
LONG = {"max_tokens": 600, "temperature": 0.0, "ignore_eos": True}


def kill_replica(app: ServedApp, replica_id: str) -> None:
    """SIGKILL a replica's whole process tree by PID (its Serve actor and the vLLM engine processes it started)."""
    identities = (app.engines.identity.remote().result() for _ in range(60))  # Serve picks a replica per call
    identity = next(i for i in identities if i.replica_id == replica_id)
    replica = psutil.Process(identity.pid)
    doomed = replica.children(recursive=True) + [replica]
    for proc in doomed:
        proc.kill()
    psutil.wait_procs(doomed, timeout=30)


def reference(app: ServedApp, prompt: list[int], replica_id: str, sampling: dict = LONG) -> list[int]:
    """The undisturbed run: the whole turn computed on one replica."""
    return app.ingress.turn.remote(prompt, sampling, ("recompute", replica_id)).result(timeout_s=300).token_ids


def test_a_stream_whose_replica_dies_continues_elsewhere_with_every_token_once(tiny_app):
    prompt = [random.Random(11).randrange(40, 1000) for _ in range(120)]
    tiny_app.replica_ids(2)
    # Each chunk names its tokens by id ("token_id:N"), so the test sees exactly which tokens arrived.
    body = {"model": MODEL, "prompt": prompt, "stream": True, "logprobs": 0, "return_tokens_as_token_ids": True,
            "stream_options": {"include_usage": True}, **LONG}
    streamed: list[int] = []
    events: list[dict] = []
    with httpx.stream("POST", f"{tiny_app.base_url}/v1/completions", json=body, headers=tiny_app.headers,
                      timeout=300) as resp:
        assert resp.status_code == 200, resp.read()
        serving = json.loads(resp.headers["x-kvrelay-plan"])["replica"]
        killed = False
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            events.append(event)
            for choice in event.get("choices", []):
                streamed.extend(int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"])
            if not killed and len(streamed) >= 20:
                kill_replica(tiny_app, serving)
                killed = True
    assert killed and not any("error" in e for e in events), (events[:2], events[-3:])
    last = events[-1]
    assert last["usage"]["completion_tokens"] == LONG["max_tokens"] and last["usage"]["prompt_tokens"] == len(prompt)
    assert "continued on another replica" in last["kvrelay"]["reason"], last["kvrelay"]
    assert last["kvrelay"]["replica"] != serving
    survivor = last["kvrelay"]["replica"]
    assert streamed == reference(tiny_app, prompt, survivor)
    assert tiny_app.ingress.stats.remote().result()["counters"]["migrations"] >= 1


def test_a_non_streaming_turn_whose_replica_dies_still_answers_in_full(tiny_app):
    prompt = [random.Random(12).randrange(40, 1000) for _ in range(120)]
    doomed, survivor = tiny_app.replica_ids(2)[:2]
    longer = {**LONG, "max_tokens": 1500}
    pending = tiny_app.ingress.turn.remote(prompt, longer, ("recompute", doomed))
    time.sleep(1.0)  # well into its 1500 tokens
    kill_replica(tiny_app, doomed)
    answer = pending.result(timeout_s=300)
    assert "continued on another replica" in answer.kvrelay.reason, answer.kvrelay
    assert answer.kvrelay.replica != doomed
    assert answer.usage.completion_tokens == longer["max_tokens"] == len(answer.token_ids)
    assert answer.token_ids == reference(tiny_app, prompt, answer.kvrelay.replica, longer)
