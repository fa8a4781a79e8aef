"""Per-turn plans executed for real: NIXL pulls between replicas, recompute, edited history, a dead holder.

Each conversation is run twice through the ingress's turn path: once with every turn forced to recompute
(the reference), once with every turn after the first pulled from the replica that ran the previous
turn. Greedy fp32 decoding must give identical tokens.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace

import pytest

from actors.engine_replica import EngineReplica
from actors.replica_api import GenerateRequest, Sampling
from configs.engine import EngineConfig, NixlSettings
from tests.conftest import ServedApp, collect

GREEDY = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
TURNS = 4


def user_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(40, 1000) for _ in range(n)]


def converse(app: ServedApp, mode: str, seed: int) -> list[list[int]]:
    """A 4-turn conversation; `mode` "pull" alternates replicas and pulls, "stay" keeps every turn on the replica
    holding the history (which reads its own hold), "recompute" recomputes all."""
    rng = random.Random(seed)
    replicas = app.replica_ids(2)
    history = user_tokens(rng, 150)
    replies = []
    held = 0
    for turn in range(TURNS):
        target = replicas[0] if mode == "stay" else replicas[turn % 2]
        later = {"pull": "pull", "stay": "local"}.get(mode, "recompute")
        force = ("recompute" if turn == 0 else later, target)
        result = app.ingress.turn.remote(history, GREEDY, force).result(timeout_s=120)
        assert result.kvrelay.mode == force[0], result.kvrelay
        assert result.kvrelay.replica == target
        if force[0] == "pull":
            assert result.kvrelay.holder == replicas[(turn - 1) % 2]
            # The engine reports the pulled tokens as cached: all but the last token of the prior turn.
            assert result.usage.cached_tokens >= len(history) - 40
        if force[0] == "local":
            # Every held token, the last partial block included: its own hold, read in memory.
            assert result.usage.cached_tokens == result.kvrelay.reused_tokens == held, result.kvrelay
        replies.append(result.token_ids)
        held = len(history) + len(result.token_ids) - 1
        history = history + result.token_ids + user_tokens(rng, 20)
    return replies


def test_pulls_give_the_same_tokens_as_recompute_on_tiny_llama(tiny_app):
    assert converse(tiny_app, "pull", seed=1) == converse(tiny_app, "recompute", seed=1)


def test_turns_that_stay_on_the_holder_give_the_same_tokens_as_recompute(tiny_app):
    assert converse(tiny_app, "stay", seed=7) == converse(tiny_app, "recompute", seed=7)


def test_planner_reuses_the_history_on_its_own(tiny_app):
    rng = random.Random(3)
    history = user_tokens(rng, 300)
    first = tiny_app.ingress.turn.remote(history, GREEDY).result(timeout_s=120)
    history = history + first.token_ids + user_tokens(rng, 10)
    second = tiny_app.ingress.turn.remote(history, GREEDY).result(timeout_s=120)
    assert second.kvrelay.mode in ("local", "pull")
    assert second.usage.cached_tokens >= 288
    assert set(second.kvrelay.estimates_ms) >= {"recompute", second.kvrelay.mode}
    # The response says when the ingress saw the first token, within the turn's own latency.
    assert 0 < second.kvrelay.ttft_ms == pytest.approx(second.ttft_ms, abs=0.01) and second.ttft_ms < second.latency_ms


def test_edited_history_is_recomputed_and_still_right(tiny_app):
    rng = random.Random(4)
    history = user_tokens(rng, 200)
    first = tiny_app.ingress.turn.remote(history, GREEDY).result(timeout_s=120)
    edited = list(history)
    edited[3] = edited[3] + 1  # the client rewrote an early message
    edited = edited + first.token_ids + user_tokens(rng, 10)
    answer = tiny_app.ingress.turn.remote(edited, GREEDY).result(timeout_s=120)
    assert answer.kvrelay.mode == "recompute" and answer.kvrelay.reused_tokens == 0
    target = answer.kvrelay.replica
    reference = tiny_app.ingress.turn.remote(edited, GREEDY, ("recompute", target)).result(timeout_s=120)
    assert answer.token_ids == reference.token_ids


KEY = "test-hold-key"  # what the app's builder gives every replica of one app


def direct_replica(model: str, core: int, hold_key: str = KEY) -> EngineReplica:
    return EngineReplica(EngineConfig(
        model=model, dtype="float32", max_model_len=1024, kv_cache_memory_bytes=64 * 1024**2,
        nixl=NixlSettings(enforce_handshake_compat=False), cpu_core_offset=core), hold_key=hold_key)


def generate(loop_thread, replica: EngineReplica, ids: list[int], pull=None, own_kv_only=False, own_hold=False):
    req = GenerateRequest(request_id=uuid.uuid4().hex, prompt_token_ids=ids, params=Sampling(**GREEDY).to_params(),
                          pull=pull, own_hold=own_hold, export_hold=not own_kv_only, skip_prefix_cache=own_kv_only)
    return loop_thread.run(collect(replica.generate(req)))


def first_turn(loop_thread, holder: EngineReplica, rng: random.Random, prompt_tokens: int):
    """A first turn on `holder`: its hold, its reply, and the next turn's prompt (history plus 20 new tokens)."""
    prompt = user_tokens(rng, prompt_tokens)
    turn = generate(loop_thread, holder, prompt)
    reply = [t for d in turn for t in d.token_ids]
    return turn[-1].hold, reply, prompt + reply + user_tokens(rng, 20)


