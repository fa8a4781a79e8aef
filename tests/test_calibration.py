"""Start-up calibration's contention measurement, with a stand-in for the turn path (timing only, no engines: the
real turn path runs this calibration in every app the other tests start)."""

from __future__ import annotations

import asyncio
import random
import time

from kvtransfer.calibration import contention


def test_contention_is_measured_while_the_other_engine_is_working():
    spans: list[tuple[str, float, float]] = []

    async def run_turn(token_ids, sampling, force, tenant=""):
        started = time.monotonic()
        # The long background turn decodes for a while; the measured prefills are short.
        await asyncio.sleep(1.0 if sampling["max_tokens"] > 1 else 0.02)
        spans.append((force[1], started, time.monotonic()))

    asyncio.run(contention(run_turn, "measured", "busy", random.Random(0), 1000, [64, 256]))
    background = [s for s in spans if s[0] == "busy"]
    measured = [s for s in spans if s[0] == "measured"]
    assert len(background) == 1 and len(measured) == 4  # each length twice
    (_, bg_start, bg_end), = background
    # All while the background turn runs, and after its prefill (it is decoding).
    assert all(bg_start + 0.4 < start and end < bg_end for _, start, end in measured)
