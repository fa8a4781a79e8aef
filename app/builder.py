"""Builds the kvrelay Serve application from an `AppConfig`; `serve run`, Python and tests all use it."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

from actors.engine_replica import EngineReplica
from actors.kv_directory import KVDirectoryActor
from actors.sim_engine_replica import SimEngineReplica
from actors.vllm_engine import check_platform_limits
from app.ingress import Ingress
from configs.app import AppConfig, PoolConfig
from kvtransfer.policies import get_policy

ROUTER_CLASS = "actors.replica_router:TargetReplicaRouter"
POLICY_CLASS = "app.autoscaling:EngineAutoscalingPolicy"
# Requests an ingress replica admits beyond its turns (`AppConfig.ingress_max_turns`).
INGRESS_SPARE_REQUESTS = 32


def logging_config(config: AppConfig, internal: bool) -> dict[str, Any]:
    """Serve's logging for a deployment. Deployments only kvrelay itself calls (heartbeats, the directory's feed,
    each turn's generate) log no access line per call, which drowned `serve run`'s console (2.4 lines a second
    idle); the ingress still logs every client request."""
    return {"log_level": config.log_level, "enable_access_log": not internal}


def autoscaling_config(pool: PoolConfig) -> AutoscalingConfig | None:
    """Serve's AutoscalingConfig running kvrelay's policy (app/autoscaling.py), or None for a fixed pool."""
    scale = pool.autoscaling
    if scale is None:
        return None
    return AutoscalingConfig(
        min_replicas=scale.min_replicas,
        max_replicas=scale.max_replicas,
        initial_replicas=pool.num_replicas,
        upscale_delay_s=scale.upscale_delay_s,
        downscale_delay_s=scale.downscale_delay_s,
        metrics_interval_s=scale.metrics_interval_s,
        look_back_period_s=scale.look_back_period_s,
        policy=AutoscalingPolicy(
            policy_function=POLICY_CLASS,
            policy_kwargs={
                "target_ongoing_requests": scale.target_ongoing_requests,
                "target_kv_cache_usage": scale.target_kv_cache_usage,
                "target_ttft_ms": scale.target_ttft_ms,
            },
        ),
    )


def replica_actor_options(pool: PoolConfig) -> dict[str, Any]:
    """Ray's options for each replica of `pool`: its CPUs and GPUs, accelerator type and environment variables."""
    options: dict[str, Any] = {"num_cpus": pool.num_cpus, "num_gpus": pool.num_gpus}
    if pool.accelerator_type is not None:
        options["accelerator_type"] = pool.accelerator_type
    if pool.runtime_env.env_vars:
        options["runtime_env"] = {"env_vars": dict(pool.runtime_env.env_vars)}
    return options


def engine_deployment(
    name: str, pool: PoolConfig, directory: Application, config: AppConfig, hold_key: str
) -> Application:
    """A deployment of identical engine replicas (vLLM engines, or modelled ones for `engine.kind: sim`), routed to the
    replica each plan names; `hold_key` seals the holds they export and checks those they read (one key per app)."""
    replica_class = SimEngineReplica if pool.engine.kind == "sim" else EngineReplica
    scaling = autoscaling_config(pool)
    size: dict[str, Any] = {"num_replicas": pool.num_replicas} if scaling is None else {"autoscaling_config": scaling}
    deployment = serve.deployment(
        replica_class,
        name=name,
        **size,
        max_ongoing_requests=pool.max_ongoing_requests,
        max_queued_requests=pool.max_queued_requests,
        ray_actor_options=replica_actor_options(pool),
        **({"max_replicas_per_node": pool.max_replicas_per_node} if pool.max_replicas_per_node else {}),
        request_router_config=RequestRouterConfig(request_router_class=ROUTER_CLASS),
        health_check_period_s=10,
        health_check_timeout_s=60,
        # An engine needs tens of seconds to start on CPU; Serve must not give up on it.
        graceful_shutdown_timeout_s=30,
        logging_config=logging_config(config, internal=True),
    )
    return deployment.bind(pool.engine.model_dump(), directory, log_level=config.log_level, hold_key=hold_key)


def directory_deployment(config: AppConfig) -> Application:
    """The KV directory: one replica (its state is the single source of holdings), restarted by Serve if it dies."""
    deployment = serve.deployment(
        KVDirectoryActor,
        name="kv_directory",
        num_replicas=1,
        # Every call is a few microseconds of dict work; never make a turn queue behind another.
        max_ongoing_requests=10_000,
        ray_actor_options={"num_cpus": 0.05},
        logging_config=logging_config(config, internal=True),
    )
    ttl = config.pool.engine.nixl.hold_ttl_s
    # Stop offering a hold while there is still time to read it: a read after the holder's lease returns
    # recycled blocks, and nothing in vLLM can tell.
    return deployment.bind(block_size=config.pool.engine.block_size, expiry_margin_s=min(10.0, 0.3 * ttl))


def check_user_model(pool: PoolConfig) -> None:
    """Refuse a user's own model this platform's attention cannot run, before any actor starts (presets are
    checked when they are defined)."""
    facts = pool.engine.facts
    if facts.path is not None and pool.engine.kind == "vllm":
        from vllm.platforms import current_platform

        check_platform_limits(pool.engine, Path(facts.path), current_platform.device_type)


def build_app(args: dict[str, Any] | AppConfig | None = None) -> Application:
    """Serve application builder: `import_path: app.builder:build_app` with `args:` an AppConfig."""
    config = AppConfig.model_validate(args or {})
    get_policy(config.policy)  # a policy name nothing registered is refused here, before any actor starts
    for pool in (config.pool, config.decode_pool):
        if pool is not None:
            check_user_model(pool)
    directory = directory_deployment(config)
    # Replicas read only holds sealed with this key: a hold a client, a bug or another app forged is never read.
    hold_key = secrets.token_hex(16)
    pools: dict[str, Application] = {"engines": engine_deployment("engines", config.pool, directory, config, hold_key)}
    if config.decode_pool is not None:
        decode = config.decode_pool
        if decode.engine.cpu_core_offset == config.pool.engine.cpu_core_offset:
            # Both pools would otherwise pin their first replica to the same core.
            shifted = config.pool.num_replicas * config.pool.engine.cpu_threads
            decode = decode.model_copy(
                update={"engine": decode.engine.model_copy(update={"cpu_core_offset": shifted})}
            )
        pools["decode_engines"] = engine_deployment("decode_engines", decode, directory, config, hold_key)
    # Serve admits `max_ongoing_requests` at once per replica (its default, 5, queued every request beyond five
    # in front of the handler, out of sight: with 10 streaming clients each waited ~2 s before the ingress saw it).
    # The ingress's own limit (`ingress_max_turns`, a 429 at once) governs; the spare room is for requests that
    # are not turns (health, metrics, stats) and streams finishing after their turn.
    ingress = serve.deployment(Ingress, name="ingress",
                               max_ongoing_requests=config.ingress_max_turns + INGRESS_SPARE_REQUESTS,
                               ray_actor_options={"num_cpus": config.ingress_num_cpus,
                                                  "resources": config.ingress_resources},
                               logging_config=logging_config(config, internal=False))
    return ingress.bind(config.model_dump(), directory, **pools)
