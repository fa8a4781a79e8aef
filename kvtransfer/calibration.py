"""Seeding the cost model at start-up: a few recomputes and pulls measured on the live replicas.

Synthetic turns run under their own tenant, so they never match a real conversation, and are marked as calibration
(`Turn.calibration`): they teach the estimate error though forced, and not how long turns decode. Only the turns whose
history a later calibration turn pulls leave a hold (`hold=True`): any other's would pin its KV blocks, and count
against its engine's hold budget, until the lease ends, for nobody. Calibration only sharpens the cost model's priors;
serving never waits for it or depends on it.
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
# A turn that decodes alone (`decode_alone`): long enough that its mean step is the engine's decode step.
DECODE_ALONE = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
# Prefills timed beside a busy engine (`contention`): long enough that the slowdown, not fixed costs, shows.
CONTENTION_LENGTHS = (256, 512, 1024)
# How long after the busy engine's turns are sent the measured prefills start (their 64-token prefills are done).
CONTENTION_START_S = 0.5
# Conversations the busy engine decodes meanwhile (`contention`).
CONTENTION_STREAMS = 4
# Prefills timed on the busy engine itself meanwhile, so that turns on a busy engine have measured estimate errors
# from the start (`EstimateError`: MIN_SAMPLES of them): short ones, as most later turns are.
ON_BUSY_LENGTHS = (64, 128, 256) * 3


class TurnResultLike(Protocol):
    token_ids: list[int]


# Runs one turn: (token ids, sampling, (mode, replica) to force, tenant=..., hold=...) -> its result; `hold`: whether
# the turn leaves its history held for a later turn to pull (`Ingress._calibration_turn`).
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

    `run_turn(token_ids, sampling, force, tenant=..., hold=...)` runs one forced turn through the turn path, which
    feeds its timings to `cost`; `prefill_replicas()` lists the live replicas turns may start on.
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

        async def turn(token_ids: list[int], force: tuple[str, str], hold: bool = False) -> Any:
            return await run_turn(token_ids, ONE_TOKEN, force, tenant=CALIBRATION_TENANT, hold=hold)

        async def pull_after_recompute(n: int, holder: str, puller: str, local: bool = True) -> None:
            history = [rng.randrange(100, vocab) for _ in range(n)]
            first = await turn(history, ("recompute", holder), hold=True)
            follow_up = history + first.token_ids + [rng.randrange(100, vocab) for _ in range(32)]
            await turn(follow_up, ("pull", puller))
            if local:
                # The same follow-up where its history is cached, as most later turns run: a short prefill on a
                # long context.
                await turn(follow_up, ("local", holder))

        if len(ids) > 1:
            # The first pull between two engines includes NIXL's handshake (hundreds of ms, once per
            # pair and direction): make those now and keep them out of the fit.
            await pull_after_recompute(64, ids[0], ids[1], local=False)
            await pull_after_recompute(64, ids[1], ids[0], local=False)
            cost.learn_handshake()
        for n in lengths:
            if len(ids) > 1:
                await pull_after_recompute(n, ids[0], ids[1])
            else:
                await turn([rng.randrange(100, vocab) for _ in range(n)], ("recompute", ids[0]))
        await decode_alone(run_turn, ids[0], rng, vocab)
        if len(ids) > 1 and max_model_len >= 512:
            await contention(run_turn, ids[0], ids[1], rng, vocab,
                             [n for n in CONTENTION_LENGTHS if n + 64 < max_model_len])
        logger.info("cost model calibrated on %s: %s", ids, cost.snapshot())
    except Exception:  # calibration only sharpens the priors; serving must not depend on it
        logger.exception("cost model calibration failed; keeping the priors")


async def decode_alone(run_turn: RunTurn, replica: str, rng: random.Random, vocab: int) -> None:
    """One turn decoding DECODE_ALONE's tokens on `replica` while no other turn runs: the turn path learns the solo
    decode step from it (`CostModel.observe_decode`), which prices how long a turn keeps its engine busy and so what
    starting a second engine beside a busy one costs the first. Only turns that had their engine and node to
    themselves teach it, and a loaded app may run none: of two apps serving `benchmarks.multi_turn_external`'s
    conversations, one priced decoding at the 20 ms prior throughout, where the other measured 88 ms."""
    await run_turn([rng.randrange(100, vocab) for _ in range(64)], DECODE_ALONE, ("recompute", replica),
                   tenant=CALIBRATION_TENANT)


async def contention(run_turn: RunTurn, measured: str, busy: str, rng: random.Random, vocab: int,
                     lengths: list[int]) -> None:
    """Time prefills on `measured` alone, then while `busy` decodes CONTENTION_STREAMS long turns: if the two
    engines share a node, the turn path sees a busy peer and the second set teaches the cost model its slowdown per
    busy peer (else both are solo samples). Each length twice each way; 256 decode steps keep `busy` working longer
    than the measured prefills take.

    The slowdown is learned against the replica's solo speed, which the first set measures at the very lengths the
    second set uses (six prefills of at least `CostModel.MIN_SPEED_TOKENS`: the replica's speed factor). Without
    them it was learned against the start-up fit alone, which on this machine overestimated 1024-token prefills by
    a quarter (the first set now teaches the fit too), so a prefill 1.25x slower beside a busy engine read as
    none: the calibration measured 0.05-0.26 per busy peer in seven apps (one decoding stream beside it, or four),
    where prefills timed beside a decoding engine take 1.13-1.30x as long end to end
    (`benchmarks.contention`, contention.json) and two engines serving at once each run 1.29x slower (scaling.json).
    Four decoding streams: a multi-turn load keeps a few conversations on each engine, and beside one stream a
    256-token prefill measured 1.13x against 1.30x beside four there.

    Then, still under that load, short prefills on `busy` itself (ON_BUSY_LENGTHS): what a turn on a busy engine
    misses its estimate by is its own kind of error where engines share a node's CPUs."""
    async def prefills(target: str, prefill_lengths: list[int]) -> None:
        for n in prefill_lengths:
            await run_turn([rng.randrange(100, vocab) for _ in range(n)], ONE_TOKEN, ("recompute", target),
                           tenant=CALIBRATION_TENANT)

    await prefills(measured, lengths * 2)
    background = [asyncio.ensure_future(run_turn(
        [rng.randrange(100, vocab) for _ in range(64)], {"max_tokens": 256, "temperature": 0.0, "ignore_eos": True},
        ("recompute", busy), tenant=CALIBRATION_TENANT)) for _ in range(CONTENTION_STREAMS)]
    try:
        # The background turns are in flight (the runner counts them) and past their short prefills, decoding.
        await asyncio.sleep(CONTENTION_START_S)
        await prefills(measured, lengths * 2)
        await prefills(busy, list(ON_BUSY_LENGTHS))
    finally:
        await asyncio.gather(*background)
