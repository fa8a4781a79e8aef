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

    async def run_turn(token_ids, sampling, force, tenant=""):
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

    async def run_turn(token_ids, sampling, force, tenant=""):
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
