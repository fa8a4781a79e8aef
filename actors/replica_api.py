"""The engine replica's wire contract: what callers send to `EngineReplica` and what it streams back.

These are plain pydantic models so they cross Ray process boundaries unchanged and validate on entry. The module
imports no vLLM (which brings torch: ~0.5 GB and seconds of CPU per process): a simulated replica
(`actors/sim_engine_replica.py`) reads and writes these types without it. vLLM's own types in them (sampling
parameters, logprobs) are checked where they are validated, importing vLLM there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from kvtransfer.types import Hold

if TYPE_CHECKING:
    from vllm.sampling_params import SamplingParams

# Names of the load signals a replica reports to Serve's autoscaler (`EngineReplica.record_autoscaling_stats`).
ONGOING_REQUESTS = "ongoing_requests"
KV_CACHE_USAGE = "kv_cache_usage"
TTFT_MS = "ttft_ms"


class InvalidRequestError(ValueError):
    """The request cannot be served as asked; the message says what to change. The replica keeps serving."""


class Sampling(BaseModel):
    """Sampling for token-level turns (`Ingress.turn`, benchmarks, calibration): a subset of vLLM's SamplingParams.

    OpenAI requests get theirs from vLLM's own front end; both reach the replica as a `SamplingParams`.
    """

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(default=16, ge=1)
    min_tokens: int = Field(default=0, ge=0)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = Field(default=None, ge=0)
    prompt_logprobs: int | None = Field(default=None, ge=0)

    def to_params(self) -> SamplingParams:
        """vLLM's SamplingParams; vLLM's own checks apply (a VLLMValidationError names the bad field)."""
        from vllm.sampling_params import SamplingParams

        return SamplingParams(**self.model_dump(exclude_none=True, exclude={"stop", "stop_token_ids"}),
                              stop=self.stop or None, stop_token_ids=self.stop_token_ids or None)


class ReplyParams(BaseModel):
    """What a modelled engine reads of a request's sampling: one sequence of `max_tokens`. The ingress sends these to
    simulated replicas instead of vLLM's SamplingParams, whose unpickling would import vLLM into their processes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    n: int = Field(default=1, ge=1)
    max_tokens: int | None = Field(default=16, ge=1)

    @classmethod
    def of(cls, params: SamplingParams | ReplyParams) -> ReplyParams:
        return cls(n=params.n, max_tokens=params.max_tokens)


def _sampling_params() -> SamplingParams:
    from vllm.sampling_params import SamplingParams

    return SamplingParams()


def _checked_params(value: Any) -> SamplingParams | ReplyParams:
    """vLLM's SamplingParams, or a modelled engine's ReplyParams (checked first: no vLLM import for those)."""
    if isinstance(value, ReplyParams):
        return value
    from vllm.sampling_params import SamplingParams

    if not isinstance(value, SamplingParams):
        raise ValueError(f"params must be vLLM's SamplingParams or ReplyParams, not {type(value).__name__}")
    return value


def _checked_logprobs(value: Any) -> Any:
    """vLLM's GenerateLogProbs (a dict is parsed into one), or None."""
    if value is None:
        return None
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateLogProbs

    return GenerateLogProbs.model_validate(value)


