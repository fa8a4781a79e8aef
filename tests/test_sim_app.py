"""The real app over simulated engine replicas (`engine.kind: sim`): ingress, directory, mirror and planner as served,
engines modelled (`actors/sim_engine_replica.py`). What is checked is the control plane around the engines: placement,
holds and pulls between replicas, the directory following their KV events. The engine path itself (tokens, NIXL
pulls, fast prefill, migration) is tested on vLLM in the other test files."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from actors.replica_api import GenerateRequest, ReplyParams
from actors.sim_engine_replica import SimEngineReplica
from configs.engine import EngineConfig
from tests.conftest import ServedApp, delete_app, run_app

REPLICAS = 8
# The H100 profile at a quarter of its modelled time: a 16-token reply takes ~25 ms, a pull ~40-110 ms.
SIM_ENGINE = {"kind": "sim", "sim_profile": "h100-llama-3.1-8b", "sim_dilation": 0.25, "model": "tiny-llama",
              "max_model_len": 2048, "nixl": {"hold_ttl_s": 30}}
REPLY = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}


def user_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(40, 1000) for _ in range(n)]


@pytest.fixture(scope="module")
def sim_app(serve_port: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedApp]:
    """Eight simulated replicas (a tenth of a Ray CPU each: they compute no model) behind one ingress. Their model
    folder is not prepared yet (a data directory of their own), as on a fresh install: one of them has it built."""

    data_dir = {"KVRELAY_DATA_DIR": str(tmp_path_factory.mktemp("sim-data"))}
    app = run_app("sim", "/sim", serve_port, pool={"num_replicas": REPLICAS, "num_cpus": 0.1, "engine": SIM_ENGINE,
                                                   "runtime_env": {"env_vars": data_dir}})
    try:
        app.replica_ids(REPLICAS, timeout_s=300)
        app.ingress.calibrated.remote().result(timeout_s=120)
        yield app
    finally:
        delete_app("sim")


def test_a_sim_engine_needs_a_known_profile_and_only_sim_engines_take_one() -> None:
    assert EngineConfig(kind="sim", sim_profile="cpu-smollm2", sim_dilation=2).sim_dilation == 2
    with pytest.raises(ValidationError, match="needs sim_profile"):
        EngineConfig(kind="sim")
    with pytest.raises(ValidationError, match="known: .*h100-llama-3.1-8b"):
        EngineConfig(kind="sim", sim_profile="a100-nothing")
    with pytest.raises(ValidationError, match="set kind: sim"):
        EngineConfig(sim_profile="cpu-smollm2")
    with pytest.raises(ValidationError):
        EngineConfig(kind="sim", sim_profile="cpu-smollm2", sim_dilation=0)
    # A replica validates its pool's config as dumped, every field set: a vLLM engine's passes as it is.
    assert EngineConfig.model_validate(EngineConfig(model="tiny-llama").model_dump()).kind == "vllm"


def test_a_simulated_replica_streams_every_token_to_a_consumer_slower_than_its_steps() -> None:
    """On Serve's throughput-optimized path (`make serve`'s) a replica's stream is resumed only after its engine has
    stepped on: each delta must still bring every token made since the one before. Counted after the yield, the
    tokens made meanwhile were skipped (4-token replies came back with 3, at any position)."""

    async def stream(pause_s: float) -> tuple[list[int], int]:
        replica = SimEngineReplica(SIM_ENGINE)
        request = GenerateRequest(request_id="r", prompt_token_ids=list(range(100, 164)),
                                  params=ReplyParams(max_tokens=12))
        tokens, counted = [], 0
        async for delta in replica.generate(request):
            tokens.extend(delta.token_ids)
            counted = delta.completion_tokens or counted
            await asyncio.sleep(pause_s)  # the consumer holds each delta for several of the engine's decode steps
        return tokens, counted

    prompt_reader, _ = asyncio.run(stream(0.0))
    slow_reader, counted = asyncio.run(stream(0.02))
    assert len(prompt_reader) == 12 and counted == 12
    assert slow_reader == prompt_reader


def test_eight_simulated_replicas_answer_a_conversation_with_a_pull(sim_app: ServedApp) -> None:
    started = time.monotonic()
    replicas = sim_app.replica_ids(REPLICAS)
    rng = random.Random("a conversation of simulated turns")
    history = user_tokens(rng, 400)
    answers = []
    for turn in range(5):
        force = None
        if turn == 2:  # the planner rarely pays a pull's fixed cost on an idle fleet: ask for one
            holder = answers[-1].kvrelay.replica
            force = ("pull", next(r for r in replicas if r != holder))
        answer = sim_app.ingress.turn.remote(history, REPLY, force).result(timeout_s=60)
        assert len(answer.token_ids) == REPLY["max_tokens"] and answer.text, answer
        answers.append(answer)
        history = history + answer.token_ids + user_tokens(rng, 40)
    pulled = answers[2]
    assert pulled.kvrelay.mode == "pull" and pulled.kvrelay.holder == answers[1].kvrelay.replica, pulled.kvrelay
    # Everything the holder held: the previous prompt and all of its reply but the last token.
    assert pulled.kvrelay.reused_tokens == pulled.usage.cached_tokens == 400 + 40 + 2 * 16 - 1
    stats = sim_app.ingress.stats.remote().result(timeout_s=30)
    assert {r.get("time_dilation") for r in stats["replicas"]} == {SIM_ENGINE["sim_dilation"]}
    # Modelled GPUs, each its own: the planner prices no contention between them, though they share this host.
    assert stats["cost_model"]["shared_compute"] is False
    assert stats["counters"].get("pull_failures", 0) == 0
    assert time.monotonic() - started < 60


def test_the_directory_follows_the_simulated_replicas_kv_events(sim_app: ServedApp) -> None:
    rng = random.Random("a history only the directory's events can tell")
    history = user_tokens(rng, 300)
    # Round robin leaves no hold: only the modelled engine's KV cache events can tell the directory.
    first = sim_app.ingress.turn.remote(history, REPLY, policy="round_robin").result(timeout_s=60)
    assert first.kvrelay.mode == "recompute"
    follow_up = history + first.token_ids + user_tokens(rng, 10)
    # On the replica that ran the turn: on an idle fleet of fast modelled engines, recomputing elsewhere costs about
    # the same, so the planner's own choice says little about what the directory knows.
    where = [first.kvrelay.replica]
    plan = None
    for _ in range(40):  # events reach the directory asynchronously
        plan = sim_app.ingress.plan.remote(follow_up, where).result(timeout_s=60)
        if plan["mode"] == "local":
            break
        time.sleep(0.25)
    assert plan is not None and plan["mode"] == "local", plan
    # 300 prompt + 16 generated tokens, the last one's KV not yet computed: 9 full blocks of 32.
    assert plan["reused_tokens"] == 288
    directory = sim_app.ingress.stats.remote().result(timeout_s=30)["directory"]
    assert directory["resident_blocks"] >= 9, directory


def test_a_simulated_replicas_process_has_neither_vllm_nor_torch_after_serving(sim_app: ServedApp) -> None:
    # After turns (the conversation above): unpickling a request with vLLM's SamplingParams would have loaded both,
    # and so would building the model folder in the replica's own process (the fixture's replicas had to).
    sim_app.ingress.turn.remote(user_tokens(random.Random("one more"), 64), REPLY).result(timeout_s=60)
    for replica in sim_app.ingress.stats.remote().result(timeout_s=30)["replicas"]:
        maps = Path(f"/proc/{replica['pid']}/maps").read_text()
        assert "libtorch" not in maps and "/vllm/" not in maps, replica["replica_id"]
