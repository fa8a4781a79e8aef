"""The planner's estimates and choices against measured times to first token, on the suite's real engines.

Each case is a conversation turn of `history` held tokens and `new_tokens` new ones, whose history's KV the holder
replica keeps (its hold, from the turn before), with one replica busy decoding or none. The turn is run forced
each way on a fresh copy of that situation: on the holder from its own KV (`local`), on the other replica pulling
the history over NIXL (`pull`) and computing all of it (`recompute`). The planner is asked, in the same situation
before the turn runs, where it would run the turn (any replica) and how it would run it off the holder (a holder
that drains, a prefill pool elsewhere: pull or recompute, the crossover its fits exist for), with its estimate of
each option's time to first token.

Two bounds, each where it measures what the planner claims:
- Every option's estimate is within ESTIMATE_TOLERANCE, plus ESTIMATE_TOLERANCE_MS (short turns' fixed costs), of
  one of its measured repetitions, in every case: at most that far below the fastest or above the slowest, so the
  bound widens by the repetitions' own spread where the machine's other work spreads them (a machine running the
  suite twice as slowly as usual measured a 192-token turn on a busy replica at 85.6 ms, median of five, and the
  estimate of 174.7 missed a bound around the median alone).
- Where neither replica is busy, the option the planner picks measures within 15% of the fastest option measured,
  or within 5 ms of it, or no slower than the fastest option's own slowest repetition. There its cost is the turn's
  own estimated first token. Beside a busy engine it is not: the planner also prices the delay a turn imposes on
  the first tokens of others (an idle engine that starts work slows the busy one beside it on shared cores), which a
  turn's own time to first token does not measure. With the holder idle and the other replica decoding, it pulled a
  1,536-token history onto the busy replica, 93 ms against 62 ms on the holder, to leave the holder's core to the
  busy engine's streams; so those cases are judged by the estimates alone.
The 5 ms is the planner's own tie (`STAY_MARGIN_MS`): on tiny-llama a short turn's first token comes in 20-30 ms,
where 15% is less than the spread between repetitions of the same forced turn on this 2-core machine.

The module runs first in the suite (`tests/conftest.py`), on the session's app, so that its cost model has learned
from its start-up calibration and these turns alone. Run after the rest of the suite's turns (replicas killed and
restarted, forced turns on loaded engines), the estimate errors that app had learned put a local turn beside a busy
engine at 15 ms, where it measured 62.
"""

from __future__ import annotations

import random
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import pytest

from kvtransfer.cost_model import CostModel
from kvtransfer.fits import OnlineLinearFit
from kvtransfer.kv_shape import KVShape
from kvtransfer.load import ReplicaView, with_busy_peers
from kvtransfer.options import STAY_MARGIN_MS
from kvtransfer.planner import plan_turn
from kvtransfer.types import HoldOffer, LookupResult, ReplicaMatch
from tests.conftest import TINY_ENGINE, ServedApp, make_hold

TOLERANCE = 0.15
TOLERANCE_MS = STAY_MARGIN_MS
# Beside a busy engine on two shared cores the same forced turn measures up to a third apart between runs (a
# 256-token history pulled from a busy holder: 149 ms in one run, 201 in the next); at 40% and 15 ms the estimates
# used up to 0.77 of the bound in six runs of this module. The fixed part is the short turns' fixed costs, which
# move with the machine's other work: a 97-token prefill estimated at 14 ms measured 41.
ESTIMATE_TOLERANCE = 0.5
ESTIMATE_TOLERANCE_MS = 25.0
ONE_TOKEN = {"max_tokens": 1, "temperature": 0.0, "ignore_eos": True}
# Holds pin KV blocks for their lease, and a replica whose holds pin half of its cache exports no more
# (`nixl.max_held_fraction`): the hold each measured turn leaves is released at once by a next turn that recomputes
# under a policy that never pulls, which therefore leaves none (a forced turn runs as forced whatever the policy, and
# teaches the planner's estimate error nothing). The load runs under that policy too.
LEAVES_NO_HOLD = "round_robin"
# The load: conversations decoding on one replica for the whole case (as the start-up calibration's contention).
LOAD_STREAMS = 4
LOAD_PROMPT = 32
LOAD_TOKENS = 2016  # as long as the engines allow (max_model_len 2048): a slower machine kind runs the cases longer
BLOCK_SIZE = 32  # the suite's engines' (configs.engine's default)


