"""Start-up calibration's contention measurement, with a stand-in for the turn path (timing only, no engines: the
real turn path runs this calibration in every app the other tests start)."""

from __future__ import annotations

import asyncio
import random
import time
from types import SimpleNamespace

from kvtransfer.calibration import CONTENTION_STREAMS, contention


def test_contention_and_pulls_from_a_busy_holder_are_measured_while_the_other_engine_is_working():
    spans: list[tuple[str, str, int, float, float]] = []  # (mode, replica, max_tokens, start, end)

    async def run_turn(token_ids, sampling, force, tenant=""):
        started = time.monotonic()
        # The long background turns decode for a while; the measured prefills and pulls are short.
        await asyncio.sleep(1.0 if sampling["max_tokens"] > 1 else 0.02)
        spans.append((force[0], force[1], sampling["max_tokens"], started, time.monotonic()))
        return SimpleNamespace(token_ids=[7])

    asyncio.run(contention(run_turn, "measured", "busy", random.Random(0), 1000, [64, 256]))
    background = [s for s in spans if s[2] > 1]
    held = [s for s in spans if s[:2] == ("recompute", "busy") and s[2] == 1]
    pulls = [s for s in spans if s[:2] == ("pull", "measured")]
    measured = [s for s in spans if s[:2] == ("recompute", "measured")]
    # A few conversations decode on the busy engine, as under a multi-turn load; each length is timed twice alone
    # (the replica's own speed at those lengths), then twice beside them.
    assert len(background) == CONTENTION_STREAMS > 1 and len(measured) == 8
    bg_start = min(start for *_, start, _ in background)
    decoding_from = max(start for *_, start, _ in background) + 0.4
    bg_end = min(end for *_, end in background)
    alone, beside = measured[:4], measured[4:]
    assert all(end <= bg_start for *_, end in alone)
    # The busy engine computed one history per length before its load began, and the measured one pulls each of them
    # while it decodes: pulls from a busy holder.
    assert len(held) == len(pulls) == 2 and all(end <= bg_start for *_, end in held)
    # All while every background turn runs, and after their prefills (they are decoding).
    assert all(decoding_from < start and end < bg_end for *_, start, end in beside + pulls)
