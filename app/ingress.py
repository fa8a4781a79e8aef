"""The ingress deployment: construction, the Python handle API (`turn`, `chat`, `completions`, `plan`, `stats`,
`calibrated`) and admission, the 429 an ingress answers when it runs its limit of turns.

Its HTTP routes are `app/http.py` (API keys: `app/auth.py`); OpenAI requests become turns in
`app/openai_turns.py`. Every turn runs through `Ingress._run` on `app.turns.TurnRunner` (or
`app.disaggregated.DisaggregatedTurnRunner` when the app has a decode pool).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Collection
from typing import Any

from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.applications import Starlette
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest

from actors.replica_api import GenerateDelta, InvalidRequestError, Sampling
from app.auth import ApiKeys
from app.directory_mirror import DirectoryMirror
from app.disaggregated import DisaggregatedTurnRunner
from app.frontend import Frontend, parse_request
from app.http import RETRY_AFTER_S, HttpApi, OwnWork
from app.metrics import IngressMetrics
from app.openai_turns import OpenAITurns, collect, requested_policy
from app.responses import ClientError, KVRelayInfo, TurnResult, TurnUsage, caused_by, new_id
from app.turn_types import Turn, TurnOutcome
from app.turns import PREFILL_POOL, TurnRunner
from configs.app import AppConfig
from kvtransfer.calibration import calibrate
from kvtransfer.cost_model import CostModel
from kvtransfer.kv_shape import KVShape
from kvtransfer.options import Mode
from kvtransfer.policies import get_policy
from kvtransfer.sim.profile import load_profile
from model_prep.store import model_path


@serve.ingress()
class Ingress:
    """Entry point for HTTP (`/v1/...`, served by `self.http`) and Python handles (`chat`, `completions`, `turn`)."""

    async def __init__(
        self, config: dict[str, Any], directory: DeploymentHandle, engines: DeploymentHandle, **pools: DeploymentHandle
    ) -> None:
        self.config = AppConfig.model_validate(config)
        self.policy = get_policy(self.config.policy)
        engine = self.config.pool.engine
        model = self.config.openai.served_model_name or engine.model
        self.max_model_len = engine.max_model_len
        model_dir = model_path(engine.model)
        self.frontend = Frontend(model_dir, model, engine.max_model_len, self.config.openai)
        keys = ApiKeys.load(self.config.openai.api_keys)
        import ray

        # Where this ingress runs (`stats`): on a cluster, the node its placement (`ingress_resources`) chose.
        self.location = {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address()}
        # The recommended dtype where none is set: the engines may run fp32 instead (a CPU without native bf16), and
        # then a pull moves twice the bytes priced here, which the pull fit, measured at start-up, absorbs.
        shape = KVShape.from_model_dir(model_dir, engine.engine_dtype(), engine.block_size)
        self.directory = directory
        self.mirror = DirectoryMirror(directory, engine.block_size)
        self.mirror.start()
        # Replicas with a GPU each do not slow each other as CPU replicas of one node do; simulated ones do as their
        # profile models (64 simulated GPUs on one host are not 64 CPU engines sharing its cores).
        shared_compute = (load_profile(engine.sim_profile).contention_per_busy_peer > 0 if engine.kind == "sim"
                          else self.config.pool.num_gpus == 0)
        cost = CostModel(shape.kv_bytes, shared_compute=shared_compute)
        decode_engines = pools.get("decode_engines")
        if decode_engines is None:
            self.runner = TurnRunner(
                engines, self.mirror, cost, engine.model, engine.block_size, engine.nixl.hold_ttl_s,
                self.config.max_migrations, modelled_engines=engine.kind == "sim",
            )
        else:
            self.runner = DisaggregatedTurnRunner(
                engines, decode_engines, self.mirror, cost, engine.model, engine.block_size, engine.nixl.hold_ttl_s,
                self.config.max_migrations, modelled_engines=engine.kind == "sim",
            )
        self.metrics = IngressMetrics(shape.kv_bytes)
        self.turns_running = 0
        self.own_work = OwnWork()
        self.openai = OpenAITurns(self.frontend, model, self.max_model_len, engine.fast_prefill,
                                  self.policy, self._run)
        vocab = len(self.frontend.renderer.renderer.get_tokenizer())
        # `calibrate: false`: the task ends at once and the cost model keeps its priors.
        self._calibration = asyncio.get_running_loop().create_task(calibrate(
            self._calibration_turn, self._prefill_replicas, self.config.pool.num_replicas, cost, vocab,
            self.max_model_len,
        ) if self.config.calibrate else asyncio.sleep(0))
        self.http = HttpApi(
            keys=keys, openai=self.openai, frontend=self.frontend, metrics=self.metrics, own_work=self.own_work,
            runner=self.runner, pools={PREFILL_POOL: engines, **pools}, directory=directory, mirror=self.mirror,
            calibration=self._calibration, stats=self.stats, root_model=engine.model,
        )

    def __serve_build_asgi_app__(self) -> Starlette:
        return self.http.app()

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
        turns = await self.openai.turns(req, tenant, session_id, policy)
        if req.stream:
            return (chunk async for chunk, _ in self.openai.stream(req, turns))
        body, outcome = await self.openai.respond(req, turns)
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
                    policy=requested_policy(policy, self.policy))
        return await self._result(turn, force)

    async def _calibration_turn(self, token_ids: list[int], sampling: dict[str, Any], force: tuple[str, str],
                                tenant: str, hold: bool = False) -> TurnResult:
        """One forced turn of the start-up calibration (`kvtransfer.calibration.calibrate`'s `run_turn`); `hold`:
        a later calibration turn pulls its history."""
        turn = Turn(new_id("turn"), list(token_ids), Sampling.model_validate(sampling).to_params(), tenant,
                    policy=self.policy, calibration=True, calibration_hold=hold)
        return await self._result(turn, force)

    async def _result(self, turn: Turn, force: tuple[str, str] | None) -> TurnResult:
        """Run `turn` (as (mode, replica) if forced) and collect its result."""
        forced = (Mode(force[0]), force[1]) if force else None
        started = time.monotonic()
        deltas, outcome = await collect(self._run(turn, forced))
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
            "plan_ms": _percentiles(self.runner.plan_ms),
            # The planning thread's CPU time for the same plans: the planner's own cost on a saturated machine too.
            "plan_cpu_ms": _percentiles(self.runner.plan_cpu_ms),
            # Whether the planning thread ran its plans through: the share it was switched out of (waiting, for
            # the GIL too, or preempted by the OS), and the plans' times when it was not.
            "plan_switched": _switched(self.runner.plan_ms, self.runner.plan_switches),
            # What one-turn HTTP responses cost this ingress outside the engine request (parse, render, plan; and
            # derender, respond), medians.
            "ingress_own_ms": self.own_work.summary(),
            "replicas": [r.model_dump() | processes.get(r.replica_id, {}) for r in self.runner.replicas()],
            # Prompts whose history's tokens were reused rather than tokenized again (app/prompt_tokens.py).
            "prompt_token_reuse": self.frontend.prompt_tokens.public(),
        }

    # ------------------------------------------------------------------------------ admission

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
                    self.metrics.observe_turn(outcome, delta, time.monotonic() - started, turn.policy.name)
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


def _percentiles(ms: Collection[float]) -> dict[str, float] | None:
    """p50 and p99 of recent plans' times, and how many there were (None before the first plan)."""
    ordered = sorted(ms)
    if not ordered:
        return None
    return {"p50": ordered[len(ordered) // 2], "p99": ordered[int(0.99 * (len(ordered) - 1))], "samples": len(ordered)}


def _switched(ms: Collection[float], switches: Collection[tuple[int, int]]) -> dict[str, Any] | None:
    """Of recent plans: the share whose thread waited (a voluntary switch: the GIL, or blocking) and the share
    preempted (involuntary), and the times of those switched out of neither."""
    if not switches:
        return None
    pairs = list(zip(ms, switches, strict=True))
    return {"waited_share": round(sum(1 for _, (waits, _) in pairs if waits) / len(pairs), 4),
            "preempted_share": round(sum(1 for _, (_, preempted) in pairs if preempted) / len(pairs), 4),
            "unswitched_ms": _percentiles([t for t, (waits, preempted) in pairs if not waits and not preempted])}