@pytest.fixture(scope="module")
def puller() -> Iterator[EngineReplica]:
    """The replica that reads the holds of the next tests' holders (each test starts its own holder)."""
    replica = direct_replica("tiny-llama", 1)
    yield replica
    replica.engine.shutdown()


def test_a_pulled_kv_really_comes_from_the_holder(loop_thread, puller):
    """A holder with other weights (handshake checks off) changes the puller's output: the KV moved."""
    holder = direct_replica("tiny-llama-alt", 0)
    try:
        rng = random.Random(5)
        hold, reply, follow_up = first_turn(loop_thread, holder, rng, 200)
        assert hold.num_tokens == 200 + len(reply) - 1
        pulled = generate(loop_thread, puller, follow_up, pull=hold)
        # The puller's prefix cache now holds the pulled blocks: compute its own answer from scratch.
        own = generate(loop_thread, puller, follow_up, own_kv_only=True)
        assert pulled[-1].num_cached_tokens == hold.num_tokens
        assert [t for d in pulled for t in d.token_ids] != [t for d in own for t in d.token_ids]
    finally:
        holder.engine.shutdown()


def test_a_replica_reads_only_holds_sealed_for_exactly_its_prompts_tokens(loop_thread, puller):
    """vLLM's connector reads whatever blocks a hold names. A hold with other block ids, another engine's id, another
    hold's id, a seal from another app, or tokens that differ from the prompt's is refused before any read (a failed
    pull, which the turn runner recomputes); only the hold as its holder sealed it, into a prompt starting with its
    tokens, is read (by another replica, once; by the holder itself, in memory)."""
    from actors.replica_api import HoldRelease, InvalidRequestError

    holder = direct_replica("tiny-llama", 0)
    try:
        rng = random.Random(9)
        hold, _, follow_up = first_turn(loop_thread, holder, rng, 200)
        edited = list(follow_up)
        edited[50] = edited[50] + 1  # one token of the held history differs
        forged = {
            "other blocks": replace(hold, block_ids=[[b + 1 for b in group] for group in hold.block_ids]),
            "another engine": replace(hold, engine_id=puller.engine_id),
            "another hold's id": replace(hold, hold_id=hold.hold_id._replace(serial=hold.hold_id.serial + 1)),
            "unsealed": replace(hold, seal=None),
            "another app's key": hold.sealed(b"another-app", follow_up),
        }
        for name, bad in forged.items():
            refused = generate(loop_thread, puller, follow_up, pull=bad)
            assert len(refused) == 1 and refused[0].finish_reason == "error" and not refused[0].token_ids, name
        refused = generate(loop_thread, puller, edited, pull=hold)
        assert refused[0].finish_reason == "error" and not refused[0].token_ids
        with pytest.raises(InvalidRequestError):
            loop_thread.run(puller.release_hold(HoldRelease(hold=forged["other blocks"], target_replica="x")))
        # Nothing was read: the genuine hold is still whole and pulls every token it holds.
        pulled = generate(loop_thread, puller, follow_up, pull=hold)
        assert pulled[-1].finish_reason != "error" and pulled[-1].num_cached_tokens == hold.num_tokens
        # A turn that stays on the holder reads its own hold in memory: every held token, the last partial block
        # included, which vLLM's prefix cache does not keep (counting only the cache, pulling the history away looked
        # faster and a lone conversation moved on every turn). The answer is the one computed from scratch.
        own, _, follow_own = first_turn(loop_thread, holder, rng, 203)
        assert own.num_tokens % holder.config.block_size, "the check needs a partial last block"
        # Each hold is named by the id its replica minted at export: the holder's engine and a serial.
        assert own.hold_id.engine_id == hold.hold_id.engine_id == holder.engine_id
        assert own.hold_id.serial > hold.hold_id.serial
        stays = generate(loop_thread, holder, follow_own, pull=own)
        assert stays[-1].finish_reason != "error" and stays[-1].num_cached_tokens == own.num_tokens
        scratch = generate(loop_thread, puller, follow_own, own_kv_only=True)
        assert scratch[-1].num_cached_tokens == 0
        assert [t for d in stays for t in d.token_ids] == [t for d in scratch for t in d.token_ids]
        # A turn meant to stay on its holder that Serve sends elsewhere (the holder is draining) is computed there,
        # never pulled from the holder.
        again = stays[-1].hold
        moved = generate(loop_thread, puller, follow_own + [t for d in stays for t in d.token_ids] + [7] * 20,
                         pull=again, own_hold=True)
        assert moved[-1].finish_reason != "error" and moved[-1].num_cached_tokens < again.num_tokens
        # Read once: the puller's notice frees a hold at the holder's next step (within nixl.hold_step_s), after
        # which the holder itself can no longer read it.
        time.sleep(4 * holder.config.nixl.hold_step_s)
        gone = generate(loop_thread, holder, follow_up, pull=hold)
        assert gone[-1].finish_reason == "error" and not gone[-1].token_ids
    finally:
        holder.engine.shutdown()


