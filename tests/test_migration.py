"""A turn whose replica dies before its last token continues on another replica: the client sees one stream, each
token once, and under greedy decoding exactly the tokens of an undisturbed run (request migration).

One kill serves both tests (a killed replica takes tens of seconds to come back): the replica dies under a
non-streaming turn it has been running and a stream that has sent its client `STREAMED_BEFORE_KILL` tokens.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass

import httpx
import psutil
import pytest

from app.responses import TurnResult
from kvtransfer.load import preferred_replica
from tests.conftest import ServedApp

MODEL = "tiny-llama"
LONG = {"max_tokens": 600, "temperature": 0.0, "ignore_eos": True}
LONGER = {**LONG, "max_tokens": 1500}
# Tokens the stream's client has read when the replica serving it is killed.
STREAMED_BEFORE_KILL = 8


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(40, 1000) for _ in range(120)]


def replica_processes(app: ServedApp, replica_id: str) -> list[psutil.Process]:
    """A replica's process tree, found by the PID it reports: its Serve actor and the vLLM engine processes it
    started."""
    identities = (app.engines.identity.remote().result() for _ in range(60))  # Serve picks a replica per call
    identity = next(i for i in identities if i.replica_id == replica_id)
    replica = psutil.Process(identity.pid)
    return replica.children(recursive=True) + [replica]


def kill(processes: list[psutil.Process]) -> None:
    for proc in processes:
        proc.kill()
    psutil.wait_procs(processes, timeout=30)


def wait_until_running(app: ServedApp, replica_id: str, since: float, timeout_s: float = 60) -> None:
    """Until a heartbeat of the replica taken after `since` (time.time()) reports a request running there."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = next((r for r in app.ingress.stats.remote().result()["replicas"] if r["replica_id"] == replica_id),
                     None)
        if stats is not None and stats["at"] > since and stats["running"] >= 1:
            return
        assert time.monotonic() < deadline, f"{replica_id} did not report running the turn sent to it: {stats}"
        time.sleep(0.05)


def session_placed_on(replica_id: str, replica_ids: list[str]) -> str:
    """A session id that the session policy places on `replica_id` (rendezvous hashing over the live replicas)."""
    return next(s for s in (f"migration-{i}" for i in range(1000)) if preferred_replica(s, replica_ids) == replica_id)


def reference(app: ServedApp, prompt: list[int], replica_id: str, sampling: dict = LONG) -> list[int]:
    """The undisturbed run: the whole turn computed on one replica."""
    return app.ingress.turn.remote(prompt, sampling, ("recompute", replica_id)).result(timeout_s=300).token_ids


@dataclass
class KilledMidReply:
    """What the clients of two turns saw when the replica serving both was killed."""

    doomed: str
    stream_prompt: list[int]
    streamed: list[int]  # every token the stream delivered, in order
    before_kill: int  # how many of them the client had read when the replica was killed
    events: list[dict]  # the stream's chunks
    answer_prompt: list[int]
    answer: TurnResult  # the non-streaming turn's


@pytest.fixture(scope="module")
def killed_mid_reply(tiny_app) -> KilledMidReply:
    """Kill a replica under two turns: a non-streaming one of LONGER tokens it has been running, then, once the
    stream pinned beside it has sent its client STREAMED_BEFORE_KILL tokens, mid-stream. The engine schedules requests
    first come, first served, so the non-streaming turn has decoded at least as many tokens by then."""
    doomed, survivor = tiny_app.replica_ids(2)[:2]
    processes = replica_processes(tiny_app, doomed)  # found first, so the kill itself waits on nothing
    stream_prompt, answer_prompt = prompt(11), prompt(12)
    sent_at = time.time()
    pending = tiny_app.ingress.turn.remote(answer_prompt, LONGER, ("recompute", doomed))
    wait_until_running(tiny_app, doomed, sent_at)

    # Each chunk names its tokens by id ("token_id:N"), so the test sees exactly which tokens arrived. The session
    # policy places the stream on the doomed replica although it is busy.
    body = {"model": MODEL, "prompt": stream_prompt, "stream": True, "logprobs": 0, "return_tokens_as_token_ids": True,
            "stream_options": {"include_usage": True}, **LONG}
    headers = {**tiny_app.headers, "x-kvrelay-policy": "session",
               "X-Session-Id": session_placed_on(doomed, [doomed, survivor])}
    streamed: list[int] = []
    events: list[dict] = []
    before_kill: int | None = None
    with httpx.stream("POST", f"{tiny_app.base_url}/v1/completions", json=body, headers=headers, timeout=300) as resp:
        assert resp.status_code == 200, resp.read()
        assert json.loads(resp.headers["x-kvrelay-plan"])["replica"] == doomed
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            events.append(event)
            for choice in event.get("choices", []):
                streamed.extend(int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"])
            if before_kill is None and len(streamed) >= STREAMED_BEFORE_KILL:
                before_kill = len(streamed)
                kill(processes)
    assert before_kill is not None, f"the stream ended after {len(streamed)} tokens, before the kill"
    return KilledMidReply(doomed, stream_prompt, streamed, before_kill, events, answer_prompt,
                          pending.result(timeout_s=300))


def test_a_stream_whose_replica_dies_mid_reply_continues_elsewhere_with_every_token_once(tiny_app, killed_mid_reply):
    killed = killed_mid_reply
    # The client had its first tokens before the kill and the rest after it: the reply continued mid-stream.
    assert STREAMED_BEFORE_KILL <= killed.before_kill < len(killed.streamed)
    assert not any("error" in e for e in killed.events), (killed.events[:2], killed.events[-3:])
    last = killed.events[-1]
    assert last["usage"]["completion_tokens"] == LONG["max_tokens"]
    assert last["usage"]["prompt_tokens"] == len(killed.stream_prompt)
    assert "continued on another replica" in last["kvrelay"]["reason"], last["kvrelay"]
    survivor = last["kvrelay"]["replica"]
    assert survivor != killed.doomed
    # Each token once, and the very tokens of an undisturbed run: a retry from the start would repeat the first ones.
    assert killed.streamed == reference(tiny_app, killed.stream_prompt, survivor)
    assert tiny_app.ingress.stats.remote().result()["counters"]["migrations"] >= 1


def test_a_non_streaming_turn_whose_replica_dies_mid_reply_still_answers_in_full(tiny_app, killed_mid_reply):
    answer = killed_mid_reply.answer
    assert "continued on another replica" in answer.kvrelay.reason, answer.kvrelay
    assert answer.kvrelay.replica != killed_mid_reply.doomed
    assert answer.usage.completion_tokens == LONGER["max_tokens"] == len(answer.token_ids)
    assert answer.token_ids == reference(tiny_app, killed_mid_reply.answer_prompt, answer.kvrelay.replica, LONGER)
