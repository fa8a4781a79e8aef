"""The types a conversation turn carries through the ingress: the turn, its outcome, and what a turn becomes when
the replica serving it dies mid-stream (its continuation elsewhere)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from ray.exceptions import RayActorError
from ray.serve.exceptions import ReplicaUnavailableError
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.exceptions import EngineDeadError

from actors.replica_api import GenerateDelta
from app.responses import caused_by
from kvtransfer.options import Mode
from kvtransfer.planner import Plan
from kvtransfer.policies import DEFAULT_POLICY, PlacementPolicy, get_policy
from kvtransfer.prefix_key import PrefixKey


class TurnLost(Exception):
    """Every replica a turn ran on died before its last token, `max_migrations` times over. The message is safe to
    show a client: it names no replica, actor or process."""


def lost_replica(exc: BaseException) -> bool:
    """Whether a failed engine call means its replica (or the engine inside it) is gone: the turn may continue
    elsewhere. Any other failure is not retried."""
    return caused_by(exc, RayActorError, ReplicaUnavailableError, EngineDeadError) is not None


def continuation(turn: Turn, produced: list[int]) -> Turn | None:
    """The rest of `turn` after `produced` tokens were streamed: their prompt with those tokens appended, sampling
    the remaining budget (prompt logprobs already went out with the first tokens). None if nothing is left."""
    if not produced:
        return turn
    params = turn.params.clone()
    if params.max_tokens is not None:
        params.max_tokens -= len(produced)
        if params.max_tokens < 1:
            return None
    params.min_tokens = max(0, params.min_tokens - len(produced))
    params.prompt_logprobs = None
    return replace(turn, token_ids=turn.token_ids + produced, params=params)


def whole_turn(last: GenerateDelta, turn: Turn, streamed: int, cached_tokens: int) -> GenerateDelta:
    """The last delta of the rest of `turn` (after `streamed` tokens came from elsewhere), its totals counted for
    the whole turn, `cached_tokens` of whose prompt were not computed."""
    return last.model_copy(update={"prompt_tokens": len(turn.token_ids), "num_cached_tokens": cached_tokens,
                                   "completion_tokens": streamed + last.completion_tokens})


@dataclass
class Turn:
    """One turn: the whole conversation so far as token ids, and how to sample the reply."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    # Whose KV this is (an API key or cache salt); turns of different tenants never share KV.
    tenant: str = ""
    # A placement hint only (X-Session-Id): equal options go to the replica that id usually maps to.
    session_id: str | None = None
    # How the turn is placed; the baselines exist so benchmarks can compare on the same engines.
    policy: PlacementPolicy = field(default_factory=lambda: get_policy(DEFAULT_POLICY))
    # vLLM's scheduling priority (lower runs first; engines refuse non-zero ones unless they schedule by priority).
    priority: int = 0
    # A turn of the start-up calibration (kvtransfer/calibration.py): forced, yet it teaches the planner's estimate
    # error; its output length (set by the calibration) says nothing of how long turns decode.
    calibration: bool = False
    # A calibration turn whose history a later calibration turn pulls: the only calibration turns that leave a hold.
    calibration_hold: bool = False
    # The token ids hashed into blocks (`TurnRunner.key`): once per turn, not per plan and request.
    key: PrefixKey | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def keeps_history(self) -> bool:
        """Whether a later turn may read this turn's history from a hold: every turn's but the calibration's, of which
        only those whose history a later calibration turn pulls. The others' holds would pin their KV blocks, and count
        against the engine's hold budget, until their leases end, for nobody (half of a tiny test engine's cache for
        30 s after start-up)."""
        return not self.calibration or self.calibration_hold


@dataclass
class TurnOutcome:
    """What happened, for the response's `kvrelay` object, metrics and the caller's logs."""

    plan: Plan
    replica_id: str = ""
    reused_tokens: int = 0
    ttft_ms: float | None = None
    completion_tokens: int = 0
    pull_failed: bool = False
    # The reading engine's verdict on the pull's KV, where it checked one ("verified", "refused: ..."; vLLM's NIXL
    # connector as kvrelay extends it: kvtransfer/throttled_nixl.py).
    read_check: str | None = None
    # How often the turn moved to another replica because the one serving it died (`plan` is the last one's).
    migrations: int = 0
    counters: Counter = field(default_factory=Counter)
    # This process's clock (time.perf_counter) when the first engine request was made and when the last delta came:
    # what the ingress spends outside them is its own work (`Ingress.stats`, "ingress_own_ms").
    engine_called_at: float | None = None
    last_delta_at: float | None = None

    def public(self) -> dict[str, Any]:
        reason = self.plan.reason + ("; the pull failed, recomputed" if self.pull_failed else "")
        if self.migrations:
            reason += f"; continued on another replica after {self.migrations} replica failure(s)"
        elif self.replica_id and self.plan.replica_id and self.replica_id != self.plan.replica_id:
            # The replica router sends a turn elsewhere when its target has left Serve's set (it died or drains).
            reason += f"; planned for {self.plan.replica_id}, which Serve no longer routes to: ran here instead"
        return {
            "mode": self.plan.mode.value if not self.pull_failed else Mode.RECOMPUTE.value,
            "replica": self.replica_id or self.plan.replica_id,
            "holder": self.plan.holder,
            "reused_tokens": self.reused_tokens,
            "estimates_ms": self.plan.estimates_ms,
            "reason": reason,
            "ttft_ms": round(self.ttft_ms, 2) if self.ttft_ms is not None else None,
        }
