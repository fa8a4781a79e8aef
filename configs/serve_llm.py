"""Ray Serve LLM's `LLMConfig` shape, read as kvrelay's own config: what `AppConfig` accepts as `llm_configs` (the
`args` of `ray.serve.llm:build_openai_app`) or `prefill_config` / `decode_config` (those of `build_pd_openai_app`).

Each supported field maps onto a kvrelay field (`pool_args`, `openai_args`); any other is refused by name when the
config loads, before any actor starts, rather than silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# vLLM engine arguments kvrelay sets from `engine_kwargs`, under the same names, on `EngineConfig` ...
ENGINE_KWARGS = frozenset({
    "dtype", "max_model_len", "kv_cache_memory_bytes", "gpu_memory_utilization", "block_size", "enforce_eager",
    "enable_prefix_caching", "kv_sharing_fast_prefill", "max_num_seqs", "max_num_batched_tokens", "seed",
})
# vLLM's own defaults of those where kvrelay's differ for the CPU build: the KV cache sized from
# gpu_memory_utilization, and CUDA graphs / torch.compile on.
VLLM_DEFAULTS = {"kv_cache_memory_bytes": None, "enforce_eager": False}
# ... and on `OpenAISettings` (vLLM's OpenAI server options that Ray Serve LLM also reads from engine_kwargs).
OPENAI_KWARGS = frozenset({
    "chat_template", "tool_call_parser", "enable_auto_tool_choice", "reasoning_parser", "generation_config",
})
# Accepted with only the value kvrelay runs: one GPU per replica, and kvrelay's own NIXL connector.
ONE_DEVICE_KWARGS = frozenset({"tensor_parallel_size", "pipeline_parallel_size"})
KV_TRANSFER_KWARG = "kv_transfer_config"
RUNTIME_ENV_FIELDS = frozenset({"env_vars"})
BUNDLE_RESOURCES = frozenset({"CPU", "GPU"})


def refuse_unknown(data: Any, allowed: set[str] | frozenset[str], where: str, why: str) -> None:
    """Raise, naming them, for keys of the mapping `data` outside `allowed`."""
    if isinstance(data, dict):
        unknown = sorted(set(data) - set(allowed))
        if unknown:
            raise ValueError(f"{where}: {', '.join(unknown)} not supported by kvrelay ({why}); "
                             f"supported: {', '.join(sorted(allowed))}")


class _Strict(BaseModel):
    """Refuses unknown fields by name (the message lists the supported ones)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        refuse_unknown(data, set(cls.model_fields), cls.__name__, "no kvrelay equivalent")
        return data


class ModelLoadingConfig(_Strict):
    """Which model: `model_id` is the name clients use, `model_source` the weights (a HF repo id or a folder)."""

    model_id: str
    model_source: str | None = None


class LLMAutoscalingConfig(_Strict):
    """Serve's autoscaling_config fields that kvrelay's autoscaling (`AutoscalingSettings`) shares."""

    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int = Field(default=1, ge=1)
    initial_replicas: int | None = Field(default=None, ge=1)
    target_ongoing_requests: float | None = Field(default=None, gt=0)
    upscale_delay_s: float | None = Field(default=None, ge=0)
    downscale_delay_s: float | None = Field(default=None, ge=0)
    metrics_interval_s: float | None = Field(default=None, gt=0)
    look_back_period_s: float | None = Field(default=None, gt=0)


class LLMDeploymentConfig(_Strict):
    """Serve deployment options of the engine replicas."""

    num_replicas: int | None = Field(default=None, ge=1)
    autoscaling_config: LLMAutoscalingConfig | None = None
    max_ongoing_requests: int | None = Field(default=None, ge=1)
    max_queued_requests: int | None = Field(default=None, ge=1)
    max_replicas_per_node: int | None = Field(default=None, ge=1)


