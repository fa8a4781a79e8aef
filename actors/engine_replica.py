"""The engine replica, as Serve sees it: one vLLM `AsyncLLM` behind `generate`, `release_hold`, tokenizing and stats.

`EngineReplica` is a plain class; `app/builder.py` wraps it with `serve.deployment`, and tests or benchmarks may
also construct it directly inside one process. Where its engine runs is `actors/engine_site.py`, starting it
`actors/vllm_engine.py`, its load figures `actors/engine_stats.py`, its reports to the KV directory
`actors/directory_reporter.py`.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
    GenerateLogProb,
    GenerateLogProbs,
    GenerateLogProbsContent,
)

from actors.directory_reporter import DirectoryReporter
from actors.engine_site import choose_site, node_identity, replica_place
from actors.engine_stats import EngineStats, ReportsLoad
from actors.replica_api import (
    GenerateDelta,
    GenerateRequest,
    HoldRelease,
    InvalidRequestError,
    ReplicaIdentity,
)
from actors.vllm_engine import (
    HoldStepper,
    check_platform_limits,
    engine_process_ids,
    lower_engine_priority,
    quiet_holds,
    start_engine,
)
from configs.engine import EngineConfig
from kvtransfer.connector import LOAD_FAILED, export_params, is_load_failure
from kvtransfer.kv_digest import DIGESTS_KEY
from kvtransfer.types import Hold, HoldId
from model_prep.store import model_path

logger = logging.getLogger(__name__)


# The OpenAI shapes' floor for a logprob (-inf and NaN do not survive JSON).
LOGPROB_FLOOR = -9999.0


def _clamp(logprob: float) -> float:
    return LOGPROB_FLOOR if math.isnan(logprob) else max(logprob, LOGPROB_FLOOR)


def token_logprobs(token_ids: Sequence[int], logprobs: Any, top: int | None) -> GenerateLogProbs | None:
    """The sampled tokens' logprobs and up to `top` alternatives each, in vLLM's token-in-token-out shape."""
    if logprobs is None or top is None:
        return None
    content = []
    for token_id, step in zip(token_ids, logprobs, strict=True):
        sampled = step.get(token_id) if step else None
        alternatives = sorted(step.items(), key=lambda kv: kv[1].rank or 0)[: max(top, 0)] if step else []
        content.append(GenerateLogProbsContent(
            token_id=token_id,
            logprob=_clamp(sampled.logprob) if sampled else LOGPROB_FLOOR,
            rank=(sampled.rank or None) if sampled else None,
            top_logprobs=[GenerateLogProb(token_id=t, logprob=_clamp(lp.logprob), rank=lp.rank or None)
                          for t, lp in alternatives],
        ))
    return GenerateLogProbs(content=content)


class EngineReplica(ReportsLoad):
    """One vLLM engine. Methods are coroutines run on the replica's single event loop."""

    HEARTBEAT_S = 0.5

    def __init__(self, config: EngineConfig | dict[str, Any], directory: Any = None, log_level: str | None = None,
                 hold_key: str | None = None) -> None:
        """Start the engine. With `directory` (a handle to the KV directory deployment), report identity, load
        and prefix-cache events to it (`actors/directory_reporter.py`). `log_level` sets vLLM's logging here and in
        the engine processes this replica starts. `hold_key`, shared by the replicas of one app, seals the holds
        this replica exports and checks those it reads (default: a key of its own, so it reads no other's holds)."""
        if log_level is not None:
            os.environ["VLLM_LOGGING_LEVEL"] = log_level  # read by vLLM in each engine process it spawns
            logging.getLogger("vllm").setLevel(log_level)
        self.config = EngineConfig.model_validate(config)
        self._hold_key = (hold_key or secrets.token_hex(16)).encode()
        place = replica_place()
        self.replica_id, local_rank, self.pool = place.replica_id, place.local_rank, place.deployment
        self.node_id, node_ip = node_identity()
        self.engine_id = f"{self.replica_id}-{uuid.uuid4().hex[:8]}"
        self._hold_serials = itertools.count()  # this engine's holds' ids (`HoldId`), minted at export

        from vllm.platforms import current_platform

        device_type = current_platform.device_type
        nixl = self.config.nixl
        self.site = choose_site(
            self.config, self.engine_id, local_rank, node_ip, current_platform.is_cpu(), directory is not None
        )
        self.model_path = model_path(self.config.model)
        check_platform_limits(self.config, self.model_path, device_type)
        self.load = EngineStats()
        self.engine = start_engine(self.config, self.model_path, self.site, device_type, self.load.stat_logger)
        self.engine_pids = engine_process_ids(self.engine)
        if current_platform.is_cpu():  # the engine processes compute the model: the request path goes first
            lower_engine_priority(self.engine_pids, self.config.engine_nice)
        # kvrelay's connector reads this engine's own holds by copying blocks in host memory (throttled_nixl.py).
        self._reads_own_holds = device_type == "cpu"
        self._hold_stepper = None
        if quiet_holds(self.config, device_type):
            self._hold_stepper = HoldStepper(self.engine, nixl.hold_step_s, nixl.hold_ttl_s)
        self._reporter = None
        if directory is not None:
            self._reporter = DirectoryReporter(
                directory, self._identity(), self._stats_now, self.HEARTBEAT_S, self.site.events_endpoints
            )
        logger.info(
            "replica %s started engine %s (model %s, fast prefill %s, nixl %s:%s, cores %s)",
            self.replica_id, self.engine_id, self.config.model, self.config.fast_prefill,
            self.site.nixl_host, self.site.nixl_port, self.site.cpu_cores,
        )

    @property
    def cpu_cores(self) -> list[int] | None:
        return self.site.cpu_cores

    # ----------------------------------------------------------------------------- serving

    def _finish_calls_engine(self, out: Any, request: GenerateRequest) -> bool:
        """Whether finishing `request` waits on its engine: for the digests of the hold it exports, or for the verdict
        on what it pulled (both only with `nixl.verify_pulls`)."""
        return self.config.nixl.verify_pulls and (bool(out.kv_transfer_params) or request.pull is not None)

    def _sampling_params(self, request: GenerateRequest) -> Any:
        """The request's SamplingParams as this replica runs them: deltas out, and the KV transfer it makes."""
        from vllm.sampling_params import RequestOutputKind

        params = request.params.clone()
        if params.n != 1:  # the ingress makes each of a request's n choices a turn of its own
            raise InvalidRequestError(f"n={params.n}: a replica runs one sequence per request; send n=1")
        if params.prompt_logprobs is not None and self.config.fast_prefill:
            raise InvalidRequestError(
                "prompt_logprobs cannot be served by a replica running KV-sharing fast prefill (the "
                "shared layers skip prompt positions, so prompt logprobs would be wrong); drop "
                "prompt_logprobs or use a deployment with kv_sharing_fast_prefill=false"
            )
        request.check_context(self.config.max_model_len)
        params.output_kind = RequestOutputKind.DELTA
        if request.skip_prefix_cache:
            params.skip_reading_prefix_cache = True
        params.extra_args = {**(params.extra_args or {}), "kv_transfer_params": self._transfer_params(request)}
        return params

    def _transfer_params(self, request: GenerateRequest) -> dict[str, Any] | None:
        """vLLM's `kv_transfer_params` for this request: read the KV it names (a pull, P/D's handoff too), else export
        a hold so the next turn can pull from here."""
        if request.pull is not None:
            return request.pull.pull_params()
        if self.config.nixl.enabled and self.config.nixl.bidirectional and request.export_hold:
            return export_params()
        return None

    async def release_hold(self, release: HoldRelease | dict[str, Any]) -> None:
        """Free another replica's hold before its lease ends; its blocks return to that replica's cache."""
        release = HoldRelease.model_validate(release)
        if not release.hold.authentic(self._hold_key):
            raise InvalidRequestError("this hold was not sealed by a replica of this app; it is not released")
        if release.hold.engine_id == self.engine_id:
            # The release reaches a holder through its NIXL peer. Sent here anyway (Serve could not route it to the
            # replica the ingress chose): the hold lasts until its lease ends, as it would have without a release.
            logger.debug("release of own hold %s: it lasts until its lease ends", release.hold.request_id)
            return
        await self.engine.notify_kv_transfer_request_rejected(
            f"release-{uuid.uuid4().hex}", release.hold.release_params()
        )

    async def generate(self, request: GenerateRequest | dict[str, Any]) -> AsyncIterator[GenerateDelta]:
        """Stream one generation as deltas; the last delta carries totals and the hold the engine exported."""
        from vllm import TextPrompt, TokensPrompt
        from vllm.exceptions import VLLMClientError

        request = GenerateRequest.model_validate(request)
        reads = request.pull
        if reads is not None and not (reads.authentic(self._hold_key) and reads.covers(request.prompt_token_ids or ())):
            # vLLM would read whatever blocks the hold names: never read a hold no replica of this app sealed for
            # exactly the tokens this prompt starts with. Reported as a failed pull, which the caller recomputes.
            logger.warning("request %s names a hold not sealed for its prompt; not reading it", request.request_id)
            yield GenerateDelta(token_ids=[], text="", finished=True, finish_reason=LOAD_FAILED,
                                replica_id=self.replica_id)
            return
        if request.pull is not None and (
            (request.pull.engine_id == self.engine_id and not self._reads_own_holds)
            or (request.own_hold and request.pull.engine_id != self.engine_id)
        ):
            # Either the held KV is this engine's own (the turn stays here, or Serve routed it here instead of the
            # planned puller) and this engine's cache is not in host memory: its prefix cache serves all but the
            # last partial block (NIXL cannot read from itself). Or the turn was to stay on its holder and Serve
            # could not route it there (the holder is draining or gone): compute here rather than pull from it.
            request = request.model_copy(update={"pull": None})
        params = self._sampling_params(request)
        prompt: Any = (
            TokensPrompt(prompt_token_ids=request.prompt_token_ids)
            if request.prompt_token_ids is not None
            else TextPrompt(prompt=request.prompt)
        )
        if request.cache_salt:
            prompt["cache_salt"] = request.cache_salt
        started = time.monotonic()
        first_token_at: float | None = None
        prompt_tokens = cached = completion = 0
        output_ids: list[int] = []
        stream = self.engine.generate(prompt, params, request.request_id, priority=request.priority)
        # Whether this request had the engine to itself until its first token: only then do its timings
        # measure the model and the link rather than whatever else was batched with it.
        alone, started_as = self.load.request_started()
        try:
            async for out in stream:
                completion_out = out.outputs[0]
                now = time.monotonic()
                if first_token_at is None and completion_out.token_ids:
                    first_token_at = now
                    alone = alone and not self.load.started_since(started_as)
                prompt_tokens = len(out.prompt_token_ids or ())
                cached = out.num_cached_tokens or 0
                completion += len(completion_out.token_ids)
                output_ids.extend(completion_out.token_ids)
                delta = GenerateDelta(
                    token_ids=list(completion_out.token_ids),
                    text=completion_out.text,
                    logprobs=token_logprobs(completion_out.token_ids, completion_out.logprobs, params.num_logprobs),
                    prompt_logprobs=(
                        [dict(p) if p is not None else None for p in out.prompt_logprobs]
                        if out.prompt_logprobs is not None else None
                    ),
                    replica_id=self.replica_id,
                )
                if out.finished:
                    if out.kv_transfer_params and self._hold_stepper is not None:
                        self._hold_stepper.hold_exported()
                    if delta.token_ids and self._finish_calls_engine(out, request):
                        # The last tokens go out before the engine calls below (each waits for the engine's next
                        # step: 5-40 ms beside a busy engine on CPU), so a one-token turn's first token is not
                        # delayed by them. A pull whose read was refused produced no token, so nothing streamed
                        # here came from unverified KV.
                        yield delta
                        delta = GenerateDelta(token_ids=[], text="", replica_id=self.replica_id)
                    delta.finished = True
                    delta.finish_reason = completion_out.finish_reason
                    delta.prompt_tokens = prompt_tokens
                    delta.completion_tokens = completion
                    delta.num_cached_tokens = cached
                    hold = Hold.from_params(out.kv_transfer_params, HoldId(self.engine_id, next(self._hold_serials)))
                    if hold is not None:
                        if self.config.nixl.verify_pulls:
                            hold = replace(hold, extra={**hold.extra, DIGESTS_KEY: await self.engine.collective_rpc(
                                "kvrelay_hold_digests", args=(hold.block_ids,))})
                        delta.hold = hold.sealed(self._hold_key, list(out.prompt_token_ids or ()) + output_ids)
                    if request.pull is not None and (self.config.nixl.verify_pulls
                                                     or is_load_failure(delta.finish_reason)):
                        verdicts = await self.engine.collective_rpc("kvrelay_read_verdict",
                                                                    args=(request.pull.request_id,))
                        delta.read_check = next((v for v in verdicts if v and v != "verified"), verdicts[0])
                    delta.ran_alone = alone and first_token_at is not None
                    if delta.ran_alone and completion > 1 and not self.load.started_since(started_as):
                        delta.decode_step_s = (now - first_token_at) / (completion - 1)
                    delta.prefill_s = self.load.observe_finished(out, started, first_token_at, now, completion, alone)
                    metrics = out.metrics
                    if metrics is not None and metrics.scheduled_ts and metrics.queued_ts:
                        delta.wait_s = metrics.scheduled_ts - metrics.queued_ts
                yield delta
        except (ValueError, VLLMClientError) as exc:
            if first_token_at is not None:
                raise
            # vLLM validates on admission (e.g. a prompt longer than the context) with ValueError subclasses
            # and its own client errors.
            raise InvalidRequestError(str(exc)) from exc
        finally:
            self.load.request_ended()

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.engine.get_tokenizer().encode(text, add_special_tokens=add_special_tokens))

    async def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of a chat history rendered with the model's own template."""
        tokenizer = self.engine.get_tokenizer()
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError(
                f"model {self.config.model!r} has no chat template; use /v1/completions with a plain prompt"
            )
        try:
            ids = tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=True
            )
        except Exception as exc:  # a template error is the messages' fault (roles, content types)
            raise InvalidRequestError(f"chat template failed on these messages: {exc}") from exc
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    # ----------------------------------------------------------------------------- introspection

    async def identity(self) -> ReplicaIdentity:
        return self._identity()

    def _identity(self) -> ReplicaIdentity:
        return ReplicaIdentity(
            replica_id=self.replica_id,
            engine_id=self.engine_id,
            nixl_host=self.site.nixl_host,
            nixl_port=self.site.nixl_port,
            node_id=self.node_id,
            pid=os.getpid(),
            engine_pids=self.engine_pids,
            cpu_cores=self.site.cpu_cores,
            model=self.config.model,
            fast_prefill=self.config.fast_prefill,
            block_size=self.config.block_size,
        )

    async def check_health(self) -> None:
        """Serve calls this periodically; a dead engine makes the replica restart."""
        await self.engine.check_health()

    def __del__(self) -> None:
        """Serve calls this on scale-down and shutdown: leave the directory first, then stop the engine."""
        reporter = getattr(self, "_reporter", None)
        if reporter is not None:
            reporter.stop()  # its last act deregisters this replica
        stepper = getattr(self, "_hold_stepper", None)
        if stepper is not None:
            stepper.stop()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
