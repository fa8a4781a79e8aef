"""Start-up calibration's contention measurement and its validation turns, with a stand-in for the turn path (timing
only, no engines: the real turn path runs this calibration in every app the other tests start)."""

from __future__ import annotations

import asyncio
import random
import time
from types import SimpleNamespace

from kvtransfer.calibration import VALIDATION_NEW_TOKENS, contention, validate
from kvtransfer.cost_model import CostModel


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


def test_validation_teaches_the_estimate_error_what_the_fits_leave_out():
    """Turns that take 20 ms more than the fits say: after the validation turns every estimate of an idle replica is
    corrected by 20 ms. Each turn's estimate is taken before it runs: this stand-in, like the turn path, teaches the
    cost model from the turn before returning (here a sample far off the fit)."""
    cost = CostModel(kv_bytes=lambda n: 1000 * n)
    missed_ms = 20.0
    turns = []

    async def run_turn(token_ids, sampling, force, tenant=""):
        mode, replica = force
        history = 0 if mode == "recompute" else len(token_ids) - VALIDATION_NEW_TOKENS
        before = cost.recompute_ms(len(token_ids) - history, history, 0, replica)
        for scale in (1, 2, 3):  # the fit refits once it has as many samples as coefficients
            cost.observe_prefill(scale * (len(token_ids) - history), history, scale * 10 * before + 500, 0, replica)
        assert cost.recompute_ms(len(token_ids) - history, history, 0, replica) != before  # it learned
        turns.append(mode)
        return SimpleNamespace(token_ids=[7], ttft_ms=before + missed_ms, usage=SimpleNamespace(cached_tokens=history))

    assert cost.error.offset_ms("local", 0) == cost.error.offset_ms("recompute", 0) == 0
    asyncio.run(validate(run_turn, "r0", cost, random.Random(0), 1000, [128, 256, 512, 1024]))
    assert turns == ["recompute", "local", "local"] * 4
    assert cost.error.offset_ms("local", 0) == missed_ms  # from its own 8 samples
    assert cost.error.offset_ms("recompute", 0) == missed_ms  # 4 of its own: the median over all 12
    assert cost.error.offset_ms("pull", 0) == missed_ms