class Case(NamedTuple):
    history: int
    new_tokens: int
    busy: str | None = None  # which replica decodes meanwhile: "holder", "other" or none
    reps: int = 3

    def __str__(self) -> str:
        return f"history {self.history}, new {self.new_tokens}, {self.busy or 'no'} replica busy"


CASES = (
    Case(64, 32, reps=5),  # short: every option is a few ms apart
    Case(1536, 32),  # long: recomputing it is clearly slower than reusing it
    Case(384, 512),  # the new tokens dominate: reuse saves little
    Case(1536, 32, busy="holder"),
    Case(1536, 32, busy="other"),
    Case(256, 256, busy="holder"),
    Case(64, 128, busy="other", reps=5),
)
# Off the holder, only these two remain.
OFF_HOLDER = ("pull", "recompute")


@dataclass
class Measured:
    case: Case
    holder: str
    other: str
    # Median time to first token of each option: "local" on the holder, "pull" and "recompute" on the other replica.
    ttft_ms: dict[str, float]
    samples_ms: dict[str, list[float]]
    # The app's unforced picks, once per repetition: on any replica, and off the holder.
    picks: list[str] = field(default_factory=list)
    picks_off_holder: list[str] = field(default_factory=list)
    # The planner's estimate of each option's time to first token, once per repetition: "local" as planned anywhere,
    # "pull" and "recompute" as planned off the holder (the measured options exactly).
    estimates: dict[str, list[float]] = field(default_factory=lambda: {"local": [], "pull": [], "recompute": []})
    # The cost model's fit and the busy replica's decode rate when the case ran, for planning it again here.
    cost_model: dict[str, Any] = field(default_factory=dict)
    decode_tok_s: float | None = None

    @property
    def estimates_ms(self) -> dict[str, float]:
        """The median estimate of each option over the repetitions."""
        return {m: statistics.median(v) for m, v in self.estimates.items() if v}

    def row(self) -> str:
        ttft = ", ".join(f"{m} {ms:.1f} ({min(self.samples_ms[m]):.0f}-{max(self.samples_ms[m]):.0f})"
                         for m, ms in self.ttft_ms.items())
        estimates = ", ".join(f"{m} {ms:.1f}" for m, ms in self.estimates_ms.items())
        return (f"{self.case}: measured {ttft} ms; estimated {estimates} ms; picked {self.picks}, off the holder "
                f"{self.picks_off_holder}")


def within_bound(m: Measured, pick: str, among: tuple[str, ...], spread: bool = True) -> bool:
    """Whether `pick` measured within the bound of the fastest of `among` (`spread`: or within its repetitions)."""
    if pick not in among:
        return False
    fastest = min(among, key=lambda option: m.ttft_ms[option])
    best = m.ttft_ms[fastest]
    slowest_repetition = max(m.samples_ms[fastest]) if spread else best
    return m.ttft_ms[pick] <= max(best * (1 + TOLERANCE), best + TOLERANCE_MS, slowest_repetition)


def estimate_bound_ms(measured_ms: float) -> float:
    return ESTIMATE_TOLERANCE * measured_ms + ESTIMATE_TOLERANCE_MS


def estimate_misses(m: Measured, estimates_ms: dict[str, float]) -> list[str]:
    """The options of case `m` whose estimate lies further than the estimate bound from every repetition of the option:
    below its fastest repetition's bound or above its slowest's. Where the machine's other work spreads the same forced
    turn's repetitions, the bound widens by that spread, and no further."""
    misses = []
    for option, ms in estimates_ms.items():
        fastest, slowest = min(m.samples_ms[option]), max(m.samples_ms[option])
        if ms < fastest - estimate_bound_ms(fastest) or ms > slowest + estimate_bound_ms(slowest):
            misses.append(f"{m.case}: {option} estimated {ms:.1f} ms, measured {fastest:.1f} to {slowest:.1f}")
    return misses


def usual(picks: list[str]) -> list[str]:
    """The case's picks made most often over its repetitions (all of them if tied). A single other pick is the planner
    reading the situation mid-change: at a case's first repetition, the replicas' heartbeats (every half second) can
    still show the case before's load, and once a 1,536-token turn beside a replica that had just started decoding
    was planned as a pull onto it, then twice as a local turn."""
    counts = Counter(picks)
    most = max(counts.values())
    return [pick for pick, n in counts.items() if n == most]