class GenerateRequest(BaseModel):
    """One generation on one replica. Exactly one of `prompt_token_ids` and `prompt` is given."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    request_id: str
    prompt_token_ids: list[int] | None = None
    prompt: str | None = None
    # One sequence (n=1); the replica sets how outputs stream and the KV transfer fields itself.
    # vLLM's SamplingParams; a simulated replica gets ReplyParams (`ReplyParams`).
    params: Annotated[Any, AfterValidator(_checked_params)] = Field(default_factory=_sampling_params)
    # Set by the turn runner only, never taken from a client: they name KV blocks another engine holds.
    # `pull`: read this hold's tokens' KV over NIXL, compute the rest of the prompt (also P/D's handoff: the decode
    # replica pulls the prompt from the prefill replica's hold and computes the prefill's one token).
    pull: Hold | None = None
    # The pull is the target's own hold (a turn that stays on its holder, read in memory): a replica the request
    # reaches instead (Serve could not route to the target) computes from its own cache rather than pull it.
    own_hold: bool = False
    # Isolates tenants inside the engine's own prefix cache (vLLM's cache_salt).
    cache_salt: str | None = None
    priority: int = 0
    # Compute the whole prompt even if the prefix cache holds part of it (forced recompute, for
    # references and benchmarks). A pull request must not set it: it disables the pull.
    skip_prefix_cache: bool = False
    # Keep this turn's KV pullable afterwards (a hold); the final delta then carries it.
    export_hold: bool = True
    # Read by the replica router: the replica the planner chose. None lets Serve pick.
    target_replica: str | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if (self.prompt_token_ids is None) == (self.prompt is None):
            raise ValueError("give exactly one of prompt_token_ids and prompt")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("prompt_token_ids is empty")
        return self

    def check_context(self, max_model_len: int) -> None:
        """Raise InvalidRequestError if the prompt's token ids plus `max_tokens` exceed `max_model_len`."""
        if self.prompt_token_ids is None:
            return
        max_tokens = self.params.max_tokens
        if len(self.prompt_token_ids) + (max_tokens or 0) > max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(self.prompt_token_ids)} tokens) plus max_tokens ({max_tokens}) "
                f"exceeds this model's context of {max_model_len} tokens; shorten the prompt or lower max_tokens"
            )


class HoldRelease(BaseModel):
    """Free another replica's hold early: the receiving engine tells the holder over NIXL that it will not read it.

    A replica cannot release its own hold this way (its connector would handshake with itself), so the caller
    names another one in `target_replica`, which the replica router reads like a generate request's.
    """

    hold: Hold
    target_replica: str


class GenerateDelta(BaseModel):
    """One streamed step. The last item has `finished=True` and the request's totals."""

    token_ids: list[int]
    text: str
    # Per token of `token_ids`, when the request asked for logprobs (vLLM's token-in-token-out shape).
    logprobs: Annotated[Any, AfterValidator(_checked_logprobs)] = None
    # On the first delta, when the request asked for prompt_logprobs: per prompt position (the first is None); each
    # a dict of token id to vLLM's `Logprob`.
    prompt_logprobs: list[dict[int, Any] | None] | None = None
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Prompt tokens whose KV the engine did not compute: a local prefix hit or pulled over NIXL.
    num_cached_tokens: int = 0
    # The hold vLLM's connector exported for this request (bidirectional mode), if it left one.
    hold: Hold | None = None
    # Seconds from the engine scheduling the request to its first token (prefill compute), if known.
    prefill_s: float | None = None
    # Seconds from the request reaching the engine to its scheduling: queueing, and for a pull the wait for
    # the KV to arrive (vLLM schedules a pulling request only once its KV is in).
    wait_s: float | None = None
    # Whether the request had the engine to itself until its first token (its timings measure the model).
    ran_alone: bool = False
    # Seconds per decode step, if the request had the engine to itself from start to finish.
    decode_step_s: float | None = None
    # For a request that pulled: its connector's verdict on the read, when checked ("verified", "refused: digest",
    # "refused: lease"; kvtransfer/throttled_nixl.py).
    read_check: str | None = None
    replica_id: str = ""


class ReplicaIdentity(BaseModel):
    """How the KV directory and peers address a replica."""

    replica_id: str
    engine_id: str
    nixl_host: str | None
    nixl_port: int | None
    node_id: str
    # The replica's process (its vLLM engine processes are its children).
    pid: int
    # vLLM's engine-core processes (children of `pid`); with `separate_worker_process` each has a worker child.
    engine_pids: list[int] = Field(default_factory=list)
    cpu_cores: list[int] | None
    model: str
    fast_prefill: bool
    block_size: int
    # A simulated replica's real seconds per modelled second (`engine.sim_dilation`); None for a real engine.
    time_dilation: float | None = None


class ReplicaStats(BaseModel):
    """A snapshot of load and measured speed, for the planner and autoscaling."""

    replica_id: str
    # The deployment the replica belongs to ("engines"; "decode_engines" in a disaggregated app).
    pool: str = "engines"
    # The Ray node it runs on: replicas on one node share its CPUs (and memory bandwidth).
    node_id: str = ""
    # When these figures were taken (time.time() on the replica).
    at: float = 0.0
    running: int
    waiting: int
    kv_cache_usage: float
    prefix_cache_hit_rate: float
    prefill_tok_s: float | None
    decode_tok_s: float | None
    requests_finished: int
