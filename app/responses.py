"""OpenAI-shaped bodies built from a turn's deltas: complete responses, stream chunks, usage, and client errors."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from starlette.responses import JSONResponse

from actors.replica_api import GenerateDelta
from app.openai_protocol import (
    ChatChoice,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    KVRelayInfo,
    PromptTokensDetails,
    Usage,
    now,
)
from app.turns import Turn, TurnOutcome


class ClientError(Exception):
    """A request the client must change; becomes an OpenAI-style 4xx."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        return openai_error(self.status, self.message, param=self.param, code=self.code)


def openai_error(
    status: int, message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> JSONResponse:
    """An error body in the shape OpenAI's API and clients use."""
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status)


def validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """(message, offending parameter) of a request body pydantic refused, worded for the client."""
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or None
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = f"unknown field {where!r}"
    elif err["type"] == "missing":
        msg = f"missing required field {where!r}"
    return (f"{where}: {msg}" if where and err["type"] not in ("extra_forbidden", "missing") else msg), where


def usage(last: GenerateDelta) -> Usage:
    """Token counts of a finished turn; cached tokens are the prompt tokens not computed (reused or pulled)."""
    return Usage(
        prompt_tokens=last.prompt_tokens,
        completion_tokens=last.completion_tokens,
        total_tokens=last.prompt_tokens + last.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=last.num_cached_tokens),
    )


def chat_response(model: str, turn: Turn, deltas: list[GenerateDelta], outcome: TurnOutcome) -> ChatCompletionResponse:
    last = deltas[-1]
    return ChatCompletionResponse(
        id=turn.request_id.replace("turn", "chatcmpl", 1),
        created=now(),
        model=model,
        choices=[ChatChoice(message={"role": "assistant", "content": "".join(d.text for d in deltas)},
                            finish_reason=last.finish_reason)],
        usage=usage(last),
        kvrelay=KVRelayInfo(**outcome.public()),
    )


def completion_response(
    model: str, turn: Turn, deltas: list[GenerateDelta], outcome: TurnOutcome
) -> CompletionResponse:
    last = deltas[-1]
    return CompletionResponse(
        id=turn.request_id.replace("turn", "cmpl", 1),
        created=now(),
        model=model,
        choices=[CompletionChoice(text="".join(d.text for d in deltas), finish_reason=last.finish_reason)],
        usage=usage(last),
        kvrelay=KVRelayInfo(**outcome.public()),
    )


async def chat_chunks(
    model: str, turn: Turn, stream: AsyncIterator[tuple[GenerateDelta, TurnOutcome]], include_usage: bool
) -> AsyncIterator[dict[str, Any]]:
    """The chat stream's chunk dicts (the objects the SSE stream carries): role, text deltas, finish, usage."""
    base = {"id": turn.request_id.replace("turn", "chatcmpl", 1), "object": "chat.completion.chunk",
            "created": now(), "model": model}

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        c = dict(base, choices=[{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}])
        if include_usage:
            c["usage"] = None
        return c

    yield chunk({"role": "assistant", "content": ""})
    async for delta, outcome in stream:
        if delta.text:
            yield chunk({"content": delta.text})
        if delta.finished:
            final = chunk({}, delta.finish_reason)
            final["kvrelay"] = outcome.public()
            yield final
            if include_usage:
                yield dict(base, choices=[], usage=usage(delta).model_dump(), kvrelay=outcome.public())


async def completion_chunks(
    model: str, turn: Turn, stream: AsyncIterator[tuple[GenerateDelta, TurnOutcome]], include_usage: bool
) -> AsyncIterator[dict[str, Any]]:
    """The completion stream's chunk dicts: text deltas, finish, usage."""
    base = {"id": turn.request_id.replace("turn", "cmpl", 1), "object": "text_completion", "created": now(),
            "model": model}
    async for delta, outcome in stream:
        if delta.text or delta.finished:
            c = dict(base, choices=[{"index": 0, "text": delta.text, "logprobs": None,
                                     "finish_reason": delta.finish_reason if delta.finished else None}])
            if include_usage:
                c["usage"] = None
            if delta.finished:
                c["kvrelay"] = outcome.public()
            yield c
        if delta.finished and include_usage:
            yield dict(base, choices=[], usage=usage(delta).model_dump(), kvrelay=outcome.public())


async def prepend(first: Any, rest: AsyncIterator) -> AsyncIterator:
    """`first`, then the rest of the stream it was taken from."""
    yield first
    async for item in rest:
        yield item
