"""Serving the user's own model: a local HF model directory or a repo id in the local HF cache, checked before
anything starts, answering under the name the user gives it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import TINY_ENGINE, delete_app, run_app


def write_config(folder: Path, **overrides) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128,
              "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "intermediate_size": 256, "vocab_size": 512, "max_position_embeddings": 1024, "torch_dtype": "float32"}
    (folder / "config.json").write_text(json.dumps({**config, **overrides}))
    return folder


def test_a_repo_id_resolves_offline_from_the_local_hf_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants

    from configs.models import model_facts, user_model_dir

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--acme--tiny"
    snapshot = write_config(repo / "snapshots" / commit, max_position_embeddings=777)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert user_model_dir("acme/tiny") == snapshot
    facts = model_facts("acme/tiny")
    assert facts.max_model_len == 777 and facts.head_dim == 64 and facts.dtype == "float32" and not facts.kv_sharing
    with pytest.raises(ValueError, match="local HF cache"):
        user_model_dir("acme/not-downloaded")


def test_impossible_user_models_are_refused_before_anything_starts(tmp_path):
    from app.builder import build_app

    def app_with(model: Path, **engine):
        return build_app({"pool": {"num_replicas": 1, "engine": {"model": str(model), **engine}}})

    odd_heads = write_config(tmp_path / "odd", hidden_size=96)  # head size 48: no CPU attention kernel
    with pytest.raises(ValueError, match="head size 48"):
        app_with(odd_heads, max_model_len=512)
    plain = write_config(tmp_path / "plain")
    with pytest.raises(ValueError, match="exceeds what"):
        app_with(plain, max_model_len=4096)
    with pytest.raises(ValueError, match="KV-sharing layers"):
        app_with(plain, max_model_len=512, kv_sharing_fast_prefill=True)
    with pytest.raises(ValueError, match="not a preset"):
        app_with(tmp_path / "nothing-here", max_model_len=512)


# A chat template that renders tools, tool calls and tool results the way vLLM's hermes parser reads them. The
# model behind it has random weights: this checks the plumbing (template, constrained decoding, parser), not a
# model's judgement about when to call.
TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": ...}"
    "</tool_call>. Tools:\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}{{ eos_token }}\n{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message.get('tool_calls') %}{% for call in message['tool_calls'] %}<tool_call>\n"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}\n</tool_call>"
    "{% endfor %}{% else %}{{ message['content'] }}{% endif %}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def serve_llm_config(model_source: str) -> dict:
    """The app's `args` as a Ray Serve LLM user writes them for `build_openai_app` (configs/serve_llm.py), on CPU."""
    engine_kwargs = {key: TINY_ENGINE[key] for key in ("dtype", "kv_cache_memory_bytes")} | {"enforce_eager": True}
    return {"llm_configs": [{
        "model_loading_config": {"model_id": "my-model", "model_source": model_source},
        "placement_group_config": {"bundles": [{"CPU": 0.5}]},
        "deployment_config": {"num_replicas": 1},
        "runtime_env": {"env_vars": {"KVRELAY_TEST_MARK": "1"}},
        "engine_kwargs": {**engine_kwargs, "max_model_len": 1024, "tool_call_parser": "hermes",
                          "enable_auto_tool_choice": True, "chat_template": TOOL_TEMPLATE},
    }]}


def test_a_users_model_directory_configured_as_in_ray_serve_llm_serves_under_its_own_name(serve_port, tmp_path):
    from model_prep.store import ensure_model

    mine = tmp_path / "my-model"
    shutil.copytree(ensure_model("tiny-llama"), mine)  # any HF model folder; this one is small
    # The model's own sampling defaults apply, as in vLLM's server.
    (mine / "generation_config.json").write_text(json.dumps({"max_new_tokens": 5, "eos_token_id": 2}))
    app = run_app("mine", "/mine", serve_port, **serve_llm_config(str(mine)))
    try:
        models = httpx.get(f"{app.base_url}/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in models] == ["my-model"]
        body = {"model": "my-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        resp = httpx.post(f"{app.base_url}/v1/chat/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        assert resp.json()["model"] == "my-model" and resp.json()["usage"]["completion_tokens"] == 3
        default = httpx.post(f"{app.base_url}/v1/chat/completions", timeout=120,
                             json={"model": "my-model", "messages": body["messages"], "ignore_eos": True}).json()
        assert default["usage"]["completion_tokens"] == 5, default  # generation_config's max_new_tokens
        wrong = httpx.post(f"{app.base_url}/v1/chat/completions", json={**body, "model": "tiny-llama"}, timeout=60)
        assert wrong.status_code == 404
        tool_call_round_trip(openai.OpenAI(base_url=f"{app.base_url}/v1", api_key="none", max_retries=0))
    finally:
        delete_app("mine")


def tool_call_round_trip(client) -> None:
    """A named tool choice: vLLM constrains the output to the tool's call and its parser reads it back (random
    weights would never produce it on their own); then the tool's result goes back and the model answers."""
    city = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
    # strict: vLLM then constrains the arguments to the schema too (without it, to any JSON).
    tools = [{"type": "function", "function": {"name": "weather", "parameters": city, "strict": True}}]
    messages = [{"role": "user", "content": "what is the weather in the capital of france?"}]
    call = client.chat.completions.create(model="my-model", messages=messages, tools=tools, max_tokens=200,
                                          tool_choice={"type": "function", "function": {"name": "weather"}})
    tool_calls = call.choices[0].message.tool_calls
    assert [t.function.name for t in tool_calls] == ["weather"], call
    assert json.loads(tool_calls[0].function.arguments) in ({"city": "Paris"}, {"city": "Rome"}), tool_calls
    messages += [call.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": tool_calls[0].id, "content": "sunny, 21 degrees"}]
    answer = client.chat.completions.create(model="my-model", messages=messages, tools=tools, tool_choice="none",
                                            max_tokens=4)
    assert answer.choices[0].message.content is not None and not answer.choices[0].message.tool_calls
    assert answer.usage.prompt_tokens > call.usage.prompt_tokens
