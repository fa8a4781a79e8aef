"""Seeding the cost model at start-up: a few recomputes and pulls measured on the live replicas.

Synthetic turns run under their own tenant, so they never match a real conversation. Calibration only sharpens
the cost model's priors; serving never waits for it or depends on it.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from kvtransfer.cost_model import CostModel

logger = logging.getLogger(__name__)

CALIBRATION_TENANT = "kvrelay-calibration"
# One greedy token: a turn that measures its prefill (and its pull), not decoding.
ONE_TOKEN = {"max_tokens": 1, "temperature": 0.0, "ignore_eos": True}
# Prefills timed beside a busy engine (`contention`): long enough that the slowdown, not fixed costs, shows.
CONTENTION_LENGTHS = (256, 512, 1024)
# How long after the busy engine's turn is sent the measured prefills start (its 64-token prefill is done by then).
CONTENTION_START_S = 0.5


class TurnResultLike(Protocol):
    token_ids: list[int]


# Runs one turn: (token ids, sampling, (mode, replica) to force, tenant) -> its result (the ingress's `turn`).
RunTurn = Callable[..., Awaitable[TurnResultLike]]


async def calibrate(
    run_turn: RunTurn,
    prefill_replicas: Callable[[], list[str]],
    wanted: int,
    cost: CostModel,
    vocab: int,
    max_model_len: int,
) -> None:
    """Wait for `wanted` replicas of the prefill pool, then time recomputes and pulls of a few lengths on them.

    `run_turn(token_ids, sampling, force, tenant=...)` runs one forced turn through the turn path, which feeds
    its timings to `cost`; `prefill_replicas()` lists the live replicas turns may start on.
    """
    try:
        # Wait for the whole prefill pool: pulls can only be measured between two replicas.
        ids: list[str] = []
        for _ in range(1200):
            ids = prefill_replicas()
            if len(ids) >= wanted:
                break
            await asyncio.sleep(0.5)
        if not ids:
            return
        rng = random.Random(0)
        lengths = [n for n in (64, 256, 1024, 2048) if n + 64 < max_model_len]

        async def turn(token_ids: list[int], force: tuple[str, str]) -> Any:
            return await run_turn(token_ids, ONE_TOKEN, force, tenant=CALIBRATION_TENANT)

        async def pull_after_recompute(n: int, holder: str, puller: str) -> None:
            history = [rng.randrange(100, vocab) for _ in range(n)]
            first = await turn(history, ("recompute", holder))
            follow_up = history + first.token_ids + [rng.randrange(100, vocab) for _ in range(32)]
            await turn(follow_up, ("pull", puller))

        if len(ids) > 1:
            # The first pull between two engines includes NIXL's handshake (hundreds of ms, once per
            # pair and direction): make those now and keep them out of the fit.
            await pull_after_recompute(64, ids[0], ids[1])
            await pull_after_recompute(64, ids[1], ids[0])
            cost.learn_handshake()
        for n in lengths:
            if len(ids) > 1:
                await pull_after_recompute(n, ids[0], ids[1])
            else:
                await turn([rng.randrange(100, vocab) for _ in range(n)], ("recompute", ids[0]))
        if len(ids) > 1 and max_model_len >= 512:
            await contention(run_turn, ids[0], ids[1], rng, vocab,
                             [n for n in CONTENTION_LENGTHS if n + 64 < max_model_len])
        logger.info("cost model calibrated on %s: %s", ids, cost.snapshot())
    except Exception:  # calibration only sharpens the priors; serving must not depend on it
        logger.exception("cost model calibration failed; keeping the priors")


async def contention(run_turn: RunTurn, measured: str, busy: str, rng: random.Random, vocab: int,
                     lengths: list[int]) -> None:
    """Time prefills on `measured` while `busy` decodes a long turn: if the two engines share a node, the turn
    path sees a busy peer and those prefills teach the cost model its slowdown per busy peer (else they are solo
    samples). Each length twice, once `busy` is decoding; 256 decode steps keep it working longer than the
    measured prefills take.

    They are most of what the slowdown fit ever learns: a turn of real traffic teaches it only if it had its own
    engine to itself while another was busy, a few per benchmark run. Three prefills timed 50 ms after the
    background turn was sent (one of 64 tokens, mostly fixed cost) measured 0.12-0.14 on this machine, where
    prefills timed while the other engine decodes take 1.13-1.30x as long end to end and teach the fit 0.33
    (`benchmarks.contention`, contention.json), and two engines serving at once each run 1.29x slower
    (scaling.json). Timed this way: 0.08-0.26 in five apps."""
    background = asyncio.ensure_future(run_turn(
        [rng.randrange(100, vocab) for _ in range(64)], {"max_tokens": 256, "temperature": 0.0, "ignore_eos": True},
        ("recompute", busy), tenant=CALIBRATION_TENANT))
    try:
        # The background turn is in flight (the runner counts it) and past its short prefill, decoding.
        await asyncio.sleep(CONTENTION_START_S)
        for n in lengths * 2:
            await run_turn([rng.randrange(100, vocab) for _ in range(n)], ONE_TOKEN, ("recompute", measured),
                           tenant=CALIBRATION_TENANT)
    finally:
        await background
