"""Prefill/decode disaggregated turns: the plan runs as a one-token prefill on the prefill pool, whose token the client
gets at once and whose KV a decode replica reads over NIXL before it decodes the rest; the decode replica's hold is
what the next turn pulls back."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from actors.replica_api import GenerateDelta
from app.directory_mirror import DirectoryMirror
from app.turn_types import Turn, TurnOutcome, continuation, whole_turn
from app.turns import PREFILL_POOL, TurnRunner
from kvtransfer.cost_model import CostModel
from kvtransfer.options import Mode
from kvtransfer.planner import Plan
from kvtransfer.types import Hold


class DisaggregatedTurnRunner(TurnRunner):
    """Plans turns onto the prefill pool (`engines`) and decodes them on `decode_engines`.

    The prefill replica computes the prompt (pulling the history when planned) and one token, which streams to the
    client at once, and leaves a hold of the prompt; a decode replica pulls it and streams the rest of the reply. If
    the prefill replica cannot hand its KV over, it runs the whole turn (the prefill pool's replicas are kv_both);
    if the decode replica cannot read it, it runs the rest.
    """

    def __init__(
        self,
        engines: Any,
        decode_engines: Any,
        directory: DirectoryMirror,
        cost: CostModel,
        model: str,
        block_size: int,
        hold_ttl_s: float,
        max_migrations: int = 2,
        modelled_engines: bool = False,
    ) -> None:
        super().__init__(engines, directory, cost, model, block_size, hold_ttl_s, max_migrations, modelled_engines)
        self.decode_engines = decode_engines

    def _targets(self) -> list[str] | None:
        # Turns start on the prefill pool; holders may be any replica (decode replicas hold the history).
        return [r.replica_id for r in self.replicas() if r.pool == PREFILL_POOL]

    def _output_tokens(self, turn: Turn) -> int:
        return 1  # the turn starts as a one-token prefill; the decode pool does the rest

    def _founds_home(self) -> bool:
        return False  # the decode pool holds the history; each later turn starts where the prefill pool has room

    def _leaves_holds(self, turn: Turn, stage: str) -> bool:
        # The prefill always hands its KV over. The decode leaves the history for the next turn only under a policy
        # that pulls it back: otherwise its hold would only pin the decode replica's blocks until its lease ends
        # (vLLM's P/D without pull-back keeps none), and only for a turn whose history a later turn may read.
        return stage == "prefill" or (turn.policy.pulls and turn.keeps_history)

    async def _execute(
        self, turn: Turn, plan: Plan, pull: Hold | None, outcome: TurnOutcome, started: float,
        force: tuple[Mode, str] | None,
    ) -> AsyncIterator[GenerateDelta]:
        """Prefill on P (pulling the history when planned) with one output token, shown to the client at once; then
        D pulls P's KV of the prompt, computes that token's and decodes the rest."""
        skip_cache = force is not None and force[0] is Mode.RECOMPUTE
        params = turn.params.clone()
        # One token; if the turn asks for at least one, P must not end it with an end of sequence either.
        params.max_tokens, params.min_tokens = 1, min(1, turn.params.min_tokens)
        prefill = replace(turn, params=params)
        # P's own hold is D's to read, so it is not recorded.
        request = self._request(prefill, plan, "prefill", pull, skip_cache=skip_cache)
        prefilled = [d async for d in self._attempt(prefill, plan, request, outcome, started, records_hold=False)]
        if outcome.pull_failed:
            request = self._request(prefill, plan, "prefill", skip_cache=skip_cache)
            prefilled = [d async for d in self._attempt(prefill, plan, request, outcome, started, records_hold=False)]
        handoff = prefilled[-1].hold if prefilled else None
        if handoff is None:
            # P could not hand its KV over: it is a kv_both replica, so let it run the whole turn.
            self.counters["handoff_failures"] += 1
            outcome.ttft_ms = None  # timed again on the turn that streams
            async for delta in self._run_on_prefill_pool(turn, plan, outcome, started, skip_cache):
                yield delta
            return
        # The plan estimated P's time to its token (where the history came from decides it): learn its error.
        self.feedback.observe_error(turn, plan, pull, outcome, force)
        first = [t for d in prefilled for t in d.token_ids]
        reused = prefilled[-1].num_cached_tokens
        # P's token is the turn's first: the client gets it now, not after the handoff. The turn ends there if P
        # stopped (end of sequence, a stop token) or the budget was one token.
        rest = continuation(turn, first) if prefilled[-1].finish_reason == "length" else None
        if rest is None:
            self.holds.record(turn, turn.token_ids + first, prefilled[-1])  # P's KV is the next turn's to pull
            for delta in prefilled:
                yield delta
            return
        for delta in prefilled:
            yield delta.model_copy(update={"finished": False, "finish_reason": None, "hold": None})
        # D reads the prompt's KV from P's hold like any pull (the hold covers all but P's token), computes the
        # token's and decodes the rest. Its prefill time is the transfer, not compute: it teaches the cost model
        # nothing.
        decode_plan = plan._replace(replica_id="", mode=Mode.PULL, holder=None)
        request = self._request(rest, decode_plan, "decode", handoff)
        async for delta in self._attempt(rest, decode_plan, request, outcome, started, self.decode_engines,
                                         prefills=False):
            yield self._counted(delta, turn, len(first), reused, outcome)
        if outcome.pull_failed:  # D could not read P's KV: P recomputes and serves the rest of the turn itself
            outcome.pull_failed = False
            async for delta in self._run_on_prefill_pool(rest, plan, outcome, started, skip_cache):
                yield self._counted(delta, turn, len(first), reused, outcome)

    @staticmethod
    def _counted(delta: GenerateDelta, turn: Turn, streamed: int, reused: int, outcome: TurnOutcome) -> GenerateDelta:
        """A delta of the turn's rest; the last counts the whole turn, whose reuse is P's (`reused` prompt tokens:
        what D reads from P is the handoff, not reuse)."""
        if not delta.finished:
            return delta
        outcome.reused_tokens = reused
        return whole_turn(delta, turn, streamed, reused)

    def _run_on_prefill_pool(
        self, turn: Turn, plan: Plan, outcome: TurnOutcome, started: float, skip_cache: bool
    ) -> AsyncIterator[GenerateDelta]:
        """The whole turn on the planned prefill replica, computing its prompt (the fallback)."""
        return self._attempt(turn, plan, self._request(turn, plan, "turn", skip_cache=skip_cache), outcome, started)
