"""Pydantic configuration of a whole kvrelay application: topology, engine pools and ingress.

`serve_config.yaml` passes its `args:` here (through `app.builder.build_app`), so a bad value is
rejected with a precise message before any actor starts.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from configs.engine import EngineConfig
from configs.serve_llm import LLMConfig


class AutoscalingSettings(BaseModel):
    """Scale a pool between min and max replicas on queue depth, KV cache usage and TTFT (app/autoscaling.py)."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int = Field(default=4, ge=1)
    # Targets per replica; the pool grows when any is exceeded and shrinks when all are well below.
    target_ongoing_requests: float = Field(default=4.0, gt=0)
    target_kv_cache_usage: float = Field(default=0.8, gt=0, le=1)
    target_ttft_ms: float = Field(default=2000.0, gt=0)
    # An engine takes tens of seconds to start on CPU: scale up quickly, down reluctantly.
    upscale_delay_s: float = Field(default=5.0, ge=0)
    downscale_delay_s: float = Field(default=60.0, ge=0)
    metrics_interval_s: float = Field(default=1.0, gt=0)
    look_back_period_s: float = Field(default=10.0, gt=0)

    @model_validator(mode="after")
    def _check_bounds(self) -> AutoscalingSettings:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas={self.min_replicas} exceeds max_replicas={self.max_replicas}")
        return self


class OpenAISettings(BaseModel):
    """How the OpenAI endpoints read requests and answer, with vLLM's own front end (app/frontend.py)."""

    model_config = ConfigDict(extra="forbid")

    # The name clients put in `model` (and `/v1/models` lists); None: the engine's `model`.
    served_model_name: str | None = None
    # A Jinja chat template (a file path or the template itself); None: the model's own.
    chat_template: str | None = None
    # vLLM's tool-call parser (e.g. "hermes", "llama3_json"); needed for `tools` with `tool_choice: auto`.
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    # vLLM's reasoning parser (e.g. "deepseek_r1"): moves the model's reasoning into `reasoning_content`.
    reasoning_parser: str | None = None
    # "auto": sampling defaults from the model's generation_config.json, as vLLM's server; "vllm": vLLM's own.
    generation_config: Literal["auto", "vllm"] = "auto"
    # Bearer keys a request must carry. Empty: the endpoint is open (said at start-up). Keys may also come
    # from a file, one per line, named by the environment variable KVRELAY_API_KEYS_FILE.
    api_keys: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check_tools(self) -> OpenAISettings:
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser (e.g. 'hermes')")
        if any(not key.strip() or any(c.isspace() for c in key) for key in self.api_keys):
            raise ValueError("api_keys must be non-empty strings without whitespace")
        return self


class RuntimeEnvSettings(BaseModel):
    """What a pool's Ray runtime environment may set: environment variables of its replicas, which the engine
    processes they start inherit (e.g. UCX's transports for NIXL). Other runtime_env fields (pip, conda, working_dir,
    ...) would give the replicas another environment than the ingress's and are refused."""

    model_config = ConfigDict(extra="forbid")

    env_vars: dict[str, str] = Field(default_factory=dict)


class PoolConfig(BaseModel):
    """One Serve deployment of identical engine replicas."""

    model_config = ConfigDict(extra="forbid")

    # With `autoscaling`, the number of replicas the pool starts with.
    num_replicas: int = Field(default=2, ge=1)
    # Ray resources reserved per replica. vLLM's own processes are not counted by Ray, so on a small
    # CPU box this is a scheduling share, not a core count; on GPU machines set num_gpus=1.
    num_cpus: float = Field(default=0.5, gt=0)
    num_gpus: float = Field(default=0.0, ge=0)
    # At most this many replicas of the pool on one node (Serve's own option), e.g. 1 to spread over nodes.
    max_replicas_per_node: int | None = Field(default=None, ge=1)
    # Ray's accelerator type each replica needs (e.g. "H100", "A10G": a node offering that GPU); needs num_gpus > 0.
    accelerator_type: str | None = None
    runtime_env: RuntimeEnvSettings = Field(default_factory=RuntimeEnvSettings)
    max_ongoing_requests: int = Field(default=32, ge=1)
    # Requests each caller (an ingress replica) queues for this pool beyond those its replicas run; one more gets
    # a 429 with Retry-After at once.
    max_queued_requests: int = Field(default=64, ge=1)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    autoscaling: AutoscalingSettings | None = None

    @model_validator(mode="after")
    def _check_start_within_bounds(self) -> PoolConfig:
        if self.accelerator_type is not None and self.num_gpus == 0:
            raise ValueError(f"accelerator_type={self.accelerator_type!r} needs num_gpus > 0 (e.g. num_gpus: 1)")
        scale = self.autoscaling
        if scale is not None and not scale.min_replicas <= self.num_replicas <= scale.max_replicas:
            raise ValueError(
                f"num_replicas={self.num_replicas} (the starting size) must lie within autoscaling's "
                f"[{scale.min_replicas}, {scale.max_replicas}]"
            )
        return self


