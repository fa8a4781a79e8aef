"""The real default model (SmolLM2-135M-Instruct, converted from its PyPI GGUF) answers a chat question."""

from __future__ import annotations

import uuid

import pytest

from actors.engine_replica import EngineReplica
from actors.replica_api import GenerateRequest, Sampling
from configs.engine import EngineConfig, NixlSettings
from configs.models import DEFAULT_MODEL
from tests.conftest import collect


@pytest.fixture(scope="module")
def default_replica(loop_thread):
    replica = EngineReplica(
        EngineConfig(
            model=DEFAULT_MODEL,
            # As serve_config.yaml serves it: bf16 flips this answer on CPUs with AMX.
            dtype="float32",
            max_model_len=1024,
            kv_cache_memory_bytes=128 * 1024**2,
            nixl=NixlSettings(enabled=False),
        )
    )
    yield replica
    replica.engine.shutdown()


def test_default_model_knows_the_capital_of_france(loop_thread, default_replica):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = loop_thread.run(default_replica.apply_chat_template(messages))
    request = GenerateRequest(
        request_id=uuid.uuid4().hex, prompt_token_ids=ids, params=Sampling(max_tokens=24, temperature=0.0).to_params()
    )
    deltas = loop_thread.run(collect(default_replica.generate(request)))
    answer = "".join(d.text for d in deltas)
    assert "Paris" in answer, answer
