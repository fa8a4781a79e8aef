"""OpenAI-style request and response models for `/v1/chat/completions` and `/v1/completions`.

The same pydantic models are the typed Python handle API (`handle.chat.remote(ChatCompletionRequest(...))`).
Unknown fields are refused so a typo is a clear 400, never silently ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from actors.replica_api import Sampling


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields both endpoints share; `to_sampling` turns them into the replica's Sampling."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = 1
    stop: str | list[str] | None = None
    # vLLM seeds a 64-bit generator: a larger seed would fail inside the engine.
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    user: str | None = None
    # vLLM extensions kvrelay passes on.
    top_k: int | None = None
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool = False
    prompt_logprobs: int | None = Field(default=None, ge=0)
    # Accepted only to refuse it with a precise message: clients never name KV blocks.
    kv_transfer_params: dict[str, Any] | None = None

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("kv_transfer_params")
    @classmethod
    def _no_client_kv_params(cls, value: dict[str, Any] | None) -> None:
        if value is not None:
            raise ValueError(
                "kv_transfer_params cannot be set by clients: kvrelay plans KV reuse itself and never lets a "
                "request name KV blocks"
            )
        return None

    def to_sampling(self, default_max_tokens: int) -> Sampling:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return Sampling(
            max_tokens=self.max_tokens or default_max_tokens,
            min_tokens=self.min_tokens or 0,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            seed=self.seed,
            stop=stop,
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            prompt_logprobs=self.prompt_logprobs,
        )


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            # Text parts only: these models read text. Anything else is a client error.
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _max_tokens_alias(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None and self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return self


class CompletionRequest(_SamplingFields):
    prompt: str | list[int]
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, prompt: str | list[int]) -> str | list[int]:
        if not prompt:
            raise ValueError("prompt is empty")
        return prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported")
        return echo


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class KVRelayInfo(BaseModel):
    """How kvrelay served the turn (also in the `x-kvrelay-plan` header)."""

    mode: Literal["local", "pull", "recompute"]
    replica: str
    holder: str | None
    reused_tokens: int
    estimates_ms: dict[str, float]
    reason: str


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class ChatChoice(BaseModel):
    index: int = 0
    message: dict[str, Any]
    finish_reason: str | None
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    kvrelay: KVRelayInfo


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    kvrelay: KVRelayInfo


class TurnResult(BaseModel):
    """The result of `Ingress.turn` (token-level turns for tests, benchmarks and Python clients)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    usage: Usage
    kvrelay: KVRelayInfo
    ttft_ms: float | None
    latency_ms: float