def option_name(mode: str, replica: str, holder: str, other: str) -> str:
    """The measured option a plan names, or a description of one that was not measured."""
    measured = {("local", holder): "local", ("pull", other): "pull", ("recompute", other): "recompute"}
    return measured.get((mode, replica), f"{mode} on {'the holder' if replica == holder else replica}")


def fresh_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 1000) for _ in range(n)]


def held_turn(app: ServedApp, holder: str, case: Case, rng: random.Random) -> list[int]:
    """A new conversation's next turn, its history's KV held on `holder` by the turn before."""
    history = fresh_tokens(rng, case.history)
    first = app.ingress.turn.remote(history, ONE_TOKEN, ("recompute", holder)).result(timeout_s=120)
    return history + first.token_ids + fresh_tokens(rng, case.new_tokens)


def forced_ttft_ms(app: ServedApp, follow_up: list[int], mode: str, target: str, rng: random.Random) -> float:
    """The turn's time to first token run as (mode, target); then the hold it left is released."""
    result = app.ingress.turn.remote(follow_up, ONE_TOKEN, (mode, target)).result(timeout_s=120)
    assert (result.kvrelay.mode, result.kvrelay.replica) == (mode, target), result.kvrelay
    app.ingress.turn.remote(follow_up + result.token_ids + fresh_tokens(rng, 1), ONE_TOKEN, ("recompute", target),
                            policy=LEAVES_NO_HOLD).result(timeout_s=120)
    return result.ttft_ms


def wait_for_unpinned_caches(app: ServedApp, timeout_s: float) -> None:
    """Until no replica's KV cache is more than a tenth in use (what holds left by earlier turns pin): every replica can
    hold a case's history."""
    deadline = time.monotonic() + timeout_s
    while True:
        usage = {r["replica_id"]: r["kv_cache_usage"] for r in app.ingress.stats.remote().result()["replicas"]}
        if max(usage.values()) <= 0.1:
            return
        assert time.monotonic() < deadline, f"KV cache in use after {timeout_s:.0f} s: {usage}"
        time.sleep(0.5)


def replica_stats(app: ServedApp, replica: str) -> dict[str, Any]:
    return next(r for r in app.ingress.stats.remote().result()["replicas"] if r["replica_id"] == replica)


def still_running(response: Any) -> bool:
    try:
        response.result(timeout_s=0.01)
    except TimeoutError:
        return True
    return False


@contextmanager
def decoding(app: ServedApp, replica: str | None, rng: random.Random, timeout_s: float = 60) -> Iterator[None]:
    """`replica` decoding LOAD_STREAMS conversations throughout (none: both idle); fails if any ends early."""
    if replica is None:
        yield
        return
    sampling = dict(ONE_TOKEN, max_tokens=LOAD_TOKENS)
    streams = [app.ingress.turn.remote(fresh_tokens(rng, LOAD_PROMPT), sampling, ("recompute", replica),
                                       policy=LEAVES_NO_HOLD) for _ in range(LOAD_STREAMS)]
    try:
        deadline = time.monotonic() + timeout_s
        # Its heartbeat says so (every half second): the streams are past their prefills and decoding.
        while replica_stats(app, replica)["running"] < LOAD_STREAMS:
            assert time.monotonic() < deadline, f"{replica} never ran {LOAD_STREAMS} streams at once"
            time.sleep(0.1)
        yield
        assert all(still_running(s) for s in streams), "the load ended before the case did: raise LOAD_TOKENS"
    finally:
        for s in streams:
            s.cancel()
        deadline = time.monotonic() + timeout_s
        while replica_stats(app, replica)["running"] > 0:
            assert time.monotonic() < deadline, f"{replica} still decoding the cancelled load"
            time.sleep(0.1)


def measure(app: ServedApp, case: Case, holder: str, other: str, rng: random.Random) -> Measured:
    """Each option's median time to first token over the case's repetitions, and the planner's picks meanwhile. The
    options rotate their order each repetition, so drift over the case does not land on one of them."""
    samples: dict[str, list[float]] = {"local": [], "pull": [], "recompute": []}
    order = [("local", holder), ("pull", other), ("recompute", other)]
    out = Measured(case, holder, other, {}, samples)
    with decoding(app, {"holder": holder, "other": other, None: None}[case.busy], rng):
        if case.busy is not None:
            out.decode_tok_s = replica_stats(app, holder if case.busy == "holder" else other)["decode_tok_s"]
        out.cost_model = app.ingress.stats.remote().result()["cost_model"]
        for rep in range(case.reps):
            for mode, target in order[rep % 3:] + order[:rep % 3]:
                follow_up = held_turn(app, holder, case, rng)
                if mode == "local":  # ask the planner before the turn consumes the hold
                    anywhere = app.ingress.plan.remote(follow_up).result(timeout_s=60)
                    off_holder = app.ingress.plan.remote(follow_up, [other]).result(timeout_s=60)
                    out.picks.append(option_name(anywhere["mode"], anywhere["replica"], holder, other))
                    out.picks_off_holder.append(option_name(off_holder["mode"], off_holder["replica"], holder, other))
                    out.estimates["local"].append(anywhere["estimates_ms"]["local"])
                    for option in OFF_HOLDER:
                        out.estimates[option].append(off_holder["estimates_ms"][option])
                samples[mode].append(forced_ttft_ms(app, follow_up, mode, target, rng))
    out.ttft_ms = {m: statistics.median(v) for m, v in samples.items()}
    return out


