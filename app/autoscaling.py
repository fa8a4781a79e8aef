"""Serve autoscaling policy for engine replicas: queue depth, KV cache usage and TTFT against targets.

Serve's default policy counts ongoing requests only. An LLM replica is overloaded by other things too: a
full KV cache (requests wait for blocks) and a slow first token (long prompts queue behind each other).
Each replica reports those through `EngineReplica.record_autoscaling_stats`; this policy, run by the Serve
controller, scales the pool so that the worst of the three ratios observed/target comes back to 1:

    desired = ceil(current * max(ongoing / target_ongoing, kv_usage / target_kv_usage, ttft / target_ttft))

Serve applies min/max replicas, upscale/downscale delays and scaling factors on top (`AutoscalingConfig`).
The ceiling gives hysteresis: two replicas at 60% pressure stay two, at 45% they become one.
"""

from __future__ import annotations

import math
from typing import Any

from actors.replica_api import KV_CACHE_USAGE, ONGOING_REQUESTS, TTFT_MS


class EngineAutoscalingPolicy:
    """A class-callable Serve policy; `policy_kwargs` in the AutoscalingPolicy are its targets."""

    def __init__(
        self, target_ongoing_requests: float = 4.0, target_kv_cache_usage: float = 0.8, target_ttft_ms: float = 2000.0
    ) -> None:
        if min(target_ongoing_requests, target_kv_cache_usage, target_ttft_ms) <= 0:
            raise ValueError("autoscaling targets must be positive")
        self.targets = {ONGOING_REQUESTS: target_ongoing_requests, KV_CACHE_USAGE: target_kv_cache_usage,
                        TTFT_MS: target_ttft_ms}

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        """(desired replicas, policy state) from one controller tick's `AutoscalingContext`."""
        current = ctx.current_num_replicas
        if current == 0:
            return 1, {}
        ratios = self.ratios(ctx.aggregated_metrics or {}, current, ctx.total_queued_requests or 0.0)
        pressure = max(ratios.values())
        desired = max(1, math.ceil(current * pressure - 1e-9))
        return desired, {"pressure": round(pressure, 3), "ratios": ratios, "desired": desired}

    def ratios(
        self, metrics: dict[str, dict[Any, float]], current: int, queued_at_handles: float = 0.0
    ) -> dict[str, float]:
        """Observed / target per signal: mean ongoing requests (handle queues included), mean KV cache
        usage, and the worst replica's recent TTFT (one slow replica is enough to add capacity)."""

        def values(name: str) -> list[float]:
            return list((metrics.get(name) or {}).values())

        ongoing = (sum(values(ONGOING_REQUESTS)) + queued_at_handles) / current
        kv = values(KV_CACHE_USAGE)
        ttft = values(TTFT_MS)
        observed = {
            ONGOING_REQUESTS: ongoing,
            KV_CACHE_USAGE: sum(kv) / len(kv) if kv else 0.0,
            TTFT_MS: max(ttft, default=0.0),
        }
        return {name: round(observed[name] / self.targets[name], 3) for name in self.targets}
