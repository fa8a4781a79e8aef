"""The ingress deployment: OpenAI-compatible HTTP (Starlette) and Python handle methods, one turn path.

A request is read, rendered to token ids and answered by vLLM's own front end (`app/frontend.py`); in between,
each prompt becomes a `Turn` run by `app.turns.TurnRunner` (or `app.disaggregated.DisaggregatedTurnRunner` when
the app has a decode pool). Every response says how its turn was planned: the `x-kvrelay-plan` header and a
`kvrelay` object. With API keys configured, every route but /health and /version needs one.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest as RenderedRequest

from actors.directory_mirror import DirectoryMirror
from actors.replica_api import GenerateDelta, InvalidRequestError, Sampling
from app.disaggregated import DisaggregatedTurnRunner
from app.frontend import Frontend, OpenAIRequest, parse_request, usage
from app.metrics import DirectoryView, IngressMetrics
from app.responses import (
    ClientError,
    KVRelayInfo,
    TurnResult,
    TurnUsage,
    as_client_error,
    caused_by,
    new_id,
    now,
    openai_error,
    prepend,
)
from app.turns import PREFILL_POOL, Turn, TurnLost, TurnOutcome, TurnRunner
from configs.app import AppConfig, Policy
from kvtransfer.calibration import calibrate
from kvtransfer.cost_model import CostModel
from kvtransfer.kv_shape import KVShape
from kvtransfer.planner import Mode
from model_prep.store import model_path

logger = logging.getLogger(__name__)

SERVER_FAILED = "the server failed to serve this request (the error is logged); retry it"
# A file of API keys, one per line, read at start-up in addition to the config's `openai.api_keys`.
API_KEYS_FILE_ENV = "KVRELAY_API_KEYS_FILE"
# What a 429 asks the client to wait (seconds).
RETRY_AFTER_S = 1
# Routes anyone may call when API keys are configured.
OPEN_ROUTES = ("/health", "/version")


def hashed(secret: str) -> str:
    """A tenant key from an API key or Authorization header: tenants never share KV, and the secret is not kept."""
    return hashlib.blake2b(secret.encode(), digest_size=12).hexdigest() if secret else ""


def load_api_keys(configured: list[str]) -> list[str]:
    keys = list(configured)
    path = os.environ.get(API_KEYS_FILE_ENV)
    if path:
        keys += [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    return keys


@dataclass
class Choice:
    """One choice of an OpenAI response: a turn on one rendered prompt, numbered as the response numbers it."""

    rendered: RenderedRequest
    turn: Turn
    index: int


def with_kvrelay(body: BaseModel, outcome: TurnOutcome) -> dict[str, Any]:
    """An OpenAI body as JSON-ready dict, with the `kvrelay` object saying how its turn was served."""
    return {**body.model_dump(mode="json"), "kvrelay": outcome.public()}


@serve.ingress()
class Ingress:
    """Entry point for HTTP (`/v1/...`) and Python handles (`chat`, `completions`)."""

    async def __init__(
        self, config: dict[str, Any], directory: DeploymentHandle, engines: DeploymentHandle, **pools: DeploymentHandle
    ) -> None:
        self.config = AppConfig.model_validate(config)
        engine = self.config.pool.engine
        self.model = self.config.openai.served_model_name or engine.model
        self.max_model_len = engine.max_model_len
        self.fast_prefill = engine.fast_prefill
        model_dir = model_path(engine.model)
        self.frontend = Frontend(model_dir, self.model, engine.max_model_len, self.config.openai)
        self.api_keys = load_api_keys(self.config.openai.api_keys)
        import ray

        # Where this ingress runs (`stats`): on a cluster, the node its placement (`ingress_resources`) chose.
        self.location = {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address()}
        if not self.api_keys:
            logger.warning("no API keys configured: every endpoint is open to anyone who can reach it "
                           "(set openai.api_keys or %s)", API_KEYS_FILE_ENV)
        # The recommended dtype where none is set: the engines may run fp32 instead (a CPU without native bf16), and
        # then a pull moves twice the bytes priced here, which the pull fit, measured at start-up, absorbs.
        shape = KVShape.from_model_dir(model_dir, engine.engine_dtype(), engine.block_size)
        self.directory = directory
        self.mirror = DirectoryMirror(directory, engine.block_size)
        self.mirror.start()
        # Replicas with a GPU each do not slow each other as CPU replicas of one node do.
        cost = CostModel(shape.kv_bytes, shared_compute=self.config.pool.num_gpus == 0)
        decode_engines = pools.get("decode_engines")
        if decode_engines is None:
            self.runner = TurnRunner(
                engines, self.mirror, cost, engine.model, engine.block_size, engine.nixl.hold_ttl_s,
                self.config.max_migrations,
            )
        else:
            self.runner = DisaggregatedTurnRunner(
                engines, decode_engines, self.mirror, cost, engine.model, engine.block_size, engine.nixl.hold_ttl_s,
                self.config.max_migrations,
            )
        self.metrics = IngressMetrics(shape.kv_bytes)
        self.turns_running = 0
        # (before the engine call, after the last delta) ms of recent one-turn HTTP responses (`_own_work`).
        self.own_ms: deque[tuple[float, float]] = deque(maxlen=1024)
        self.pools = {PREFILL_POOL: engines, **pools}
        self.created = now()
        vocab = len(self.frontend.renderer.renderer.get_tokenizer())
        self._calibration = asyncio.get_running_loop().create_task(calibrate(
            self.turn, self._prefill_replicas, self.config.pool.num_replicas, cost, vocab, self.max_model_len,
        ))

    def __serve_build_asgi_app__(self) -> Starlette:
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

    def _guarded(self, endpoint):
        """The route behind the API-key check (open routes and a keyless deployment pass through)."""
        async def guarded(request: Request) -> Response:
            if self.api_keys and request.url.path not in OPEN_ROUTES and self._key(request) is None:
                self.metrics.errors.labels(kind="client").inc()
                return openai_error(401, "a valid API key is required: send it as 'Authorization: Bearer <key>'",
                                    code="invalid_api_key")
            return await endpoint(request)
        return guarded

    def _key(self, request: Request) -> str | None:
        """The configured API key the request carries, else None."""
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return None
        key = key.strip()
        return next((k for k in self.api_keys if hmac.compare_digest(k.encode(), key.encode())), None)

    def _tenant(self, request: Request) -> str:
        """Whose KV a request's turn is: its API key (hashed), or without keys its Authorization header (hashed)."""
        if self.api_keys:
            return hashed(self._key(request) or "")
        return hashed(request.headers.get("authorization", ""))

    # ------------------------------------------------------------------------------ HTTP routes

    async def health(self, request: Request) -> JSONResponse:
        replicas = self.runner.replicas()
        # Whether the start-up calibration has run (`make serve` waits for it: app/serve_progress.py).
        calibrated = self._calibration.done()
        if not replicas:
            return JSONResponse({"status": "starting", "replicas": 0, "calibrated": calibrated}, 503)
        return JSONResponse({"status": "ok", "replicas": len(replicas), "calibrated": calibrated})

    async def version(self, request: Request) -> JSONResponse:
        import vllm

        return JSONResponse({"version": vllm.__version__, "kvrelay": _kvrelay_version()})

    async def models(self, request: Request) -> JSONResponse:
        card = {"id": self.model, "object": "model", "created": self.created, "owned_by": "kvrelay",
                "root": self.config.pool.engine.model, "max_model_len": self.max_model_len}
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

    async def http_tokenize(self, request: Request) -> Response:
        return await self._tokenization(request, self.frontend.tokenize)

    async def http_detokenize(self, request: Request) -> Response:
        return await self._tokenization(request, self.frontend.detokenize)

    async def _tokenization(self, request: Request, call) -> Response:
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
        arrived = time.perf_counter()
        headers: dict[str, str] = {}
        try:
            req = parse_request(request_cls, await self._body(request))
            turns = await self._turns(req, self._tenant(request), request.headers.get("x-session-id"),
                                      request.headers.get("x-kvrelay-policy"))
            if req.stream:
                stream = self._stream(req, turns)
                first = await anext(stream)  # planning and prefill errors surface here, before any byte is sent
                headers["x-kvrelay-plan"] = json.dumps(first[1].public(), separators=(",", ":"))
            else:
                body, outcome = await self._respond(req, turns)
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
                self._own_work(arrived, outcome)
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

    def _own_work(self, arrived: float, outcome: TurnOutcome) -> None:
        """Record what a one-turn response cost this ingress outside its engine request: from the request's arrival
        to the engine call, and from the last delta to the response (built, about to be sent)."""
        if outcome.engine_called_at is not None and outcome.last_delta_at is not None:
            self.own_ms.append(((outcome.engine_called_at - arrived) * 1e3,
                                (time.perf_counter() - outcome.last_delta_at) * 1e3))

    # ------------------------------------------------------------------------------ OpenAI requests as turns

    async def _turns(
        self, req: OpenAIRequest, tenant: str, session_id: str | None, policy: str | None
    ) -> list[list[Choice]]:
        """Render the request with vLLM's front end; per prompt (a completion may batch several), its `n` choices,
        each a turn of its own."""
        if req.kv_transfer_params is not None:
            raise ClientError(400, "kv_transfer_params cannot be set by clients: kvrelay plans KV reuse itself and "
                              "never lets a request name KV blocks", param="kv_transfer_params")
        if req.prompt_logprobs is not None and self.fast_prefill:
            raise ClientError(400, "prompt_logprobs cannot be served by this deployment: it runs KV-sharing fast "
                              "prefill, whose shared layers skip prompt positions; drop prompt_logprobs",
                              param="prompt_logprobs")
        if isinstance(req, ChatCompletionRequest):
            rendered = [await self.frontend.render_chat(req)]
        else:
            rendered = await self.frontend.render_completion(req)
        if req.cache_salt:  # the client's own isolation within its tenant
            tenant = hashed(f"{tenant}/{req.cache_salt}")
        session_id = session_id or req.session_id
        prompts = []
        for r in rendered:
            self._check_room(r)
            choices = []
            for index in range(req.n):
                params = r.sampling_params.clone()
                params.n = 1
                if params.seed is not None and index:  # n samples, as different as vLLM's n from one seed
                    params.seed = (params.seed + index) % 2**63
                turn = Turn(request_id=f"{r.request_id}-{index}" if req.n > 1 else r.request_id,
                            token_ids=list(r.token_ids), params=params, tenant=tenant, session_id=session_id,
                            policy=self._policy(policy), priority=r.priority)
                choices.append(Choice(r, turn, len(prompts) * req.n + index))
            prompts.append(choices)
        return prompts

    def _check_room(self, rendered: RenderedRequest) -> None:
        room = self.max_model_len - len(rendered.token_ids)
        asked = rendered.sampling_params.max_tokens or 1
        if room < 1 or asked > room:
            raise ClientError(
                400,
                f"this model's context is {self.max_model_len} tokens, but the prompt has {len(rendered.token_ids)} "
                f"tokens and max_tokens asks for {asked} more; shorten the prompt or lower max_tokens",
                param="max_tokens" if room >= 1 else "messages", code="context_length_exceeded",
            )

    async def _respond(self, req: OpenAIRequest, prompts: list[list[Choice]]) -> tuple[BaseModel, TurnOutcome]:
        """The whole (non-streaming) response, and the first turn's outcome."""
        turns = [c.turn for choices in prompts for c in choices]
        if len(turns) == 1:  # most requests: no task of its own (gather's costs a loop turn before the response)
            results = [await self._collect(turns[0])]
        else:
            results = await asyncio.gather(*(self._collect(turn) for turn in turns))
        outcome = results[0][1]
        outputs, at = [], 0
        for choices in prompts:
            outputs.append([deltas for deltas, _ in results[at:at + len(choices)]])
            at += len(choices)
        if isinstance(req, ChatCompletionRequest):
            body = await self.frontend.chat_response(req, prompts[0][0].rendered, outputs[0])
        else:
            body = await self.frontend.completion_response(req, [choices[0].rendered for choices in prompts], outputs)
        return body, outcome

    async def _stream(
        self, req: OpenAIRequest, prompts: list[list[Choice]]
    ) -> AsyncIterator[tuple[dict[str, Any], TurnOutcome]]:
        """The stream's chunk dicts, choice after choice; the chunk that finishes a turn, and the usage chunk,
        carry its `kvrelay`."""
        chat = isinstance(req, ChatCompletionRequest)
        chunks = self.frontend.chat_chunks if chat else self.frontend.completion_chunks
        outputs: list[list[list[GenerateDelta]]] = []
        for choices in prompts:
            outputs.append([])
            for choice in choices:
                outcome: list[TurnOutcome] = []
                deltas = self._deltas(choice.turn, outcome)
                async for chunk, delta in chunks(req, choice.rendered, choice.index, deltas):
                    body = chunk.model_dump(mode="json")
                    if delta.finished:
                        body["kvrelay"] = outcome[0].public()
                        outputs[-1].append([delta])
                    yield body, outcome[0]
        if req.stream_options and req.stream_options.include_usage:
            yield {"id": prompts[0][0].rendered.request_id, "object": "chat.completion.chunk" if chat else
                   "text_completion", "created": now(), "model": self.model, "choices": [],
                   "usage": usage(outputs).model_dump(mode="json"), "kvrelay": outcome[0].public()}, outcome[0]

    async def _deltas(self, turn: Turn, outcome: list[TurnOutcome]) -> AsyncIterator[GenerateDelta]:
        """The turn's deltas; its outcome lands in `outcome` with the first one."""
        async for delta, turn_outcome in self._run(turn):
            if not outcome:
                outcome.append(turn_outcome)
            yield delta

    # ------------------------------------------------------------------------------ Python handle API

    async def chat(
        self,
        request: ChatCompletionRequest | dict[str, Any],
        tenant: str = "",
        session_id: str | None = None,
        policy: str | None = None,
    ):
        """`handle.chat.remote(req)` -> a response dict (vLLM's ChatCompletionResponse plus `kvrelay`); with
        `handle.options(stream=True)` and `stream: true`, an async stream of chunk dicts (what SSE carries)."""
        return await self._handle_call(ChatCompletionRequest, request, tenant, session_id, policy)

    async def completions(
        self,
        request: CompletionRequest | dict[str, Any],
        tenant: str = "",
        session_id: str | None = None,
        policy: str | None = None,
    ):
        """`handle.completions.remote(req)` -> a CompletionResponse dict plus `kvrelay` (streams like `chat`)."""
        return await self._handle_call(CompletionRequest, request, tenant, session_id, policy)

    async def _handle_call(self, request_cls, request, tenant: str, session_id: str | None, policy: str | None):
        req = request if isinstance(request, request_cls) else parse_request(request_cls, request)
        turns = await self._turns(req, tenant, session_id, policy)
        if req.stream:
            return (chunk async for chunk, _ in self._stream(req, turns))
        body, outcome = await self._respond(req, turns)
        body.kvrelay = KVRelayInfo(**outcome.public())
        return body

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
        turn = Turn(new_id("turn"), list(token_ids), Sampling.model_validate(sampling).to_params(), tenant,
                    policy=self._policy(policy))
        forced = (Mode(force[0]), force[1]) if force else None
        started = time.monotonic()
        deltas, outcome = await self._collect(turn, forced)
        last = deltas[-1]
        return TurnResult(
            token_ids=[t for d in deltas for t in d.token_ids],
            text="".join(d.text for d in deltas),
            finish_reason=last.finish_reason,
            usage=TurnUsage(prompt_tokens=last.prompt_tokens, completion_tokens=last.completion_tokens,
                            cached_tokens=last.num_cached_tokens),
            kvrelay=KVRelayInfo(**outcome.public()),
            ttft_ms=outcome.ttft_ms,
            latency_ms=(time.monotonic() - started) * 1e3,
        )

    async def plan(self, token_ids: list[int], replicas: list[str] | None = None, tenant: str = "") -> dict[str, Any]:
        """What the planner would do for this turn now (nothing runs); `replicas` limits the targets."""
        turn = Turn(new_id("plan"), list(token_ids), Sampling().to_params(), tenant)
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
        """Planner counters, the cost model's current fit, the directory, the replicas and where this ingress runs."""
        directory_stats = await self.directory.stats.remote()
        plan_ms = sorted(self.runner.plan_ms)
        before, after = sorted(b for b, _ in self.own_ms), sorted(a for _, a in self.own_ms)
        # Each replica's process and its vLLM engine processes, on the replica's node: what a supervisor checks.
        # A simulated replica says how much slower than its modelled hardware it runs (`time_dilation`).
        processes = {i.replica_id: {"pid": i.pid, "engine_pids": i.engine_pids}
                     | ({"time_dilation": i.time_dilation} if i.time_dilation is not None else {})
                     for i in self.mirror.identities()}
        return {
            "ingress": self.location,
            "counters": dict(self.runner.counters),
            "cost_model": self.runner.cost.snapshot(),
            "directory": directory_stats._asdict(),
            "mirror": self.mirror.stats(),
            "plan_ms": {"p50": plan_ms[len(plan_ms) // 2], "p99": plan_ms[int(0.99 * (len(plan_ms) - 1))],
                        "samples": len(plan_ms)} if plan_ms else None,
            # What one-turn HTTP responses cost this ingress outside the engine request (parse, render, plan; and
            # derender, respond), medians.
            "ingress_own_ms": {"before_engine_p50": before[len(before) // 2],
                               "after_engine_p50": after[len(after) // 2],
                               "samples": len(before)} if before else None,
            "replicas": [r.model_dump() | processes.get(r.replica_id, {}) for r in self.runner.replicas()],
            # Prompts whose history's tokens were reused rather than tokenized again (app/prompt_tokens.py).
            "prompt_token_reuse": self.frontend.prompt_tokens.public(),
        }

    # ------------------------------------------------------------------------------ turns

    def _policy(self, requested: str | None) -> Policy:
        """The deployment's policy, or the one a request names (`x-kvrelay-policy`, for side-by-side benchmarks)."""
        if requested is None:
            return self.config.policy
        try:
            return Policy(requested)
        except ValueError:
            raise ClientError(400, f"unknown placement policy {requested!r}; known: {[p.value for p in Policy]}",
                              param="x-kvrelay-policy") from None

    async def _run(
        self, turn: Turn, force: tuple[Mode, str] | None = None
    ) -> AsyncIterator[tuple[GenerateDelta, TurnOutcome]]:
        """The turn's deltas, if this ingress has room for another turn (else a 429 before anything runs). A turn
        holds its place until its last delta, or until its consumer stops reading (a client that disconnects
        closes this generator, which cancels the engine request)."""
        if self.turns_running >= self.config.ingress_max_turns:
            self.metrics.errors.labels(kind="overload").inc()
            raise ClientError(429, f"this ingress is running its limit of {self.config.ingress_max_turns} turns; "
                              f"retry in {RETRY_AFTER_S} s", code="rate_limit_exceeded",
                              headers={"Retry-After": str(RETRY_AFTER_S)})
        self.turns_running += 1
        started = time.monotonic()
        try:
            async for delta, outcome in self.runner.run(turn, force):
                if delta.finished:
                    self.metrics.observe_turn(outcome, delta, time.monotonic() - started, turn.policy.value)
                yield delta, outcome
        except Exception as exc:
            if caused_by(exc, BackPressureError):
                self.metrics.errors.labels(kind="overload").inc()
                raise ClientError(429, f"the engines' queue is full; retry in {RETRY_AFTER_S} s",
                                  code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
            refused = caused_by(exc, InvalidRequestError)
            if refused is None:
                raise
            raise ClientError(400, str(refused)) from None
        finally:
            self.turns_running -= 1

    async def _collect(
        self, turn: Turn, force: tuple[Mode, str] | None = None
    ) -> tuple[list[GenerateDelta], TurnOutcome]:
        items = [item async for item in self._run(turn, force)]
        return [delta for delta, _ in items], items[-1][1]


def _kvrelay_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvrelay")
    except PackageNotFoundError:
        return "unknown"
