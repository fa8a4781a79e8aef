"""The ingress deployment: OpenAI-style HTTP (Starlette) and typed Python handle methods, one turn path.

HTTP and handle calls both become a `Turn` (the conversation's token ids) run by `app.turns.TurnRunner` (or
`app.disaggregated.DisaggregatedTurnRunner` when the app has a decode pool).
Every response says how its turn was planned: the `x-kvrelay-plan` header and a `kvrelay` object.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from actors.directory_mirror import DirectoryMirror
from actors.replica_api import GenerateDelta, InvalidRequestError, Sampling
from app.disaggregated import DisaggregatedTurnRunner
from app.metrics import IngressMetrics
from app.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    KVRelayInfo,
    TurnResult,
    new_id,
    now,
)
from app.responses import (
    ClientError,
    chat_chunks,
    chat_response,
    completion_chunks,
    completion_response,
    openai_error,
    prepend,
    usage,
    validation_message,
)
from app.turns import PREFILL_POOL, Turn, TurnOutcome, TurnRunner
from configs.app import AppConfig, Policy
from kvtransfer.calibration import calibrate
from kvtransfer.cost_model import CostModel
from kvtransfer.kv_shape import KVShape
from kvtransfer.planner import Mode
from model_prep.store import ensure_model

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256
SERVER_FAILED = "the server failed to serve this request (the error is logged); retry it"


def invalid_request(exc: BaseException) -> InvalidRequestError | None:
    """The replica's refusal of a request, however Ray or Serve wrapped it on the way back, else None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, InvalidRequestError):
            return exc
        exc = getattr(exc, "cause", None) or exc.__cause__
    return None


def tenant_of(request: Request | None, explicit: str | None = None) -> str:
    """A tenant key from the API key (hashed, never stored), so tenants never share KV."""
    if explicit:
        return explicit
    auth = request.headers.get("authorization", "") if request is not None else ""
    return hashlib.blake2b(auth.encode(), digest_size=12).hexdigest() if auth else ""