def test_dead_holder_means_recompute_and_its_entries_are_dropped(tiny_app):
    import psutil

    rng = random.Random(6)
    replicas = tiny_app.replica_ids(2)
    history = user_tokens(rng, 300)
    holder, target = replicas
    first = tiny_app.ingress.turn.remote(history, GREEDY, ("recompute", holder)).result(timeout_s=120)
    history = history + first.token_ids + user_tokens(rng, 10)

    # Kill the holder's whole process tree by PID: the Serve replica and the vLLM engine processes it
    # started (engine processes outlive a killed Ray actor and would keep serving its KV).
    identity = next(i for i in (tiny_app.engines.identity.remote().result() for _ in range(60))
                    if i.replica_id == holder)
    replica_process = psutil.Process(identity.pid)
    doomed = replica_process.children(recursive=True) + [replica_process]
    for proc in doomed:
        proc.kill()
    psutil.wait_procs(doomed, timeout=30)
    answer = tiny_app.ingress.turn.remote(history, GREEDY, ("pull", target)).result(timeout_s=120)
    reference = tiny_app.ingress.turn.remote(history, GREEDY, ("recompute", target)).result(timeout_s=120)
    assert answer.token_ids == reference.token_ids
    assert answer.kvrelay.mode == "recompute" and "pull failed" in answer.kvrelay.reason
    stats = tiny_app.ingress.stats.remote().result()
    assert stats["counters"]["pull_failures"] >= 1
    assert holder not in {r["replica_id"] for r in stats["replicas"]}


