"""Autoscaling engine replicas on queue depth, KV cache usage and TTFT: the policy's arithmetic, and a pool that grows
to two under load and shrinks back to one while conversations go on, each phase waited on in Serve's own replica
states, every turn during the shrink equal token for token to a recompute, and the leaving replica's KV gone from the
directory."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from app.autoscaling import EngineAutoscalingPolicy
from tests.conftest import TINY_ENGINE, ServedApp, delete_app, run_app


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


# The policy sizes the pool at ceil(current * the worst observed/target ratio) (app/autoscaling.py). These targets
# leave the ongoing-requests signal alone to decide and make each phase's decision certain, whatever the machine's
# speed: TTFT cannot reach its target (ten minutes), and KV cache usage cannot hold two replicas (that takes a mean
# usage above 0.5 at a target of 1; holds pin at most half a cache, nixl.max_held_fraction, and the shrinking pool's
# conversations hold a few dozen blocks).
#   up:   LOAD_CLIENTS turns always in flight on the one replica: ceil(6 / 2) = 3 replicas, capped at 2;
#   down: one turn at a time on two replicas: ceil(1 / 2) = 1.
SCALING = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2, "target_kv_cache_usage": 1.0,
           "target_ttft_ms": 600_000, "upscale_delay_s": 1, "downscale_delay_s": 10, "metrics_interval_s": 0.5,
           "look_back_period_s": 3}
LOAD_CLIENTS = 6
# Serve's wait for a leaving replica's requests and its __del__ (deregister, stop the engine): app/builder.py.
GRACEFUL_SHUTDOWN_S = 30
GREEDY = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
CHAT_TURNS = 8  # a conversation starts over after this many turns, so histories stay far below max_model_len


@dataclass
class ScalingApp:
    app: ServedApp
    start_s: float  # how long the app took to start with its first engine replica, on this machine, now


@pytest.fixture(scope="module")
def scaling(serve_port):
    started = time.monotonic()
    app = run_app("scaling", "/scaling", serve_port,
                  pool={"num_replicas": 1, "engine": dict(TINY_ENGINE, model="tiny-llama"), "autoscaling": SCALING})
    app.replica_ids(1)
    start_s = time.monotonic() - started
    # The start-up calibration's turns would add to the load of whichever phase they fell in.
    app.ingress.calibrated.remote().result(timeout_s=300)
    yield ScalingApp(app, start_s)
    delete_app("scaling")


def engine_states(app_name: str = "scaling") -> dict[str, int]:
    """Serve's own count of the app's engine replicas by state (STARTING, RUNNING, STOPPING, ...)."""
    from ray import serve

    states = serve.status().applications[app_name].deployments["engines"].replica_states
    return {getattr(state, "value", str(state)): n for state, n in states.items() if n}


def wait_for_states(until, deadline_s: float, why: str) -> dict[str, int]:
    """Poll `engine_states()` until `until(states)` holds; fail with every distinct state seen after `deadline_s`."""
    deadline = time.monotonic() + deadline_s
    seen: list[dict[str, int]] = []
    while True:
        states = engine_states()
        if not seen or seen[-1] != states:
            seen.append(states)
        if until(states):
            return states
        assert time.monotonic() < deadline, f"{why}: not within {deadline_s:.0f} s; Serve's engine replicas went {seen}"
        time.sleep(0.25)


def directory_handle(app_name: str = "scaling") -> Any:
    from ray import serve

    return serve.get_deployment_handle("kv_directory", app_name=app_name)


def holders(directory: Any, tokens: list[int]) -> set[str]:
    """The replicas the KV directory lists as holding a prefix of `tokens` (the turns' scope: tiny-llama, no tenant)."""
    from kvtransfer.prefix_key import Scope

    return {m.replica_id for m in directory.lookup.remote(tokens, Scope("tiny-llama", "")).result().matches}


def ingress_sees_only(app: ServedApp, replica: str, timeout_s: float) -> None:
    """Wait until the ingress's planner lists `replica` alone; fail with what it lists after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (ids := sorted(r["replica_id"] for r in app.ingress.stats.remote().result()["replicas"])) != [replica]:
        assert time.monotonic() < deadline, f"the ingress still plans onto {ids} {timeout_s:.0f} s after the shrink"
        time.sleep(0.25)


class Load:
    """LOAD_CLIENTS threads, each sending a turn of fresh tokens as soon as its previous one is answered."""

    def __init__(self, app: ServedApp) -> None:
        self.app, self.stop, self.failures, self.answered = app, threading.Event(), [], 0
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(LOAD_CLIENTS)]

    def _client(self, worker: int) -> None:
        rng = random.Random(worker)
        sampling = {"max_tokens": 64, "temperature": 0.0, "ignore_eos": True}
        while not self.stop.is_set():
            prompt = [rng.randrange(100, 1000) for _ in range(64)]
            try:
                self.app.ingress.turn.remote(prompt, sampling).result(timeout_s=300)
                self.answered += 1
            except Exception as exc:  # kept for the assertion: a turn under load must not fail
                self.failures.append(repr(exc)[:300])
                return

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(300)


@dataclass
class Conversation:
    """One multi-turn chat in token ids: each turn is the history so far, the reply, then 20 new user tokens."""

    rng: random.Random
    history: list[int] = field(default_factory=list)
    turns: int = 0

    def next_prompt(self) -> list[int]:
        if self.turns % CHAT_TURNS == 0:
            self.history = [self.rng.randrange(40, 1000) for _ in range(150)]  # a new chat
        return self.history

    def answered(self, reply: list[int]) -> None:
        self.turns += 1
        self.history = self.history + reply + [self.rng.randrange(40, 1000) for _ in range(20)]


@dataclass
class Answered:
    conversation: int
    prompt: list[int]
    token_ids: list[int]
    mode: str
    replica: str
    holder: str | None
    reused_tokens: int
    states: dict[str, int]  # Serve's engine replicas by state just before the turn


def take_turn(app: ServedApp, chats: list[Conversation], index: int, force: tuple[str, str] | None = None,
              states: dict[str, int] | None = None) -> Answered:
    prompt = chats[index].next_prompt()
    result = app.ingress.turn.remote(prompt, GREEDY, force).result(timeout_s=300)
    assert len(result.token_ids) == GREEDY["max_tokens"], result
    chats[index].answered(result.token_ids)
    info = result.kvrelay
    return Answered(index, prompt, result.token_ids, info.mode, info.replica, info.holder, info.reused_tokens,
                    states or {})


def test_pool_grows_under_load_and_shrinks_while_conversations_stay_correct(scaling):
    """Up: six turns always in flight on one replica make Serve start a second (RUNNING == 2). Down: conversations
    placed on both replicas go on one turn at a time while Serve stops one (RUNNING == 1, none STOPPING): no turn
    fails, every turn equals a recompute token for token, the leaving replica deregistered itself from the KV directory
    (its holds and cache entries gone, no heartbeat sweep needed), and conversations on the replica that stays keep
    their KV there."""
    app, config = scaling.app, SCALING
    assert engine_states() == {"RUNNING": 1}
    [first] = app.replica_ids(1)
    # Deadlines: Serve's configured reaction (a look-back window of metrics, the delay, a controller tick) plus the
    # replica start time measured above, three times over for the start beside six streams decoding on this machine.
    react_s = config["look_back_period_s"] + 2 * config["metrics_interval_s"]
    up_deadline_s = react_s + config["upscale_delay_s"] + 3 * scaling.start_s
    down_deadline_s = react_s + config["downscale_delay_s"] + GRACEFUL_SHUTDOWN_S + scaling.start_s

    up_started = time.monotonic()
    with Load(app) as load:
        wait_for_states(lambda states: states.get("RUNNING", 0) == 2 or bool(load.failures), up_deadline_s,
                        f"{LOAD_CLIENTS} turns in flight on one replica did not scale the pool up to 2")
    up_s = time.monotonic() - up_started
    assert not load.failures, load.failures[:3]
    assert load.answered > 0
    replicas = app.replica_ids(2, timeout_s=react_s)
    assert first in replicas and len(replicas) == 2, replicas

    # One turn at a time from here on: the policy now wants one replica, and Serve stops one after the downscale delay.
    # Two conversations start on each replica (forced there, before the delay can end), so whichever leaves holds
    # KV of conversations that go on.
    chats = [Conversation(random.Random(seed)) for seed in range(4)]
    placed = [take_turn(app, chats, i, ("recompute", replicas[i % 2])) for i in range(len(chats))]
    assert [a.replica for a in placed] == [replicas[i % 2] for i in range(len(chats))], placed
    answered = list(placed)
    down_started = time.monotonic()
    deadline = down_started + down_deadline_s
    seen: list[dict[str, int]] = []
    while True:
        states = engine_states()
        if not seen or seen[-1] != states:
            seen.append(states)
        if states == {"RUNNING": 1}:  # none starting, stopping or anything else
            break
        assert time.monotonic() < deadline, (
            f"the pool of two did not shrink to one within {down_deadline_s:.0f} s under one turn at a time; "
            f"Serve's engine replicas went {seen}")
        answered += [take_turn(app, chats, i, states=states) for i in range(len(chats))]
    down_s = time.monotonic() - down_started

    # The replica that left deregistered from the directory in its __del__, before Serve reported it gone: the
    # directory lists only the survivor, holds none for the leaver, and counts the departure as a leave, not as
    # a replica that went silent.
    directory = directory_handle()
    live = [identity.replica_id for identity in directory.replica_identities.remote().result()]
    assert len(live) == 1 and live[0] in replicas, live
    (survivor,) = live
    (left,) = set(replicas) - {survivor}
    figures = directory.stats.remote().result()
    assert figures.replicas == 1 and left not in figures.holds_by_replica, figures
    assert figures.replicas_left >= 1 and figures.replicas_silent == 0, figures
    directory.check_integrity.remote().result()
    listed = [holders(directory, a.prompt + a.token_ids) for a in answered]
    assert not any(left in h for h in listed), f"KV of {sum(left in h for h in listed)} turns still listed on {left}"
    assert any(survivor in h for a, h in zip(answered, listed, strict=True) if a.replica == survivor), (
        f"the directory lists none of the survivor's turns either: {listed[:4]}")
    assert any(a.replica == left for a in answered), f"no conversation ran on {left} before it left"
    # The ingress plans from its mirror of the directory, a change feed behind it (a 2 s long poll).
    ingress_sees_only(app, survivor, timeout_s=10)

    # After the shrink every conversation goes on, on the survivor. Those whose last turn ran there kept their KV
    # (the turn reuses it); those whose last turn ran on the leaver are served from what the survivor holds, if
    # anything, never planned onto the leaver or pulled from it.
    last_replica = {a.conversation: a.replica for a in answered}
    after = [take_turn(app, chats, i, states=engine_states()) for i in range(len(chats))]
    for turn in after:
        assert turn.replica == survivor and turn.holder in (None, survivor), turn
        if last_replica[turn.conversation] == survivor and chats[turn.conversation].turns % CHAT_TURNS != 1:
            assert turn.mode == "local" and turn.reused_tokens > 0, turn
    answered += after

    # Every turn since the pool stopped growing, against a recompute of its prompt on the survivor.
    wrong = []
    for turn in answered:
        reference = app.ingress.turn.remote(turn.prompt, GREEDY, ("recompute", survivor)).result(timeout_s=300)
        if reference.token_ids != turn.token_ids:
            wrong.append((turn, reference.token_ids))
    assert not wrong, f"{len(wrong)} of {len(answered)} turns differ from a recompute, first: {wrong[0]}"
    print(f"start {scaling.start_s:.1f} s, up {up_s:.1f} s (deadline {up_deadline_s:.0f}), down {down_s:.1f} s "
          f"(deadline {down_deadline_s:.0f}), {load.answered} load turns, {len(answered)} conversation turns checked "
          f"({sum(a.replica == left for a in answered)} on the replica that left), after the shrink "
          f"{[(a.mode, a.reused_tokens) for a in after]}, states seen {seen}")
