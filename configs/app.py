"""Pydantic configuration of a whole kvrelay application: topology, engine pools and ingress.

`serve_config.yaml` passes its `args:` here (through `app.builder.build_app`), so a bad value is
rejected with a precise message before any actor starts.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from configs.engine import EngineConfig


class PoolConfig(BaseModel):
    """One Serve deployment of identical engine replicas."""

    model_config = ConfigDict(extra="forbid")

    num_replicas: int = Field(default=2, ge=1)
    # Ray resources reserved per replica. vLLM's own processes are not counted by Ray, so on a small
    # CPU box this is a scheduling share, not a core count; on GPU machines set num_gpus=1.
    num_cpus: float = Field(default=0.5, gt=0)
    num_gpus: float = Field(default=0.0, ge=0)
    max_ongoing_requests: int = Field(default=32, ge=1)
    engine: EngineConfig = Field(default_factory=EngineConfig)


class AppConfig(BaseModel):
    """The application `serve run serve_config.yaml` builds."""

    model_config = ConfigDict(extra="forbid")

    name: str = "kvrelay"
    topology: Literal["aggregated", "disaggregated"] = "aggregated"
    # aggregated: every replica prefills and decodes. disaggregated: `pool` prefills, `decode_pool` decodes.
    pool: PoolConfig = Field(default_factory=PoolConfig)
    decode_pool: PoolConfig | None = None
    ingress_num_cpus: float = Field(default=0.1, gt=0)

    @model_validator(mode="after")
    def _check_topology(self) -> AppConfig:
        if self.topology == "disaggregated":
            if self.decode_pool is None:
                raise ValueError("topology 'disaggregated' needs a decode_pool")
            if self.decode_pool.engine.model != self.pool.engine.model:
                raise ValueError("prefill and decode pools must serve the same model")
            if not (self.pool.engine.nixl.enabled and self.decode_pool.engine.nixl.enabled):
                raise ValueError("disaggregated serving moves KV over NIXL: enable nixl on both pools")
        elif self.decode_pool is not None:
            raise ValueError("decode_pool is only used with topology 'disaggregated'")
        return self

    @property
    def served_model(self) -> str:
        return self.pool.engine.model