def test_the_directory_follows_each_replicas_prefix_cache_through_kv_events(tiny_app):
    rng = random.Random("a history no other test sends")  # the apps are shared: a seen prefix would be cached
    history = user_tokens(rng, 200)
    # Round robin leaves no hold behind: only the engine's KV cache events can tell the directory.
    first = tiny_app.ingress.turn.remote(history, GREEDY, policy="round_robin").result(timeout_s=120)
    assert first.kvrelay.mode == "recompute"
    follow_up = history + first.token_ids + user_tokens(rng, 10)
    plan = None
    for _ in range(40):  # events reach the directory asynchronously, within milliseconds
        plan = tiny_app.ingress.plan.remote(follow_up).result(timeout_s=60)
        if plan["mode"] == "local":
            break
        time.sleep(0.25)
    assert plan["mode"] == "local" and plan["replica"] == first.kvrelay.replica, plan
    # 200 prompt + 12 generated tokens: the 6 full blocks of 32 the engine cached.
    assert plan["reused_tokens"] == 192
    answer = tiny_app.ingress.turn.remote(follow_up, GREEDY).result(timeout_s=120)
    assert answer.usage.cached_tokens == 192  # the engine agrees


def test_a_turn_is_answered_at_its_last_token_and_the_engine_stream_is_still_read_to_its_end(serve_port, directory):
    """A response waits for the engine's last token, not for Serve to close the engine's stream (2-3 ms of gRPC and
    replica work on this machine); the stream is read to its end afterwards, so the replica's request ends as it
    would have. The engine here is a stand-in deployment, the only way to hold a stream open after its last token:
    it says so through a latch actor. The Serve handle, the directory and the turn path are the real ones."""
    import asyncio

    import ray
    from ray import serve
    from vllm.sampling_params import SamplingParams

    from actors.replica_api import GenerateDelta
    from app.directory_mirror import DirectoryMirror
    from app.turn_types import Turn
    from app.turns import TurnRunner
    from kvtransfer.cost_model import CostModel
    from kvtransfer.options import Mode
    from tests.conftest import DIRECTORY_BLOCK_SIZE
    from tests.test_directory_mirror import identity, stats

    @ray.remote(num_cpus=0)
    class Latch:
        def __init__(self) -> None:
            self.opened = asyncio.Event()
            self.ended = 0

        async def wait(self) -> None:
            await self.opened.wait()

        async def open(self) -> None:
            self.opened.set()

        async def end(self) -> None:
            self.ended += 1

        async def ends(self) -> int:
            return self.ended

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class EngineWithASlowEnd:
        def __init__(self, latch) -> None:
            self.latch = latch

        async def generate(self, request: GenerateRequest):
            yield GenerateDelta(token_ids=[7], text="", finished=True, finish_reason="length",
                                prompt_tokens=len(request.prompt_token_ids), completion_tokens=1, replica_id="slow-end")
            await self.latch.wait.remote()
            await self.latch.end.remote()

    latch = Latch.remote()
    name = f"slow-end-{uuid.uuid4().hex[:6]}"
    serve.run(EngineWithASlowEnd.bind(latch), name=name, route_prefix=None)
    engines = serve.get_deployment_handle("EngineWithASlowEnd", app_name=name)

    async def scenario() -> None:
        mirror = DirectoryMirror(directory, DIRECTORY_BLOCK_SIZE)
        mirror.start()
        await directory.heartbeat.remote(identity("slow-end"), stats("slow-end"))
        deadline = time.monotonic() + 30
        while not mirror.live():
            assert time.monotonic() < deadline, "the mirror never saw the replica"
            await asyncio.sleep(0.05)
        runner = TurnRunner(engines, mirror, CostModel(1024), "m", DIRECTORY_BLOCK_SIZE, 30.0, 1)
        turn = Turn(request_id=uuid.uuid4().hex, token_ids=list(range(1, 9)), params=SamplingParams(max_tokens=1))
        deltas = await asyncio.wait_for(collect(runner.run(turn, (Mode.RECOMPUTE, "slow-end"))), 60)
        assert [d.token_ids for d, _ in deltas] == [[7]] and deltas[-1][0].finished
        assert await latch.ends.remote() == 0  # answered while the engine's stream was still open
        await latch.open.remote()
        deadline = time.monotonic() + 30
        while await latch.ends.remote() == 0:  # read to its end, not cancelled
            assert time.monotonic() < deadline, "the engine's stream was dropped rather than read to its end"
            await asyncio.sleep(0.05)

    try:
        asyncio.run(scenario())
    finally:
        serve.delete(name)
        ray.kill(latch)