def test_the_start_up_calibration_leaves_no_kv_cache_pinned(tiny_app):
    """The calibration's turns leave a hold only where a later calibration turn pulls it, which ends it: once the app
    is calibrated, its engines' caches are free for the first conversations (heartbeats are half a second apart).
    Before, its other turns' holds pinned half of one tiny-llama replica's cache, its whole hold budget, for their
    30 s lease: a first conversation's turn there left no hold to read or pull."""
    wait_for_unpinned_caches(tiny_app, 5.0)


@pytest.fixture(scope="module")
def measured(tiny_app: ServedApp) -> list[Measured]:
    replicas = tiny_app.replica_ids(2)
    wait_for_unpinned_caches(tiny_app, 2 * TINY_ENGINE["nixl"]["hold_ttl_s"])
    rng = random.Random("planner vs measured")
    results = []
    for i, case in enumerate(CASES):
        holder, other = replicas[i % 2], replicas[(i + 1) % 2]  # neither replica's core lands on one role
        results.append(measure(tiny_app, case, holder, other, rng))
        fit = results[-1].cost_model
        print(results[-1].row(), "\n  cost model:",
              {k: fit[k] for k in ("contention", "replica_speed", "estimate_error")})
    return results


def test_the_planners_estimates_and_unloaded_picks_are_within_their_bounds_of_the_measured_times(measured):
    table = "\n".join(m.row() for m in measured)
    assert len({(m.case.history, m.case.new_tokens, m.case.busy) for m in measured}) >= 6
    # The matrix is one where the choice matters: recomputing a long history is clearly slower than reusing it.
    long_idle = next(m for m in measured if m.case.history >= 1024 and m.case.busy is None)
    assert long_idle.ttft_ms["recompute"] > 1.5 * min(long_idle.ttft_ms["local"], long_idle.ttft_ms["pull"]), table
    misses = [miss for m in measured for miss in estimate_misses(m, m.estimates_ms)]
    unloaded = [m for m in measured if m.case.busy is None]
    misses += [f"{m.case}: picked {pick}" for m in unloaded for pick in usual(m.picks)
               if not within_bound(m, pick, ("local", "pull", "recompute"))]
    misses += [f"{m.case}: picked {pick} off the holder" for m in unloaded for pick in usual(m.picks_off_holder)
               if not within_bound(m, pick, OFF_HOLDER)]
    assert not misses, "\n".join(misses) + "\n" + table


# ------------------------------------------------------------------ the same cases planned here, with other fits


def tiny_llama_kv_bytes() -> Any:
    from model_prep.store import model_path

    return KVShape.from_model_dir(model_path("tiny-llama"), TINY_ENGINE["dtype"], BLOCK_SIZE).kv_bytes


def restore(model: OnlineLinearFit, fit: dict[str, Any]) -> None:
    """`model` as the app's snapshot shows it: its coefficients, and its number of samples (stand-ins: the snapshot
    has no sample values, and the cost model reads the count only, to know whether a fit has been measured)."""
    model.coef = np.array([fit[n] for n in model.names])
    model.samples.extend([(np.zeros(len(model.names)), 0.0)] * fit["samples"])


def cost_model(fit: dict[str, Any], kv_bytes: Any) -> CostModel:
    """A cost model with the app's fitted prefill, pull (from idle and from busy holders), contention and decode step
    (`CostModel.snapshot`); not its estimate-error offsets or replica speeds, which correct the fits rather than being
    them."""
    cost = CostModel(kv_bytes)
    for name in ("prefill", "pull", "busy_holder_pull", "contention"):
        restore(getattr(cost, name), fit[name])
    cost.decode_step_ms = fit["decode_step_ms"]
    cost.handshake_ms = fit["handshake_ms"]
    cost.take_hold_ms = fit["take_hold_ms"]
    return cost


