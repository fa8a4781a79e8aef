"""The planner's own error: measured minus estimated time to first token per kind of option, and how far single
turns land from it. What the cost model's fits miss (queueing, Serve's hops, contention they model too simply) is
charged to the options that suffer it, and a departure from the replica holding a history must beat staying by
more than this uncertainty (`kvtransfer.policies.kvrelay.departure_noise_ms`)."""

from __future__ import annotations

import statistics
from collections import deque


class EstimateError:
    """Measured minus estimated time to first token per kind of option, over a sliding window (mutates on observe).

    Additive, because most of what the fits leave out is a fixed cost per request (Serve's hops, scheduling)
    that a ratio would inflate on short turns. A kind with too few samples of its own takes the median over the kinds
    of its pool (its situation: alone on the node or beside a busy peer, on an idle or a busy target), else over all
    kinds, so a rarely chosen option is not made to look cheaper than the ones whose overhead has been measured.
    Pools, because a turn beside a busy peer also carries the contention fit's miss: on the tiny test model after the
    start-up calibration, local turns (3 samples) took the median over all kinds, 46 ms, against 37 for recompute
    alone (its own 15 samples), so staying where the history is cached looked 9 ms dearer than it was. And a turn on
    a busy target, where engines share the node's CPUs, misses by more than one on an idle target beside it: the busy
    engine's own processes (its engine core stepping, its replica relaying the streams) take the CPU its prefill
    needs, which the fits do not model (tiny-llama, a 128-token turn on 64 cached while the target decoded four
    streams: 126 ms measured against 52 estimated, when the idle replica beside it took 54 ms,
    tests/test_planner_vs_measured.py on branch planner-vs-measured).
    """

    MIN_SAMPLES = 8
    BUSY_NODE = "_busy_node"  # a kind's suffix beside a busy peer
    BUSY_TARGET = "_busy_target"  # and on a busy target
    # The share of turns whose estimate, corrected by the median, lands within a kind's uncertainty.
    SPREAD_QUANTILE = 0.8

    def __init__(self, window: int = 64) -> None:
        self.window = window
        self._errors: dict[str, deque[float]] = {}
        self._all: deque[float] = deque(maxlen=window)
        self._pools: dict[tuple[bool, bool], deque[float]] = {}
        # Medians, refreshed on observe (once per turn) so that planning only reads them.
        self._offsets: dict[str, float] = {}
        self._pool_offsets: dict[tuple[bool, bool], float] = {}
        self._overall = 0.0
        # How far single turns land from that median (SPREAD_QUANTILE of |error - median|), likewise.
        self._spreads: dict[str, float] = {}
        self._pool_spreads: dict[tuple[bool, bool], float] = {}
        self._overall_spread = 0.0

    @staticmethod
    def kind(mode: str, busy_peers: int, busy_target: bool = False) -> str:
        return (f"{mode}{EstimateError.BUSY_NODE if busy_peers > 0 else ''}"
                f"{EstimateError.BUSY_TARGET if busy_target else ''}")

    @staticmethod
    def _pool(kind: str) -> tuple[bool, bool]:
        return EstimateError.BUSY_NODE in kind, kind.endswith(EstimateError.BUSY_TARGET)

    def observe(self, mode: str, busy_peers: int, estimate_ms: float, measured_ms: float,
                busy_target: bool = False) -> None:
        if estimate_ms <= 0 or measured_ms <= 0:
            return
        kind = self.kind(mode, busy_peers, busy_target)
        pool = self._pool(kind)
        if pool not in self._pools:
            self._pools[pool] = deque(maxlen=self.window)
        error = measured_ms - estimate_ms
        # statistics.median: numpy's converts the deque and checks for NaNs first, ten times the cost for 64 floats.
        for errors, offsets, spreads, key in (
                (self._errors.setdefault(kind, deque(maxlen=self.window)), self._offsets, self._spreads, kind),
                (self._pools[pool], self._pool_offsets, self._pool_spreads, pool)):
            errors.append(error)
            if len(errors) >= self.MIN_SAMPLES:
                offsets[key], spreads[key] = self._median_and_spread(errors)
        self._all.append(error)
        if len(self._all) >= self.MIN_SAMPLES:
            self._overall, self._overall_spread = self._median_and_spread(self._all)

    def _median_and_spread(self, errors: deque[float]) -> tuple[float, float]:
        median = statistics.median(errors)
        deviations = sorted(abs(e - median) for e in errors)
        return median, deviations[min(len(deviations) - 1, int(self.SPREAD_QUANTILE * len(deviations)))]

    def offset_ms(self, mode: str, busy_peers: int, busy_target: bool = False) -> float:
        return self._offset(self.kind(mode, busy_peers, busy_target))

    def _offset(self, kind: str) -> float:
        if kind in self._offsets:
            return self._offsets[kind]
        return self._pool_offsets.get(self._pool(kind), self._overall)

    def _spread(self, kind: str) -> float:
        if kind in self._spreads:
            return self._spreads[kind]
        return self._pool_spreads.get(self._pool(kind), self._overall_spread)

    def uncertainty_ms(self, mode: str, busy_peers: int, busy_target: bool = False) -> float:
        """How far a corrected estimate of this kind is from the measured time for most turns (SPREAD_QUANTILE of
        |error - median| over its window; a kind with too few samples takes its pool's, else all kinds'). 0 before
        any kind has MIN_SAMPLES: then only the stay margin guards a departure."""
        return self._spread(self.kind(mode, busy_peers, busy_target))

    def corrected(self, mode: str, busy_peers: int, estimate_ms: float, busy_target: bool = False) -> float:
        """`estimate_ms` plus the measured error of its kind (`with_offset`)."""
        return with_offset(estimate_ms, self.offset_ms(mode, busy_peers, busy_target))

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {k: {"offset_ms": round(self._offset(k), 2), "uncertainty_ms": round(self._spread(k), 2),
                    "samples": len(v)} for k, v in sorted(self._errors.items())}


def with_offset(estimate_ms: float, offset_ms: float) -> float:
    """An estimate corrected by its kind's measured error; never below half the fits' estimate."""
    return max(estimate_ms / 2, estimate_ms + offset_ms)
