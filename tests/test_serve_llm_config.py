"""A Ray Serve LLM user's config (`LLMConfig` fields) loads as kvrelay's own, and every field kvrelay cannot honour is
refused by name when the app is built, before any actor starts. (tests/test_user_model.py runs an app configured
this way and chats with it.)"""

from __future__ import annotations

import copy

import pytest
import yaml
from pydantic import ValidationError

from configs.app import AppConfig
from tests.conftest import REPO_ROOT
from tests.test_user_model import TOOL_TEMPLATE, serve_llm_config, write_config

MiB = 1024**2


def test_the_chat_apps_serve_llm_config_is_kvrelays_own_config(tmp_path):
    """What the test app's Ray Serve LLM shape means, written in kvrelay's own fields."""
    mine = str(write_config(tmp_path / "mine"))
    native = {
        "pool": {"num_replicas": 1, "num_cpus": 0.5, "num_gpus": 0,
                 "runtime_env": {"env_vars": {"KVRELAY_TEST_MARK": "1"}},
                 "engine": {"model": mine, "dtype": "float32", "kv_cache_memory_bytes": 64 * MiB,
                            "max_model_len": 1024, "enforce_eager": True}},
        "openai": {"served_model_name": "my-model", "tool_call_parser": "hermes", "enable_auto_tool_choice": True,
                   "chat_template": TOOL_TEMPLATE},
    }
    mapped = AppConfig.model_validate(serve_llm_config(mine))
    assert mapped == AppConfig.model_validate(native)
    assert mapped.llm_configs is None  # mapped, then cleared: the dump the ingress receives loads the same
    assert AppConfig.model_validate(mapped.model_dump()) == mapped


def test_the_shipped_serve_llm_config_is_the_readmes_side_by_side():
    (application,) = yaml.safe_load((REPO_ROOT / "configs/ray_serve_llm_qwen3.yaml").read_text())["applications"]
    native = {
        "policy": "kvrelay",
        "pool": {
            # Ray Serve LLM gives each replica one GPU and starts at min_replicas.
            "num_replicas": 2, "num_gpus": 1, "num_cpus": 1, "accelerator_type": "H100",
            "autoscaling": {"min_replicas": 2, "max_replicas": 8, "target_ongoing_requests": 16},
            "runtime_env": {"env_vars": {"UCX_TLS": "rc,cuda_ipc,cuda_copy"}},
            # Left out, vLLM's meaning: the cache sized from gpu_memory_utilization, CUDA graphs on.
            "engine": {"model": "Qwen/Qwen3-8B", "max_model_len": 32768, "gpu_memory_utilization": 0.9,
                       "kv_cache_memory_bytes": None, "enforce_eager": False},
        },
        "openai": {"served_model_name": "qwen3-8b"},
    }
    assert AppConfig.model_validate(application["args"]) == AppConfig.model_validate(native)


def test_build_pd_openai_apps_prefill_and_decode_configs_are_a_disaggregated_app():
    llm = serve_llm_config("tiny-llama")["llm_configs"][0]
    decode = copy.deepcopy(llm) | {"deployment_config": {"num_replicas": 3}}
    config = AppConfig.model_validate({"prefill_config": llm, "decode_config": decode})
    assert config.topology == "disaggregated"
    assert (config.pool.num_replicas, config.decode_pool.num_replicas) == (1, 3)
    assert config.decode_pool.engine.model == config.pool.engine.model == "tiny-llama"


UNSUPPORTED = [
    # (where in the LLMConfig, the field, its value): each has no kvrelay equivalent.
    ((), "lora_config", {"max_num_adapters_per_replica": 4}),
    ((), "accelerator_config", {"type": "tpu"}),
    ((), "server_cls", "my.Server"),
    ((), "experimental_configs", {"stream_batching_interval_ms": 50}),
    ((), "callback_config", {"callback_class": "my.Callback"}),
    (("engine_kwargs",), "quantization", "fp8"),
    (("engine_kwargs",), "speculative_config", {"method": "ngram"}),
    (("engine_kwargs",), "tensor_parallel_size", 2),
    (("runtime_env",), "pip", ["numpy"]),
    (("runtime_env",), "working_dir", "."),
    (("deployment_config",), "ray_actor_options", {"num_cpus": 2}),
    (("deployment_config", "autoscaling_config"), "upscaling_factor", 2.0),
    (("model_loading_config",), "tokenizer_source", "other/tokenizer"),
]


@pytest.mark.parametrize(("where", "field", "value"), UNSUPPORTED, ids=lambda v: v if isinstance(v, str) else None)
def test_each_unsupported_field_is_refused_by_name_before_anything_starts(where, field, value):
    from app.builder import build_app

    args = serve_llm_config("tiny-llama")
    section = args["llm_configs"][0]
    for name in where:
        section = section.setdefault(name, {})
    section[field] = value
    with pytest.raises(ValidationError) as refused:
        build_app(args)  # no Ray cluster here: the refusal comes from loading the config
    message = str(refused.value)
    assert field in message and "not supported by kvrelay" in message, message
    assert ".".join(("llm_configs", "0", *where)) in message, message


def test_other_builders_arguments_and_engines_are_refused_by_name():
    args = serve_llm_config("tiny-llama")
    with pytest.raises(ValidationError, match="ingress_deployment_config"):
        AppConfig.model_validate(args | {"ingress_deployment_config": {"num_replicas": 2}})
    args["llm_configs"][0]["llm_engine"] = "SGLang"
    with pytest.raises(ValidationError, match="llm_engine"):
        AppConfig.model_validate(args)


def test_one_model_per_app_and_no_field_given_twice():
    llm = serve_llm_config("tiny-llama")["llm_configs"][0]
    with pytest.raises(ValidationError, match="at most 1 item"):
        AppConfig.model_validate({"llm_configs": [llm, llm]})
    with pytest.raises(ValidationError, match="pool is set both"):
        AppConfig.model_validate({"llm_configs": [llm], "pool": {"num_replicas": 2}})
    with pytest.raises(ValidationError, match="openai.tool_call_parser"):
        AppConfig.model_validate({"llm_configs": [llm], "openai": {"tool_call_parser": "llama3_json"}})
    # kvrelay's own fields beside them are fine.
    assert AppConfig.model_validate({"llm_configs": [llm], "openai": {"api_keys": ["k"]}}).openai.api_keys == ["k"]
