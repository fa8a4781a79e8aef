"""Engine replicas on real vLLM engines (fp32, eager, greedy): fast prefill, attention groups, bad input."""

from __future__ import annotations

import uuid

import pytest
import torch

from actors.engine_replica import EngineReplica
from actors.replica_api import GenerateRequest, InvalidRequestError, Sampling
from configs.engine import EngineConfig, NixlSettings
from model_prep.store import ensure_model
from tests.conftest import collect

MiB = 1024**2
PROMPTS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, this is a test of the engine replica",
    "once upon a time there was a small model that could",
]
NEW_TOKENS = 12


def tiny_config(model: str, **overrides) -> EngineConfig:
    return EngineConfig(
        model=model,
        dtype="float32",
        max_model_len=1024,
        kv_cache_memory_bytes=64 * MiB,
        enforce_eager=True,
        # These tests do not transfer KV; a connector would only add start-up time.
        nixl=NixlSettings(enabled=False),
        **overrides,
    )


@pytest.fixture(scope="module")
def gemma_fast(loop_thread):
    replica = EngineReplica(tiny_config("tiny-gemma3n", kv_sharing_fast_prefill=True))
    yield replica
    replica.engine.shutdown()


@pytest.fixture(scope="module")
def gemma_plain(loop_thread):
    replica = EngineReplica(tiny_config("tiny-gemma3n", kv_sharing_fast_prefill=False, cpu_core_offset=1))
    yield replica
    replica.engine.shutdown()


def greedy(loop_thread, replica: EngineReplica, prompt_ids: list[int], n: int = NEW_TOKENS) -> list[int]:
    request = GenerateRequest(
        request_id=uuid.uuid4().hex,
        prompt_token_ids=prompt_ids,
        params=Sampling(max_tokens=n, temperature=0.0, ignore_eos=True).to_params(),
    )
    deltas = loop_thread.run(collect(replica.generate(request)))
    assert deltas[-1].finished and deltas[-1].completion_tokens == n
    return [t for d in deltas for t in d.token_ids]


def hf_greedy(model_dir, prompt_ids: list[int], n: int = NEW_TOKENS) -> list[int]:
    """Reference: plain argmax decoding with HF transformers, recomputing the full sequence each step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(n):
            next_id = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, len(prompt_ids) :].tolist()


def test_fast_prefill_matches_plain_and_transformers(loop_thread, gemma_fast, gemma_plain):
    for text in PROMPTS:
        ids = loop_thread.run(gemma_fast.tokenize(text))
        fast = greedy(loop_thread, gemma_fast, ids)
        plain = greedy(loop_thread, gemma_plain, ids)
        reference = hf_greedy(ensure_model("tiny-gemma3n"), ids)
        assert fast == plain == reference, text


def attention_groups(loop_thread, replica) -> list[dict]:
    """The live worker's (rank 0) attention groups, read through vLLM's collective RPC and kvrelay's worker
    extension: {"kv_cache_group", "backend", "layer_names"} each."""
    return loop_thread.run(replica.engine.collective_rpc("kvrelay_attention_groups"))[0]


def test_fast_prefill_groups_hold_exactly_the_kv_sharing_layers(loop_thread, gemma_fast, gemma_plain):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(ensure_model("tiny-gemma3n"))
    first_shared = cfg.num_hidden_layers - cfg.num_kv_shared_layers
    shared = {f"layers.{i}." for i in range(first_shared, cfg.num_hidden_layers)}

    def layer_key(name: str) -> str:
        return "layers." + name.split("layers.")[1].split(".")[0] + "."

    fast_groups = attention_groups(loop_thread, gemma_fast)
    fast_layers = {layer_key(n) for g in fast_groups if "FastPrefill" in g["backend"] for n in g["layer_names"]}
    other_layers = {layer_key(n) for g in fast_groups if "FastPrefill" not in g["backend"] for n in g["layer_names"]}
    assert fast_layers == shared
    assert not (other_layers & shared)
    assert len(fast_layers | other_layers) == cfg.num_hidden_layers

    plain_groups = attention_groups(loop_thread, gemma_plain)
    assert plain_groups and not any("FastPrefill" in g["backend"] for g in plain_groups)


def test_prompt_logprobs_on_fast_prefill_is_a_clear_error_and_replica_keeps_serving(loop_thread, gemma_fast):
    ids = loop_thread.run(gemma_fast.tokenize(PROMPTS[0]))
    bad = GenerateRequest(
        request_id=uuid.uuid4().hex, prompt_token_ids=ids, params=Sampling(max_tokens=4, prompt_logprobs=1).to_params()
    )
    with pytest.raises(InvalidRequestError, match="prompt_logprobs.*fast prefill"):
        loop_thread.run(collect(gemma_fast.generate(bad)))
    assert len(greedy(loop_thread, gemma_fast, ids, n=4)) == 4


def test_prompt_logprobs_work_without_fast_prefill(loop_thread, gemma_plain):
    ids = loop_thread.run(gemma_plain.tokenize(PROMPTS[1]))
    ok = GenerateRequest(
        request_id=uuid.uuid4().hex, prompt_token_ids=ids, params=Sampling(max_tokens=2, prompt_logprobs=1).to_params()
    )
    deltas = loop_thread.run(collect(gemma_plain.generate(ok)))
    assert deltas[-1].finished


def test_prompt_longer_than_context_is_a_clear_error(loop_thread, gemma_plain):
    too_long = GenerateRequest(
        request_id=uuid.uuid4().hex, prompt_token_ids=[5] * 1020, params=Sampling(max_tokens=16).to_params()
    )
    with pytest.raises(InvalidRequestError, match="exceeds this model's context of 1024"):
        loop_thread.run(collect(gemma_plain.generate(too_long)))


def test_stats_report_load_and_measured_speed(loop_thread, gemma_plain):
    ids = loop_thread.run(gemma_plain.tokenize(" ".join(PROMPTS) * 4))
    greedy(loop_thread, gemma_plain, ids, n=8)
    stats = loop_thread.run(gemma_plain.stats())
    assert stats.running == 0 and stats.waiting == 0
    assert stats.prefill_tok_s is not None and stats.prefill_tok_s > 0
    assert stats.decode_tok_s is not None and stats.decode_tok_s > 0
    assert stats.requests_finished >= 1
    # The same prompt again is a full-block prefix cache hit.
    greedy(loop_thread, gemma_plain, ids, n=2)
    assert loop_thread.run(gemma_plain.stats()).prefix_cache_hit_rate > 0


def test_impossible_engine_configs_are_refused_before_start():
    with pytest.raises(ValueError, match="not a preset"):
        EngineConfig(model="no-such-model")
    with pytest.raises(ValueError, match="KV-sharing layers"):
        EngineConfig(model="tiny-llama", kv_sharing_fast_prefill=True)
    with pytest.raises(ValueError, match="extra"):
        EngineConfig(model="tiny-llama", max_len=5)
