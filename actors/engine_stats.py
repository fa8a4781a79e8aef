"""A replica's load and measured speed: its engine's per-step figures (vLLM's scheduler stats, or a modelled
engine's), the replica's own request counts, token rates and recent times to first token, reported as `ReplicaStats`
(directory, planner) and autoscaling figures."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from actors.replica_api import KV_CACHE_USAGE, ONGOING_REQUESTS, TTFT_MS, ReplicaStats


class RateMeter:
    """Exponential moving average of a tokens-per-second rate. Not thread-safe (one event loop)."""

    def __init__(self, alpha: float = 0.3) -> None:
        self.alpha = alpha
        self.value: float | None = None

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        self.value = rate if self.value is None else (1 - self.alpha) * self.value + self.alpha * rate


class EngineStats:
    """What one replica knows of its engine's load. Updated on the replica's event loop (requests) and by the engine's
    steps (`observe_engine`; vLLM's stat logger calls it); the directory reporter's thread only reads it
    (`replica_stats`)."""

    TTFT_WINDOW_S = 10.0

    def __init__(self) -> None:
        # As of the engine's latest step: requests waiting to be scheduled, the KV cache's share in use (0-1), and the
        # prefix cache's hit rate over recent requests.
        self._waiting = 0
        self._kv_cache_usage = 0.0
        self._hit_rate = 0.0
        self._prefill_rate = RateMeter()
        self._decode_rate = RateMeter()
        self._finished = 0
        self.ongoing = 0
        self._started = 0
        # (monotonic finish time, TTFT ms) of recent requests, for the autoscaling policy.
        self._recent_ttft: deque[tuple[float, float]] = deque(maxlen=512)

    def stat_logger(self, vllm_config: Any, engine_index: int = 0) -> Any:
        """vLLM's stat logger factory (`AsyncLLM(stat_loggers=[...])`): keeps the engine's latest scheduler stats."""
        from vllm.v1.metrics.loggers import StatLoggerBase
        from vllm.v1.metrics.stats import CachingMetrics

        stats = self
        prefix_cache = CachingMetrics()

        class _ReplicaStatLogger(StatLoggerBase):
            """Keeps the engine's latest scheduler stats on the replica (vLLM calls it every step)."""

            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
                if scheduler_stats is not None:
                    prefix_cache.observe(scheduler_stats.prefix_cache_stats)
                    stats.observe_engine(scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs,
                                         scheduler_stats.kv_cache_usage, prefix_cache.hit_rate)

            def log_engine_initialized(self) -> None:
                pass

        return _ReplicaStatLogger(vllm_config, engine_index)

    def observe_engine(self, waiting: int, kv_cache_usage: float, hit_rate: float) -> None:
        """The engine's figures after a step: requests waiting to be scheduled, KV cache in use (0-1), prefix cache hit
        rate over recent requests."""
        self._waiting, self._kv_cache_usage, self._hit_rate = waiting, kv_cache_usage, hit_rate

    def request_started(self) -> tuple[bool, int]:
        """Count a request in; returns whether it has the engine to itself, and its start number (see `alone`)."""
        alone = self.ongoing == 0
        self.ongoing += 1
        self._started += 1
        return alone, self._started

    def started_since(self, started_as: int) -> bool:
        """Whether another request started after the one numbered `started_as`."""
        return self._started != started_as

    def request_ended(self) -> None:
        self.ongoing -= 1

    def observe_finished(
        self, out: Any, started: float, first_token_at: float | None, finished_at: float, completion: int,
        alone: bool,
    ) -> float | None:
        """Feed a finished vLLM request's (`out`) prefill and decode timings to the rate meters; returns prefill
        seconds."""
        prefill_s = None
        if first_token_at is not None:
            metrics = out.metrics
            if metrics is not None and metrics.scheduled_ts and metrics.first_token_ts:
                prefill_s = metrics.first_token_ts - metrics.scheduled_ts
            else:
                prefill_s = first_token_at - started
        computed = len(out.prompt_token_ids or ()) - (out.num_cached_tokens or 0)
        return self.observe_request(started, first_token_at, finished_at, prefill_s, computed, completion, alone)

    def observe_request(
        self, started: float, first_token_at: float | None, finished_at: float, prefill_s: float | None,
        computed: int, completion: int, alone: bool,
    ) -> float | None:
        """Feed a finished request's timings (time.monotonic() instants; `computed` prompt tokens in `prefill_s`) to
        the rate meters; returns `prefill_s`."""
        self._finished += 1
        if first_token_at is None or prefill_s is None:
            return None
        self._recent_ttft.append((finished_at, (first_token_at - started) * 1e3))
        # Very short prefills measure scheduling overhead, not the model's speed.
        if computed >= 32 and alone:
            self._prefill_rate.observe(computed, prefill_s)
        if completion > 1:
            self._decode_rate.observe(completion - 1, finished_at - first_token_at)
        return prefill_s

    def replica_stats(self, replica_id: str, pool: str, node_id: str) -> ReplicaStats:
        # The engine's counts are as of its last step, which may be long ago on an idle engine; the
        # replica's own count of requests in flight is exact, so it bounds both.
        waiting = min(self._waiting, self.ongoing)
        return ReplicaStats(
            replica_id=replica_id,
            pool=pool,
            node_id=node_id,
            at=time.time(),
            running=self.ongoing - waiting,
            waiting=waiting,
            kv_cache_usage=self._kv_cache_usage,
            prefix_cache_hit_rate=self._hit_rate,
            prefill_tok_s=self._prefill_rate.value,
            decode_tok_s=self._decode_rate.value,
            requests_finished=self._finished,
        )

    def autoscaling(self) -> dict[str, float]:
        """ongoing_requests: requests inside the replica now; kv_cache_usage: the engine's KV cache in use (0-1);
        ttft_ms: the 90th percentile time to first token of requests finished in the last TTFT_WINDOW_S (0 if none)."""
        now = time.monotonic()
        recent = sorted(ms for at, ms in self._recent_ttft if now - at <= self.TTFT_WINDOW_S)
        return {
            ONGOING_REQUESTS: float(self.ongoing),
            KV_CACHE_USAGE: float(self._kv_cache_usage),
            TTFT_MS: recent[int(0.9 * (len(recent) - 1))] if recent else 0.0,
        }


class ReportsLoad:
    """The calls any engine replica, real or simulated, answers about its load: the planner's and the directory's
    figures (`stats`, each heartbeat's `_stats_now`), Serve's autoscaling figures, and the process's Prometheus
    metrics. The replica sets `load` (its `EngineStats`), `replica_id`, `pool` and `node_id`."""

    load: EngineStats
    replica_id: str
    pool: str
    node_id: str

    async def stats(self) -> ReplicaStats:
        return self._stats_now()

    def _stats_now(self) -> ReplicaStats:
        return self.load.replica_stats(self.replica_id, self.pool, self.node_id)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve calls this every metrics interval; `app.autoscaling.EngineAutoscalingPolicy` reads it."""
        return self.load.autoscaling()

    async def metrics(self, probe: dict[str, Any]) -> str:
        """The process's Prometheus metrics in text format (a vLLM engine's `vllm:*` among them: AsyncLLM records
        them here). `probe` only carries `target_replica`, so the replica router sends the call to this replica."""
        from prometheus_client import REGISTRY, generate_latest

        return generate_latest(REGISTRY).decode()
