"""Every shipped serve config loads, and the GPU ones ask Ray for what a GPU fleet needs and give each replica's vLLM
the arguments a CUDA platform needs: checked by building the app and the engine arguments, without a GPU."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from actors.engine_site import choose_site, engine_process_env
from actors.vllm_engine import engine_args
from configs.app import AppConfig
from configs.models import HUB_MODELS
from tests.conftest import REPO_ROOT

# Every serve config the repository ships (other YAML under configs/ is not one).
SERVE_CONFIGS = sorted(path for path in [REPO_ROOT / "serve_config.yaml", *(REPO_ROOT / "configs").glob("*.yaml")]
                       if "applications" in yaml.safe_load(path.read_text()))
GPU_CONFIGS = sorted((REPO_ROOT / "configs").glob("gpu_*.yaml"))
# What each GPU config must serve, and how: (topology, model, fast prefill).
EXPECTED = {
    "gpu_aggregated.yaml": ("aggregated", "Qwen/Qwen3-8B", False),
    "gpu_disaggregated.yaml": ("disaggregated", "Qwen/Qwen3-8B", False),
    "gpu_gemma3n.yaml": ("aggregated", "google/gemma-3n-E4B-it", True),
}


def app_args(path: Path) -> dict[str, Any]:
    (application,) = yaml.safe_load(path.read_text())["applications"]
    assert application["import_path"] == "app.builder:build_app"
    return application["args"]


def deployments(app: Any) -> dict[str, Any]:
    """Every Serve deployment of a built application, by name."""
    found: dict[str, Any] = {}
    pending = [app]
    while pending:
        deployment = pending.pop()._bound_deployment
        found[deployment.name] = deployment
        bound = (*deployment.init_args, *deployment.init_kwargs.values())
        pending += [a for a in bound if hasattr(a, "_bound_deployment")]
    return found


def test_the_gpu_configs_are_shipped():
    assert sorted(p.name for p in GPU_CONFIGS) == sorted(EXPECTED)


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_serve_config_loads(path):
    config = AppConfig.model_validate(app_args(path))
    assert config.pool.engine.facts.max_model_len >= config.pool.engine.max_model_len


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.name)
def test_each_replica_requests_one_gpu_and_the_ingress_none(path):
    from app.builder import build_app

    args = app_args(path)
    config = AppConfig.model_validate(args)
    topology, model, fast_prefill = EXPECTED[path.name]
    engine = config.pool.engine
    assert (config.topology, engine.model, engine.fast_prefill) == (topology, model, fast_prefill)
    assert model in HUB_MODELS  # a real model id, checked here without its weights
    built = deployments(build_app(args))
    pools = {"engines": config.pool} | ({"decode_engines": config.decode_pool} if config.decode_pool else {})
    assert set(built) == {"ingress", "kv_directory", *pools}
    for name in ("ingress", "kv_directory"):  # on the head node or any CPU node
        assert built[name].ray_actor_options.get("num_gpus", 0) == 0
    for name, pool in pools.items():
        deployment = built[name]
        options = deployment.ray_actor_options
        assert options["num_gpus"] == 1 and options["num_cpus"] >= 1, options
        # UCX's transports reach the engine processes through the replica's environment.
        env = options["runtime_env"]["env_vars"]
        assert {"cuda_ipc", "cuda_copy", "rc"} <= set(env["UCX_TLS"].split(",")), env
        assert env["UCX_NET_DEVICES"]
        assert deployment._replica_config.max_replicas_per_node == pool.max_replicas_per_node
        scaling = deployment._deployment_config.autoscaling_config
        if pool.autoscaling is None:
            assert deployment.num_replicas == pool.num_replicas and scaling is None
        else:
            assert (scaling.min_replicas, scaling.max_replicas) == (2, 8)
    if path.name == "gpu_aggregated.yaml":  # 8 replicas spread over two nodes at least
        assert (config.pool.num_replicas, config.pool.max_replicas_per_node) == (8, 4)


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.name)
def test_each_replica_gets_cuda_engine_arguments(path):
    from vllm.engine.arg_utils import AsyncEngineArgs

    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    config = AppConfig.model_validate(app_args(path))
    for pool in (config.pool, config.decode_pool):
        if pool is None:
            continue
        engine = pool.engine
        site = choose_site(engine, "engine-a", local_rank=3, node_ip="127.0.0.1", is_cpu=False, report_events=True)
        args = engine_args(engine, Path("/models/weights"), site, "cuda")
        assert set(args) <= known, set(args) - known  # every argument is one vLLM's AsyncEngineArgs has
        assert args["dtype"] == "bfloat16"  # the model's own, never the CPU fallback to fp32
        assert args["kv_cache_memory_bytes"] is None and args["gpu_memory_utilization"] == 0.9
        assert args["enforce_eager"] is False and args["kv_sharing_fast_prefill"] is engine.fast_prefill
        # CUDA runs vLLM's own executor and scheduler: kvrelay's CPU-only in-process executor and quiet scheduler off.
        assert args["distributed_executor_backend"] is None and args["scheduler_cls"] is None
        kv = args["kv_transfer_config"]
        assert (kv["kv_connector"], kv["kv_role"], kv["kv_buffer_device"]) == ("NixlConnector", "kv_both", "cuda")
        extra = kv["kv_connector_extra_config"]
        assert extra["backends"] == ["UCX"] and extra["num_threads"] == 4 and extra["bidirectional_kv_xfer"]
        assert extra["kv_lease_duration"] == 60
        # No CPU pinning on a GPU node; the NIXL side channel on the node's address.
        assert site.cpu_cores is None
        with engine_process_env(site):
            assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
            assert os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    if config.decode_pool is not None:  # decoders batch more sequences, prefill replicas cap a step's tokens
        assert config.decode_pool.engine.max_num_seqs > config.pool.engine.max_num_seqs
        assert config.pool.engine.max_num_batched_tokens == 8192


def test_the_cpu_build_keeps_its_own_engine_arguments():
    """The same function gives the CPU build its fp32 fallback and in-process executor (what `make serve` runs)."""
    config = AppConfig.model_validate(app_args(REPO_ROOT / "serve_config.yaml"))
    engine = config.pool.engine
    site = choose_site(engine, "engine-b", local_rank=0, node_ip="127.0.0.1", is_cpu=True, report_events=False)
    args = engine_args(engine, Path("/models/weights"), site, "cpu", native_bf16=False)
    assert args["kv_cache_memory_bytes"] == 512 * 1024**2 and "gpu_memory_utilization" not in args
    assert args["distributed_executor_backend"] is not None
    assert args["kv_transfer_config"]["kv_buffer_device"] == "cpu"
    assert args["kv_transfer_config"]["kv_connector_extra_config"]["num_threads"] == 0