class PlacementGroupConfig(_Strict):
    """One replica's resources as one bundle (kvrelay runs one engine process group per replica, one device)."""

    bundles: list[dict[str, float]] | None = None
    bundle_per_worker: dict[str, float] | None = None
    strategy: str | None = None

    @model_validator(mode="after")
    def _one_bundle(self) -> PlacementGroupConfig:
        bundles = self.bundles if self.bundles is not None else [self.bundle_per_worker or {}]
        if len(bundles) != 1:
            raise ValueError(f"placement_group_config: {len(bundles)} bundles; kvrelay runs one engine worker per "
                             "replica (tensor_parallel_size 1): give one bundle")
        refuse_unknown(bundles[0], BUNDLE_RESOURCES, "placement_group_config bundle", "a replica takes CPUs and GPUs")
        return self

    @property
    def bundle(self) -> dict[str, float]:
        return self.bundles[0] if self.bundles is not None else (self.bundle_per_worker or {})


class LLMConfig(_Strict):
    """Ray Serve LLM's `LLMConfig`, the fields kvrelay maps; one model per kvrelay app."""

    model_loading_config: ModelLoadingConfig
    llm_engine: Literal["vLLM"] = "vLLM"
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    accelerator_type: str | None = None
    placement_group_config: PlacementGroupConfig | None = None
    deployment_config: LLMDeploymentConfig = Field(default_factory=LLMDeploymentConfig)
    runtime_env: dict[str, Any] | None = None
    # kvrelay always exports the engines' metrics (`/metrics`, labelled by replica).
    log_engine_metrics: Literal[True] | None = None

    @field_validator("engine_kwargs")
    @classmethod
    def _check_engine_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        allowed = ENGINE_KWARGS | OPENAI_KWARGS | ONE_DEVICE_KWARGS | {KV_TRANSFER_KWARG}
        refuse_unknown(kwargs, allowed, "engine_kwargs", "kvrelay sets the engine's other arguments itself")
        for name in ONE_DEVICE_KWARGS & set(kwargs):
            if kwargs[name] != 1:
                raise ValueError(f"engine_kwargs: {name}={kwargs[name]} not supported by kvrelay: one GPU per replica")
        connector = (kwargs.get(KV_TRANSFER_KWARG) or {}).get("kv_connector", "NixlConnector")
        if connector != "NixlConnector":
            raise ValueError(f"engine_kwargs: kv_transfer_config with {connector!r} not supported by kvrelay, which "
                             "moves KV with its own NixlConnector settings (engine.nixl)")
        return kwargs

    @field_validator("runtime_env")
    @classmethod
    def _check_runtime_env(cls, env: dict[str, Any] | None) -> dict[str, Any] | None:
        refuse_unknown(env, RUNTIME_ENV_FIELDS, "runtime_env", "the replicas run in the app's own environment")
        return env

    def pool_args(self) -> dict[str, Any]:
        """kvrelay's `PoolConfig` fields. Without a placement group a replica takes one GPU, as in Ray Serve LLM."""
        bundle = self.placement_group_config.bundle if self.placement_group_config else {"GPU": 1, "CPU": 1}
        deployment = self.deployment_config
        # Where kvrelay's defaults suit CPUs, an engine argument left out means what it means to vLLM.
        engine = {**VLLM_DEFAULTS, **{k: v for k, v in self.engine_kwargs.items() if k in ENGINE_KWARGS}}
        engine["model"] = self.model_loading_config.model_source or self.model_loading_config.model_id
        pool: dict[str, Any] = {"engine": engine, "num_gpus": bundle.get("GPU", 0)}
        if "CPU" in bundle:
            pool["num_cpus"] = bundle["CPU"]
        if self.accelerator_type is not None:
            pool["accelerator_type"] = self.accelerator_type
        if self.runtime_env:
            pool["runtime_env"] = self.runtime_env
        for name in ("max_ongoing_requests", "max_queued_requests", "max_replicas_per_node"):
            if getattr(deployment, name) is not None:
                pool[name] = getattr(deployment, name)
        scaling = deployment.autoscaling_config
        if scaling is not None:
            pool["num_replicas"] = scaling.initial_replicas or deployment.num_replicas or scaling.min_replicas
            pool["autoscaling"] = scaling.model_dump(exclude={"initial_replicas"}, exclude_none=True)
        elif deployment.num_replicas is not None:
            pool["num_replicas"] = deployment.num_replicas
        return pool

    def openai_args(self) -> dict[str, Any]:
        """kvrelay's `OpenAISettings` fields: the name clients use and vLLM's OpenAI server options."""
        return {"served_model_name": self.model_loading_config.model_id,
                **{k: v for k, v in self.engine_kwargs.items() if k in OPENAI_KWARGS}}
