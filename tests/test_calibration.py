"""Start-up calibration's contention measurement, with a stand-in for the turn path (timing only, no engines: the
real turn path runs this calibration in every app the other tests start)."""

from __future__ import annotations

import asyncio
import random
import time
from types import SimpleNamespace

from kvtransfer.calibration import CONTENTION_STREAMS, ON_BUSY_LENGTHS, calibrate, contention
from kvtransfer.cost_model import CostModel


def test_contention_is_measured_while_the_other_engine_is_working():
    spans: list[tuple[str, float, float]] = []

    async def run_turn(token_ids, sampling, force, tenant="", hold=False):
        started = time.monotonic()
        # The long background turns decode for a while; the measured prefills are short.
        await asyncio.sleep(1.0 if sampling["max_tokens"] > 1 else 0.02)
        spans.append((force[1], started, time.monotonic()))

    asyncio.run(contention(run_turn, "measured", "busy", random.Random(0), 1000, [64, 256]))
    background = [s for s in spans if s[0] == "busy" and s[2] - s[1] >= 1.0]
    on_busy = [s for s in spans if s[0] == "busy" and s[2] - s[1] < 1.0]
    measured = [s for s in spans if s[0] == "measured"]
    # A few conversations decode on the busy engine, as under a multi-turn load; each length is timed twice alone
    # (the replica's own speed at those lengths), then twice beside them, then short prefills on the busy engine.
    assert len(background) == CONTENTION_STREAMS > 1 and len(measured) == 8
    assert len(on_busy) == len(ON_BUSY_LENGTHS) >= 8  # the estimate error's MIN_SAMPLES for turns on a busy engine
    bg_start = min(start for _, start, _ in background)
    decoding_from = max(start for _, start, _ in background) + 0.4
    bg_end = min(end for _, _, end in background)
    alone, beside = measured[:4], measured[4:]
    assert all(end <= bg_start for _, _, end in alone)
    # All while every background turn runs, and after their prefills (they are decoding).
    assert all(decoding_from < start and end < bg_end for _, start, end in beside + on_busy)


def test_the_calibration_times_a_turn_decoding_alone():
    """The solo decode step (what a turn's stay on an engine costs the engines beside it) is learned only from turns
    that ran alone: the calibration runs one, so an app that is never idle later still has it measured."""
    spans: list[tuple[dict, tuple[str, str], float, float]] = []

    async def run_turn(token_ids, sampling, force, tenant="", hold=False):
        started = time.monotonic()
        await asyncio.sleep(0.2 if sampling["max_tokens"] > 1 else 0.005)
        spans.append((sampling, force, started, time.monotonic()))
        return SimpleNamespace(token_ids=[7] * sampling["max_tokens"])

    cost = CostModel(lambda n: 1024 * n)
    asyncio.run(calibrate(run_turn, lambda: ["a", "b"], 2, cost, 1000, 2048))
    decoding = [s for s in spans if s[0]["max_tokens"] > 1]
    alone = [s for s in decoding if all(o is s or o[3] <= s[2] or o[2] >= s[3] for o in spans)]
    assert len(alone) == 1, "no turn decoded alone"
    sampling, force, _, _ = alone[0]
    assert sampling["ignore_eos"] and sampling["max_tokens"] >= 8 and force[0] == "recompute"


def test_only_turns_whose_history_the_calibration_pulls_leave_a_hold():
    """A hold pins its KV blocks, and counts against its engine's hold budget, until it is read or its lease ends:
    the calibration asks for one only where a later turn of its own pulls that history, so the app starts serving
    with its engines' caches and hold budgets free (`Turn.keeps_history`)."""
    turns: list[tuple[list[int], tuple[str, str], bool]] = []

    async def run_turn(token_ids, sampling, force, tenant="", hold=False):
        turns.append((list(token_ids), force, hold))
        return SimpleNamespace(token_ids=[7] * sampling["max_tokens"])

    asyncio.run(calibrate(run_turn, lambda: ["a", "b"], 2, CostModel(lambda n: 1024 * n), 1000, 4096))
    held = [i for i, (_, _, hold) in enumerate(turns) if hold]
    pulled = [i for i, (_, force, _) in enumerate(turns) if force[0] == "pull"]
    assert held and len(held) == len(pulled) < len(turns) // 2
    for i in held:
        # Each held history is the one the next turn pulls to the other replica.
        history, (mode, holder), _ = turns[i]
        follow_up, (next_mode, puller), _ = turns[i + 1]
        assert mode == "recompute" and next_mode == "pull" and puller != holder
        assert follow_up[: len(history)] == history
