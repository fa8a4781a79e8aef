"""The ingress's HTTP API: the Starlette route table behind the API-key check, errors in OpenAI's shape, SSE, and the
endpoints (health, version, models, metrics, stats, tokenization; chat and completions via `app/openai_turns.py`).

Every chat or completion response says how its turn was planned: the `x-kvrelay-plan` header and a `kvrelay`
object. With API keys configured, every route but /health and /version needs one (`app/auth.py`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ray.serve.handle import DeploymentHandle
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest

from app.auth import ApiKeys
from app.directory_mirror import DirectoryMirror
from app.frontend import Frontend, OpenAIRequest, parse_request
from app.metrics import DirectoryView, IngressMetrics
from app.openai_turns import OpenAITurns, with_kvrelay
from app.responses import ClientError, as_client_error, now, openai_error, prepend
from app.turn_types import TurnLost, TurnOutcome
from app.turns import TurnRunner

logger = logging.getLogger(__name__)

SERVER_FAILED = "the server failed to serve this request (the error is logged); retry it"
# What a 429 or a 503 asks the client to wait (seconds).
RETRY_AFTER_S = 1

Endpoint = Callable[[Request], Awaitable[Response]]


class OwnWork:
    """What recent one-turn HTTP responses cost this ingress outside their engine request (parse, render, plan;
    and derender, respond): recorded per response here, summarized in the ingress's stats."""

    def __init__(self, samples: int = 1024) -> None:
        # (before the engine call, after the last delta) ms.
        self.ms: deque[tuple[float, float]] = deque(maxlen=samples)

    def record(self, arrived: float, outcome: TurnOutcome) -> None:
        """From the request's arrival to the engine call, and from the last delta to the response (built, about to
        be sent); `arrived` is a `time.perf_counter()` reading."""
        if outcome.engine_called_at is not None and outcome.last_delta_at is not None:
            self.ms.append(((outcome.engine_called_at - arrived) * 1e3,
                            (time.perf_counter() - outcome.last_delta_at) * 1e3))

    def summary(self) -> dict[str, Any] | None:
        """Medians of both, and how many responses they cover; None before the first."""
        before, after = sorted(b for b, _ in self.ms), sorted(a for _, a in self.ms)
        if not before:
            return None
        return {"before_engine_p50": before[len(before) // 2], "after_engine_p50": after[len(after) // 2],
                "samples": len(before)}


class HttpApi:
    """One ingress's HTTP routes, on the parts of the deployment each route reads."""

    def __init__(
        self,
        *,
        keys: ApiKeys,
        openai: OpenAITurns,
        frontend: Frontend,
        metrics: IngressMetrics,
        own_work: OwnWork,
        runner: TurnRunner,
        pools: dict[str, DeploymentHandle],
        directory: DeploymentHandle,
        mirror: DirectoryMirror,
        calibration: asyncio.Task,
        stats: Callable[[], Awaitable[dict[str, Any]]],
        root_model: str,
    ) -> None:
        self.keys = keys
        self.openai = openai
        self.frontend = frontend
        self.metrics = metrics
        self.own_work = own_work
        self.runner = runner
        self.pools = pools
        self.directory = directory
        self.mirror = mirror
        self.calibration = calibration
        self.stats = stats
        self.root_model = root_model
        self.created = now()

    def app(self) -> Starlette:
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/chat/completions", self.http_chat, methods=["POST"]),
            Route("/v1/completions", self.http_completions, methods=["POST"]),
            Route("/tokenize", self.http_tokenize, methods=["POST"]),
            Route("/detokenize", self.http_detokenize, methods=["POST"]),
            Route("/metrics", self.http_metrics, methods=["GET"]),
            Route("/kvrelay/stats", self.http_stats, methods=["GET"]),
        ]
        return Starlette(
            routes=[Route(r.path, self._guarded(r.endpoint), methods=r.methods) for r in routes],
            exception_handlers={HTTPException: self._http_exception, Exception: self._unhandled},
        )

    async def _http_exception(self, request: Request, exc: HTTPException) -> Response:
        """Starlette's own refusals (no such route, wrong method) in OpenAI's shape, never plain text."""
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return openai_error(exc.status_code, message, code="not_found" if exc.status_code == 404 else None)

    async def _unhandled(self, request: Request, exc: Exception) -> Response:
        logger.error("unhandled error on %s", request.url.path, exc_info=exc)
        return openai_error(500, SERVER_FAILED)

    def _guarded(self, endpoint: Endpoint) -> Endpoint:
        """The route behind the API-key check (open routes and a keyless deployment pass through)."""
        async def guarded(request: Request) -> Response:
            if not self.keys.admits(request):
                self.metrics.errors.labels(kind="client").inc()
                return openai_error(401, "a valid API key is required: send it as 'Authorization: Bearer <key>'",
                                    code="invalid_api_key")
            return await endpoint(request)
        return guarded

    # ------------------------------------------------------------------------------ the deployment's state

    async def health(self, request: Request) -> JSONResponse:
        replicas = self.runner.replicas()
        # Whether the start-up calibration has run (`make serve` waits for it: app/serve_progress.py).
        calibrated = self.calibration.done()
        if not replicas:
            return JSONResponse({"status": "starting", "replicas": 0, "calibrated": calibrated}, 503)
        return JSONResponse({"status": "ok", "replicas": len(replicas), "calibrated": calibrated})

    async def version(self, request: Request) -> JSONResponse:
        import vllm

        return JSONResponse({"version": vllm.__version__, "kvrelay": _kvrelay_version()})

    async def models(self, request: Request) -> JSONResponse:
        card = {"id": self.openai.model, "object": "model", "created": self.created, "owned_by": "kvrelay",
                "root": self.root_model, "max_model_len": self.openai.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    async def http_metrics(self, request: Request) -> Response:
        engines, directory = await asyncio.gather(self._engine_metrics(), self._directory_view())
        body, content_type = self.metrics.render(engines, directory)
        return Response(body, media_type=content_type)

    async def _directory_view(self, timeout_s: float = 5.0) -> DirectoryView | None:
        """The directory's stats beside this ingress's mirror of it; None if the directory does not answer in time."""
        try:
            stats = await asyncio.wait_for(self.directory.stats.remote(), timeout_s)
        except Exception as exc:  # restarting: /metrics still answers, without the directory's families
            logger.warning("KV directory stats unavailable for /metrics: %s", exc)
            return None
        return DirectoryView(stats, self.mirror.epoch, self.mirror.seq, self.runner.counters["holds_released"])

    async def _engine_metrics(self, timeout_s: float = 5.0) -> dict[str, str]:
        """Each live replica's metrics text (replicas that do not answer in time are left out)."""
        replicas = self.runner.replicas()
        calls = [self.pools[r.pool].metrics.remote({"target_replica": r.replica_id}) for r in replicas]
        done = await asyncio.gather(*(asyncio.wait_for(c, timeout_s) for c in calls), return_exceptions=True)
        return {r.replica_id: text for r, text in zip(replicas, done, strict=True) if isinstance(text, str)}

    async def http_stats(self, request: Request) -> JSONResponse:
        return JSONResponse(await self.stats())

    # ------------------------------------------------------------------------------ tokens and turns

    async def http_tokenize(self, request: Request) -> Response:
        return await self._tokenization(request, self.frontend.tokenize)

    async def http_detokenize(self, request: Request) -> Response:
        return await self._tokenization(request, self.frontend.detokenize)

    async def _tokenization(self, request: Request, call: Callable[[dict[str, Any]], Awaitable[Any]]) -> Response:
        try:
            return JSONResponse((await call(await self._body(request))).model_dump(mode="json"))
        except Exception as exc:
            refused = as_client_error(exc)
            if refused is None:
                raise  # the app's handler logs it and answers an OpenAI-format 500
            self.metrics.errors.labels(kind="client").inc()
            return refused.response()

    @staticmethod
    async def _body(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ClientError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ClientError(400, "the request body must be a JSON object")
        return body

    async def http_chat(self, request: Request) -> Response:
        return await self._http(request, ChatCompletionRequest)

    async def http_completions(self, request: Request) -> Response:
        return await self._http(request, CompletionRequest)

    async def _http(self, request: Request, request_cls: type[OpenAIRequest]) -> Response:
        """A chat or completion request answered: its JSON body, or its SSE stream once the first chunk is ready
        (errors before that are plain OpenAI-shaped error responses)."""
        arrived = time.perf_counter()
        headers: dict[str, str] = {}
        try:
            req = parse_request(request_cls, await self._body(request))
            turns = await self.openai.turns(req, self.keys.tenant(request), request.headers.get("x-session-id"),
                                            request.headers.get("x-kvrelay-policy"))
            if req.stream:
                stream = self.openai.stream(req, turns)
                first = await anext(stream)  # planning and prefill errors surface here, before any byte is sent
                headers["x-kvrelay-plan"] = json.dumps(first[1].public(), separators=(",", ":"))
            else:
                body, outcome = await self.openai.respond(req, turns)
                headers["x-kvrelay-plan"] = json.dumps(outcome.public(), separators=(",", ":"))
        except TurnLost as exc:
            self.metrics.errors.labels(kind="server").inc()
            response = openai_error(503, str(exc), code="replica_failed")
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
            return response
        except Exception as exc:
            refused = as_client_error(exc)  # the request (or a value vLLM's sampling parameters refuse)
            if refused is not None:
                self.metrics.errors.labels(kind="client").inc()
                return refused.response()
            # Ours, not the client's: logged here, never shown (it names actors and processes).
            logger.exception("request failed before its response began")
            self.metrics.errors.labels(kind="server").inc()
            return openai_error(500, SERVER_FAILED)
        if not req.stream:
            response = JSONResponse(with_kvrelay(body, outcome), headers=headers)
            if len(turns) == 1 and len(turns[0]) == 1:
                self.own_work.record(arrived, outcome)
            return response
        return StreamingResponse(self._sse(prepend(first, stream)), media_type="text/event-stream", headers=headers)

    async def _sse(self, chunks: AsyncIterator[tuple[dict[str, Any], TurnOutcome]]) -> AsyncIterator[str]:
        try:
            async for chunk, _ in chunks:
                yield f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
        except Exception as exc:  # the status line is sent already; report in-band like OpenAI does, no internals
            refused = as_client_error(exc)  # e.g. a later choice or prompt the engine refuses
            if refused is not None:
                self.metrics.errors.labels(kind="client").inc()
                error = {"message": refused.message, "type": "invalid_request_error", "param": refused.param}
            else:
                logger.exception("stream failed")
                self.metrics.errors.labels(kind="server").inc()
                error = {"message": str(exc) if isinstance(exc, TurnLost) else SERVER_FAILED, "type": "server_error"}
            yield f"data: {json.dumps({'error': error})}\n\n"
        yield "data: [DONE]\n\n"


def _kvrelay_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvrelay")
    except PackageNotFoundError:
        return "unknown"