@serve.ingress()
class Ingress:
    """Entry point for HTTP (`/v1/...`) and Python handles (`chat`, `completions`)."""

    async def __init__(
        self, config: dict[str, Any], directory: DeploymentHandle, engines: DeploymentHandle, **pools: DeploymentHandle
    ) -> None:
        from transformers import AutoTokenizer

        self.config = AppConfig.model_validate(config)
        engine = self.config.pool.engine
        self.model = engine.model
        self.max_model_len = engine.max_model_len
        self.fast_prefill = engine.fast_prefill
        model_dir = ensure_model(self.model)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        shape = KVShape.from_model_dir(model_dir, engine.dtype, engine.block_size)
        self.directory = directory
        self.mirror = DirectoryMirror(directory, engine.block_size)
        self.mirror.start()
        cost = CostModel(shape.kv_bytes)
        decode_engines = pools.get("decode_engines")
        if decode_engines is None:
            self.runner = TurnRunner(engines, self.mirror, cost, self.model, engine.block_size, engine.nixl.hold_ttl_s)
        else:
            self.runner = DisaggregatedTurnRunner(
                engines, decode_engines, self.mirror, cost, self.model, engine.block_size, engine.nixl.hold_ttl_s
            )
        self.metrics = IngressMetrics()
        self.created = now()
        self._calibration = asyncio.get_running_loop().create_task(calibrate(
            self.turn, self._prefill_replicas, self.config.pool.num_replicas, cost, len(self.tokenizer),
            self.max_model_len,
        ))

    def __serve_build_asgi_app__(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/chat/completions", self.http_chat, methods=["POST"]),
                Route("/v1/completions", self.http_completions, methods=["POST"]),
                Route("/metrics", self.http_metrics, methods=["GET"]),
                Route("/kvrelay/stats", self.http_stats, methods=["GET"]),
            ]
        )

    # ------------------------------------------------------------------------------ HTTP routes

    async def health(self, request: Request) -> JSONResponse:
        replicas = self.runner.replicas()
        if not replicas:
            return JSONResponse({"status": "starting", "replicas": 0}, 503)
        return JSONResponse({"status": "ok", "replicas": len(replicas)})

    async def models(self, request: Request) -> JSONResponse:
        card = {"id": self.model, "object": "model", "created": self.created, "owned_by": "kvrelay",
                "max_model_len": self.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    async def http_metrics(self, request: Request) -> Response:
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    async def http_stats(self, request: Request) -> JSONResponse:
        return JSONResponse(await self.stats())

    async def http_chat(self, request: Request) -> Response:
        return await self._http(request, ChatCompletionRequest, self._chat_turn, chat_response, chat_chunks)

    async def http_completions(self, request: Request) -> Response:
        return await self._http(
            request, CompletionRequest, self._completion_turn, completion_response, completion_chunks
        )

    async def _http(self, request: Request, model_cls, make_turn, respond, chunks) -> Response:
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise ClientError(400, "the request body is not valid JSON") from None
            if not isinstance(body, dict):
                raise ClientError(400, "the request body must be a JSON object")
            try:
                req = model_cls.model_validate(body)
            except ValidationError as exc:
                message, param = validation_message(exc)
                raise ClientError(400, message, param=param) from None
            turn = make_turn(req, tenant_of(request), request.headers.get("x-session-id"),
                             request.headers.get("x-kvrelay-policy"))
            stream = self._run(turn)
            first = await anext(stream)  # planning and prefill errors surface here, before any byte is sent
        except ValidationError as exc:  # a value the turn's sampling refuses (e.g. top_k=-5)
            message, param = validation_message(exc)
            self.metrics.errors.labels(kind="client").inc()
            return ClientError(400, message, param=param).response()
        except ClientError as exc:
            self.metrics.errors.labels(kind="client").inc()
            return exc.response()
        except Exception:  # ours, not the client's: logged here, never shown (it names actors and processes)
            logger.exception("request failed before its first token")
            self.metrics.errors.labels(kind="server").inc()
            return openai_error(500, SERVER_FAILED, type_="server_error")
        outcome = first[1]
        headers = {"x-kvrelay-plan": json.dumps(outcome.public(), separators=(",", ":"))}
        if not req.stream:
            deltas = [first[0]] + [d async for d, _ in stream]
            return JSONResponse(respond(self.model, turn, deltas, outcome).model_dump(), headers=headers)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            self._sse(chunks(self.model, turn, prepend(first, stream), include_usage)),
            media_type="text/event-stream",
            headers=headers,
        )

    async def _sse(self, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
        except Exception:  # the status line is sent already; report in-band like OpenAI does, without internals
            logger.exception("stream failed")
            self.metrics.errors.labels(kind="server").inc()
            yield f"data: {json.dumps({'error': {'message': SERVER_FAILED, 'type': 'server_error'}})}\n\n"
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------------------ Python handle API

    async def chat(
        self,
        request: ChatCompletionRequest | dict[str, Any],
        tenant: str = "",
        session_id: str | None = None,
        policy: str | None = None,
    ):
        """`handle.chat.remote(req)` -> ChatCompletionResponse; with `handle.options(stream=True)` and
        `req.stream=True`, an async stream of chunk dicts (the same objects the SSE stream carries)."""
        req = ChatCompletionRequest.model_validate(request)
        turn = self._chat_turn(req, tenant, session_id, policy)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return chat_chunks(self.model, turn, self._run(turn), include_usage)
        deltas, outcome = await self._collect(turn)
        return chat_response(self.model, turn, deltas, outcome)

    async def completions(
        self,
        request: CompletionRequest | dict[str, Any],
        tenant: str = "",
        session_id: str | None = None,
        policy: str | None = None,
    ):
        """`handle.completions.remote(req)` -> CompletionResponse (streams like `chat`)."""
        req = CompletionRequest.model_validate(request)
        turn = self._completion_turn(req, tenant, session_id, policy)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return completion_chunks(self.model, turn, self._run(turn), include_usage)
        deltas, outcome = await self._collect(turn)
        return completion_response(self.model, turn, deltas, outcome)

    async def turn(
        self,
        token_ids: list[int],
        sampling: Sampling | dict[str, Any],
        force: tuple[str, str] | None = None,
        tenant: str = "",
        policy: str | None = None,
    ) -> TurnResult:
        """The turn path on raw token ids, for tests, benchmarks and token-level clients.

        `force` = (mode, replica_id) runs that option instead of the planner's choice (a forced
        "recompute" skips the prefix cache), so every option can be measured on the same turn.
        """
        turn = Turn(new_id("turn"), list(token_ids), Sampling.model_validate(sampling), tenant,
                    policy=self._policy(policy))
        forced = (Mode(force[0]), force[1]) if force else None
        started = time.monotonic()
        deltas, outcome = await self._collect(turn, forced)
        last = deltas[-1]
        return TurnResult(
            token_ids=[t for d in deltas for t in d.token_ids],
            text="".join(d.text for d in deltas),
            finish_reason=last.finish_reason,
            usage=usage(last),
            kvrelay=KVRelayInfo(**outcome.public()),
            ttft_ms=outcome.ttft_ms,
            latency_ms=(time.monotonic() - started) * 1e3,
        )

    async def plan(self, token_ids: list[int], replicas: list[str] | None = None, tenant: str = "") -> dict[str, Any]:
        """What the planner would do for this turn now (nothing runs); `replicas` limits the targets."""
        turn = Turn(new_id("plan"), list(token_ids), Sampling(), tenant)
        plan = self.runner.plan(turn, targets=replicas)
        return {"mode": plan.mode.value, "replica": plan.replica_id, "holder": plan.holder,
                "reused_tokens": plan.reused_tokens, "estimates_ms": plan.estimates_ms, "reason": plan.reason}

    def _prefill_replicas(self) -> list[str]:
        return [r.replica_id for r in self.runner.replicas() if r.pool == PREFILL_POOL]

    async def calibrated(self) -> dict[str, Any]:
        """Wait for the start-up calibration and return the cost model's fit."""
        await asyncio.shield(self._calibration)
        return self.runner.cost.snapshot()

    async def stats(self) -> dict[str, Any]:
        """Planner counters, the cost model's current fit, the directory and the replicas."""
        directory_stats = await self.directory.stats.remote()
        plan_ms = sorted(self.runner.plan_ms)
        return {
            "counters": dict(self.runner.counters),
            "cost_model": self.runner.cost.snapshot(),
            "directory": directory_stats._asdict(),
            "mirror": self.mirror.stats(),
            "plan_ms": {"p50": plan_ms[len(plan_ms) // 2], "p99": plan_ms[int(0.99 * (len(plan_ms) - 1))],
                        "samples": len(plan_ms)} if plan_ms else None,
            "replicas": [r.model_dump() for r in self.runner.replicas()],
        }

    # ------------------------------------------------------------------------------ turns

    def _check_model(self, requested: str) -> None:
        if requested != self.model:
            raise ClientError(404, f"model {requested!r} is not served here; this deployment serves {self.model!r}",
                              param="model", code="model_not_found")

    def _policy(self, requested: str | None) -> Policy:
        """The deployment's policy, or the one a request names (`x-kvrelay-policy`, for side-by-side benchmarks)."""
        if requested is None:
            return self.config.policy
        try:
            return Policy(requested)
        except ValueError:
            raise ClientError(400, f"unknown placement policy {requested!r}; known: {[p.value for p in Policy]}",
                              param="x-kvrelay-policy") from None

    def _turn(self, req, token_ids: list[int], tenant: str, session_id: str | None, policy: str | None) -> Turn:
        if req.prompt_logprobs is not None and self.fast_prefill:
            raise ClientError(400, "prompt_logprobs cannot be served by this deployment: it runs KV-sharing fast "
                              "prefill, whose shared layers skip prompt positions; drop prompt_logprobs",
                              param="prompt_logprobs")
        room = self.max_model_len - len(token_ids)
        if room < 1 or (req.max_tokens is not None and req.max_tokens > room):
            asked = req.max_tokens or 1
            raise ClientError(
                400,
                f"this model's context is {self.max_model_len} tokens, but the prompt has {len(token_ids)} tokens "
                f"and max_tokens asks for {asked} more; shorten the prompt or lower max_tokens",
                param="messages" if hasattr(req, "messages") else "prompt",
                code="context_length_exceeded",
            )
        return Turn(
            request_id=new_id("turn"),
            token_ids=token_ids,
            sampling=req.to_sampling(min(DEFAULT_MAX_TOKENS, room)),
            tenant=tenant,
            session_id=session_id,
            policy=self._policy(policy),
        )

    def _chat_turn(
        self, req: ChatCompletionRequest, tenant: str, session_id: str | None, policy: str | None = None
    ) -> Turn:
        self._check_model(req.model)
        try:
            messages = [m.as_template_input() for m in req.messages]
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)
        except ValueError as exc:
            raise ClientError(400, str(exc), param="messages") from None
        except Exception as exc:  # the template rejected this conversation (roles out of order, ...)
            raise ClientError(400, f"the chat template cannot render these messages: {exc}", param="messages") from None
        return self._turn(req, list(ids), tenant, session_id, policy)

    def _completion_turn(
        self, req: CompletionRequest, tenant: str, session_id: str | None, policy: str | None = None
    ) -> Turn:
        self._check_model(req.model)
        if isinstance(req.prompt, str):
            ids = self.tokenizer(req.prompt)["input_ids"]
        else:
            vocab = len(self.tokenizer)
            if any(not 0 <= t < vocab for t in req.prompt):
                raise ClientError(400, f"prompt token ids must lie in [0, {vocab})", param="prompt")
            ids = req.prompt
        return self._turn(req, list(ids), tenant, session_id, policy)

    async def _run(
        self, turn: Turn, force: tuple[Mode, str] | None = None
    ) -> AsyncIterator[tuple[GenerateDelta, TurnOutcome]]:
        started = time.monotonic()
        try:
            async for delta, outcome in self.runner.run(turn, force):
                if delta.finished:
                    self.metrics.observe_turn(outcome, delta, time.monotonic() - started)
                yield delta, outcome
        except Exception as exc:
            refused = invalid_request(exc)
            if refused is None:
                raise
            raise ClientError(400, str(refused)) from None

    async def _collect(
        self, turn: Turn, force: tuple[Mode, str] | None = None
    ) -> tuple[list[GenerateDelta], TurnOutcome]:
        items = [item async for item in self._run(turn, force)]
        return [delta for delta, _ in items], items[-1][1]
