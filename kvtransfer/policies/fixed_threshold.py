"""vLLM's fixed threshold: each turn on the next replica in turn, pulling the history from its holder whenever
the pull adds at least `VLLM_PULL_THRESHOLD` tokens to what the target's prefix cache has; no cost model."""

from __future__ import annotations

from collections.abc import Sequence

from kvtransfer.options import Mode, Option
from kvtransfer.policies.base import PlacementPolicy, PolicyContext, register, without_pull
from kvtransfer.policies.round_robin import next_in_turn

# vLLM's own rule (`kv_recompute_threshold`): pull whenever the remote prefix has at least this many tokens.
VLLM_PULL_THRESHOLD = 64


@register
class FixedThresholdPolicy(PlacementPolicy):
    name = "fixed_threshold"
    pulls = True

    def choose(self, options: Sequence[Option], context: PolicyContext) -> Option:
        target = next_in_turn(options, context.rotation)
        own = without_pull(options, target)
        pulls = [o for o in options if o.replica_id == target and o.mode is Mode.PULL]
        longest = max(pulls, key=lambda o: o.reused_tokens, default=None)
        if longest is not None and longest.reused_tokens - own.cached_tokens >= VLLM_PULL_THRESHOLD:
            return longest
        return own