class AppConfig(BaseModel):
    """The application `serve run serve_config.yaml` builds."""

    model_config = ConfigDict(extra="forbid")

    name: str = "kvrelay"
    topology: Literal["aggregated", "disaggregated"] = "aggregated"
    # aggregated: every replica prefills and decodes. disaggregated: `pool` prefills, `decode_pool` decodes.
    pool: PoolConfig = Field(default_factory=PoolConfig)
    decode_pool: PoolConfig | None = None
    ingress_num_cpus: float = Field(default=0.1, gt=0)
    # Custom Ray resources the ingress needs: where it runs on a cluster (e.g. {"node:<head IP>": 0.01}).
    ingress_resources: dict[str, float] = Field(default_factory=dict)
    # Turns one ingress replica runs at once; a request beyond them gets 429 with Retry-After at once rather than
    # a place in an unbounded queue.
    ingress_max_turns: int = Field(default=256, ge=1)
    # Time recomputes and pulls on the live replicas at start-up to fit the cost model (kvtransfer/calibration.py).
    # Off, placement starts from the cost model's priors and learns from served turns alone, and the app is ready
    # sooner (for serve_config.yaml's two replicas, `make serve` is ready about a minute after both engines are up on
    # a 2-core Intel Xeon with AMX: test_serve_run's wait).
    calibrate: bool = True
    # How often one turn may move to another replica because the one serving it died (its stream continues there
    # from the tokens already sent); beyond that the client gets an error (0: never move).
    max_migrations: int = Field(default=2, ge=0)
    # How turns are placed: a placement policy's name (`kvtransfer/policies/`, one file each). "kvrelay" plans by
    # measured cost; the others are the routers users would otherwise run, kept for side-by-side benchmarks (a
    # request may also name one in the `x-kvrelay-policy` header). A name rather than an enum, since each policy
    # registers its name in its own file and configs/ imports none of them: `app.builder.build_app` rejects a name
    # no policy has, before any actor starts.
    policy: str = "kvrelay"
    openai: OpenAISettings = Field(default_factory=OpenAISettings)
    # Serve's and vLLM's logging in every deployment. Internal calls (heartbeats, the directory's feed, each turn's
    # engine call) never get access-log lines; the ingress logs one per client request at INFO.
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    # Ray Serve LLM's shape instead of `pool` (configs/serve_llm.py): `llm_configs` as `build_openai_app` takes them
    # (one model per app), or `prefill_config` and `decode_config` as `build_pd_openai_app` does. Mapped onto `pool`,
    # `decode_pool` and `openai` when the config loads, then cleared.
    llm_configs: list[LLMConfig] | None = Field(default=None, min_length=1, max_length=1)
    prefill_config: LLMConfig | None = None
    decode_config: LLMConfig | None = None

    @model_validator(mode="after")
    def _check(self) -> AppConfig:
        self._from_serve_llm()
        self._check_topology()
        return self

    def _from_serve_llm(self) -> None:
        """Map Ray Serve LLM's fields onto kvrelay's (mutates); a field given both ways is refused."""
        given = self.model_fields_set
        if self.llm_configs is not None and (self.prefill_config or self.decode_config):
            raise ValueError("give llm_configs (build_openai_app) or prefill_config and decode_config "
                             "(build_pd_openai_app), not both")
        if (self.prefill_config is None) != (self.decode_config is None):
            raise ValueError("prefill_config and decode_config come together (prefill/decode disaggregation)")
        pools = {"pool": self.llm_configs[0]} if self.llm_configs else {}
        if self.prefill_config is not None:
            pools = {"pool": self.prefill_config, "decode_pool": self.decode_config}
            if "topology" in given and self.topology != "disaggregated":
                raise ValueError("prefill_config and decode_config need topology 'disaggregated'")
            self.topology = "disaggregated"
        if not pools:
            return
        for name in ("pool", "decode_pool"):
            if name in given:
                raise ValueError(f"{name} is set both by Ray Serve LLM's fields and as kvrelay's own: give one")
        openai = pools["pool"].openai_args()
        both = sorted(self.openai.model_fields_set & set(openai))
        if both:
            raise ValueError(f"openai.{', openai.'.join(both)} also set by llm_configs (model_loading_config or "
                             "engine_kwargs): give each once")
        self.openai = OpenAISettings.model_validate({**self.openai.model_dump(exclude_unset=True), **openai})
        for name, llm in pools.items():
            setattr(self, name, PoolConfig.model_validate(llm.pool_args()))
        self.llm_configs = self.prefill_config = self.decode_config = None

    def _check_topology(self) -> None:
        if self.topology == "disaggregated":
            if self.decode_pool is None:
                raise ValueError("topology 'disaggregated' needs a decode_pool")
            if self.decode_pool.engine.model != self.pool.engine.model:
                raise ValueError("prefill and decode pools must serve the same model")
            if not (self.pool.engine.nixl.enabled and self.decode_pool.engine.nixl.enabled):
                raise ValueError("disaggregated serving moves KV over NIXL: enable nixl on both pools")
        elif self.decode_pool is not None:
            raise ValueError("decode_pool is only used with topology 'disaggregated'")

