"""What the ingress answers besides vLLM's own OpenAI bodies: client errors in OpenAI's shape, the `kvrelay` plan
object every response carries, and the token-level `TurnResult`."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ValidationError
from starlette.responses import JSONResponse


class ClientError(Exception):
    """A request the client must change; becomes an OpenAI-style 4xx."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def response(self) -> JSONResponse:
        response = openai_error(self.status, self.message, param=self.param, code=self.code)
        response.headers.update(self.headers or {})
        return response


def openai_error(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    """An error body in the shape OpenAI's API and clients use: the SDKs pick the exception by status, the type
    says whose fault it is, `code` names the case (e.g. "invalid_api_key")."""
    type_ = "server_error" if status >= 500 else "invalid_request_error"
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status)


def validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """(message, offending parameter) of a request body pydantic refused, worded for the client."""
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or None
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "missing":
        msg = f"missing required field {where!r}"
    return (f"{where}: {msg}" if where and err["type"] != "missing" else msg), where


def as_client_error(exc: BaseException) -> ClientError | None:
    """The client's mistake `exc` stands for, as the 4xx to answer (pydantic's and vLLM's refusals of a request
    included: vLLM's validators raise its own errors, which pydantic passes through unwrapped), else None."""
    from vllm.exceptions import VLLMClientError, VLLMNotFoundError

    if isinstance(exc, ClientError):
        return exc
    if isinstance(exc, ValidationError):
        message, param = validation_message(exc)
        return ClientError(400, message, param=param)
    if isinstance(exc, VLLMClientError):
        message = str(exc.args[0]) if exc.args else str(exc)
        return ClientError(404 if isinstance(exc, VLLMNotFoundError) else 400, message,
                           param=getattr(exc, "parameter", None))
    return None


class KVRelayInfo(BaseModel):
    """How kvrelay served the turn (also in the `x-kvrelay-plan` header)."""

    mode: Literal["local", "pull", "recompute"]
    replica: str
    holder: str | None
    reused_tokens: int
    estimates_ms: dict[str, float]
    reason: str
    # Time to first token as the ingress measured it (from planning the turn to the engine's first token): what
    # the client saw beyond it is the HTTP path's. None where the first token is not this turn's to time.
    ttft_ms: float | None = None


class TurnUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    # Prompt tokens whose KV was not computed: a local prefix hit or pulled over NIXL.
    cached_tokens: int


class TurnResult(BaseModel):
    """The result of `Ingress.turn` (token-level turns for tests, benchmarks and Python clients)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    usage: TurnUsage
    kvrelay: KVRelayInfo
    ttft_ms: float | None
    latency_ms: float


def caused_by(exc: BaseException | None, *kinds: type[BaseException]) -> BaseException | None:
    """The exception of `kinds` in `exc`'s chain of causes (Ray and Serve wrap a replica's errors on the way
    back: `RayTaskError.cause`, `__cause__`), else None. Ray's wrapper is itself an instance of its cause's class,
    and its text is a remote traceback: of a run of matches, the innermost (the error as raised) is returned."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        inner = getattr(exc, "cause", None) or exc.__cause__
        if isinstance(exc, kinds) and not isinstance(inner, kinds):
            return exc
        exc = inner
    return None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


async def prepend(first: Any, rest: AsyncIterator) -> AsyncIterator:
    """`first`, then the rest of the stream it was taken from."""
    yield first
    async for item in rest:
        yield item
