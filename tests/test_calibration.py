"""Start-up calibration's contention measurement, with a stand-in for the turn path (timing only, no engines: the
real turn path runs this calibration in every app the other tests start)."""

from __future__ import annotations

import asyncio
import random
import time

from kvtransfer.calibration import contention


def test_contention_is_measured_while_the_other_engine_decodes_then_while_it_prefills():
    spans: list[tuple[str, int, float, float]] = []

    async def run_turn(token_ids, sampling, force, tenant=""):
        started = time.monotonic()
        # The long background reply decodes for a while, a background prompt (1024 tokens) prefills for 0.1 s, the
        # measured prefills are short.
        await asyncio.sleep(0.3 if sampling["max_tokens"] > 1 else 0.1 if len(token_ids) == 1024 else 0.02)
        spans.append((force[1], sampling["max_tokens"], started, time.monotonic()))

    asyncio.run(contention(run_turn, "measured", "busy", random.Random(0), 1000, [64, 256], 1024))
    decoding = [s for s in spans if s[0] == "busy" and s[1] > 1]
    prefilling = [s for s in spans if s[0] == "busy" and s[1] == 1]
    measured = sorted(s for s in spans if s[0] == "measured")
    assert len(decoding) == 1 and len(measured) == 4 and len(prefilling) >= 2
    (_, _, decode_start, decode_end), = decoding
    beside_decode = [m for m in measured if decode_start < m[2] and m[3] < decode_end]
    assert len(beside_decode) == 2
    # The other two ran while "busy" was prefilling, every moment of them (two prompts at a time, so no gap).
    for _, _, start, end in (m for m in measured if m not in beside_decode):
        assert start > decode_end
        moments = [start + (end - start) * i / 10 for i in range(11)]
        assert all(any(s <= t <= e for _, _, s, e in prefilling) for t in moments)