def constant_fit(fitted: CostModel, tokens: int) -> CostModel:
    """`fitted` with its prefill and pull fits replaced by constants: their estimates for `tokens` tokens (a pull from
    a busy holder at its own fit's estimate, as the slowdown beside busy engines is kept)."""
    features = (1.0, float(fitted.kv_bytes(tokens)))
    cost = CostModel(fitted.kv_bytes)
    cost.prefill.coef = np.array([fitted.recompute_ms(tokens), 0.0, 0.0])
    for name in ("prefill", "pull", "busy_holder_pull"):
        getattr(cost, name).samples.extend(getattr(fitted, name).samples)
    cost.pull.coef = np.array([max(0.0, fitted.pull.predict(features)), 0.0])
    cost.busy_holder_pull.coef = np.array([max(0.0, fitted.busy_holder_pull.predict(features)), 0.0])
    cost.contention.coef = fitted.contention.coef.copy()
    cost.decode_step_ms, cost.handshake_ms = fitted.decode_step_ms, fitted.handshake_ms
    cost.take_hold_ms = fitted.take_hold_ms
    return cost


def planned_here(m: Measured, cost: CostModel) -> tuple[str, str, dict[str, float]]:
    """The case's picks (any replica, off the holder) and its options' estimates by the pure planner, from the
    situation the app saw: the holder's hold of the history, and the busy replica's decoding streams."""
    num_tokens = m.case.history + 1 + m.case.new_tokens
    cached = m.case.history // BLOCK_SIZE * BLOCK_SIZE
    hold = HoldOffer(m.holder, m.case.history, 1e12, make_hold(m.case.history, f"e-{m.holder}"))
    lookup = LookupResult(num_tokens, (ReplicaMatch(m.holder, m.case.history, "hold", cached, hold),))
    busy = {"holder": m.holder, "other": m.other}.get(m.case.busy or "")
    views = with_busy_peers(
        [ReplicaView(r, running=LOAD_STREAMS if r == busy else 0, decode_tok_s=m.decode_tok_s if r == busy else None)
         for r in (m.holder, m.other)],
        {m.holder: "node", m.other: "node"})
    anywhere = plan_turn(num_tokens, lookup, views, cost)
    off_holder = plan_turn(num_tokens, lookup, views, cost, targets=[m.other])
    estimates = {"local": anywhere.estimates_ms["local"]} | {o: off_holder.estimates_ms[o] for o in OFF_HOLDER}
    return (option_name(anywhere.mode.value, anywhere.replica_id, m.holder, m.other),
            option_name(off_holder.mode.value, off_holder.replica_id, m.holder, m.other), estimates)


def misses(m: Measured, cost: CostModel) -> list[str]:
    """Where the pure planner's estimates for case `m`, or (no replica busy) its picks, miss their bounds; picks
    without the repetitions' spread (a constant fit's picks could hide in it)."""
    anywhere, off_holder, estimates = planned_here(m, cost)
    out = estimate_misses(m, estimates)
    if m.case.busy is None and not within_bound(m, anywhere, ("local", "pull", "recompute"), spread=False):
        out.append(f"{m.case}: {anywhere}")
    if m.case.busy is None and not within_bound(m, off_holder, OFF_HOLDER, spread=False):
        out.append(f"{m.case}: {off_holder} off the holder")
    return out


def test_the_bounds_fail_a_planner_whose_fits_are_constant(measured):
    """Planned again here by the pure planner from the same situations, the fits replaced by a constant (whichever:
    their estimates for 64, 512 or 2,048 tokens) miss the bounds where the app's fits meet them, so the bounds tell a
    cost model that knows what a turn costs from one that does not."""
    kv_bytes = tiny_llama_kv_bytes()
    table = "\n".join(m.row() for m in measured)
    fitted = [(m, cost_model(m.cost_model, kv_bytes)) for m in measured]
    met = [(m, cost) for m, cost in fitted if not misses(m, cost)]
    assert met, f"the app's fits, planned here, missed the bounds in every case:\n{table}"
    for tokens in (64, 512, 2048):
        caught = [miss for m, cost in met for miss in misses(m, constant_fit(cost, tokens))]
        assert caught, f"a constant fit (at {tokens} tokens) met the bounds wherever the app's fits did:\n{table}"
