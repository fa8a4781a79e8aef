"""The planner's cost model: milliseconds to recompute n tokens on a replica, or to pull their KV.

All are linear models fitted online by least squares over the most recent observations:

    recompute_ms(k new tokens after c cached ones) = a + b*k + d*k*(c + k/2)      (attention grows with context)
    pull_ms(bytes, holder busy or not)             = fixed + bytes / bandwidth + busy * max(0, h0 + h1*bytes)
    slowdown(p busy peers on the same node)        = 1 + s*p                          (shared CPUs, memory bandwidth)

The same s prices the other side of contention: an idle engine that starts a turn slows each request in flight
on the busy engines beside it by s for as long as the turn keeps it busy (`contention_impact_ms`; how long comes
from the turn's prefill, its expected output tokens and the solo decode step, each measured here too), and again
for each later turn its conversation will bring there (`WorkloadForecast.expected_future_turns` in
`kvtransfer/workload.py`, from how far recent conversations went beyond the turn's place in its own).

The prefill fit learns from turns that had their engine and node to themselves; the slowdown from turns that
had their engine to themselves while other engines on the node were busy (observed / solo prediction - 1, against
p = the busy engines, each counted for the share of the prefill it was busy),
per node (nodes differ: cores, memory bandwidth, how many engines share them), the fleet's fit standing in for
a node until it has MIN_NODE_SAMPLES of its own.

The holder's part of a pull: the link fit (fixed + bytes / bandwidth) learns from pulls whose holder was idle when
planned, and a second fit of the same form (`busy_holder_pull`) from pulls whose holder was busy; the holder-load term
(h0 + h1*bytes, `holder_load` in the snapshot) is how much longer the second fit says they take, never below 0. Where
the holder serves the read with its own CPU (NIXL over TCP or shared memory on CPU replicas) a busy holder answers
later; with RDMA the holder's NIC serves it and the term comes out about 0. Until a fit has measured pulls of its own,
the other stands in for it: until a pull from a busy holder is observed, such a pull is priced by the link fit; where
only busy holders were measured, their pulls are all that says what a pull costs. In P/D with one prefill replica the
start-up calibration measures no pull and every holder is a decode replica, busy: learned only as what they took
beyond a link fit still at its prior (1 GB/s), those pulls left a 10k-token pull of a 70B model priced at 3.3 s
instead of 0.19 until two pulls happened to find the decoder idle, and the planner recomputed meanwhile (modelled,
`benchmarks.fleet --workload pr32553 --topology disaggregated --replicas 2`: 163 pulls of 367 turns and TTFT p50 402 ms,
against 341 and 246 ms with the fit of their own).

On top of the fits, the planner's own error: measured minus estimated time to first token per kind of option
(mode, and whether other engines on the node were busy), from the turns it ran; each kind's estimates get the
median error added (`EstimateError`), so whatever the fits miss (queueing, Serve's hops, contention they model
too simply) is charged to the options that suffer it.

Seeded by a short measurement when the app starts, refitted after every observed turn, visible in
`snapshot()`. No fixed token threshold appears anywhere: the crossover falls where these two meet.
Not thread-safe; the ingress calls it from one event loop.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvtransfer.estimate_error import EstimateError
from kvtransfer.fits import OnlineLinearFit
from kvtransfer.shared_prefix import SharedPrefixes
from kvtransfer.typical_wait import TypicalWait
from kvtransfer.workload import WorkloadForecast

if TYPE_CHECKING:  # the planner's view of a replica; its module prices nothing
    from kvtransfer.load import ReplicaView


def _prefill_features(new_tokens: int, context_tokens: int) -> tuple[float, float, float]:
    return (1.0, float(new_tokens), new_tokens * (context_tokens + new_tokens / 2) / 1e3)


class CostModel:
    """Time estimates in milliseconds for recompute and pull, calibrated online."""

    # Priors: roughly SmolLM2-135M on one CPU core and NIXL DRAM->DRAM over loopback. They only matter
    # until the start-up calibration replaces them.
    PRIOR_PREFILL = (20.0, 0.5, 0.0)
    PRIOR_PULL = (30.0, 1.0 / 1e6)  # fixed ms, ms per byte (1 GB/s)
    MIN_SPEED_SAMPLES = 6
    MIN_SPEED_TOKENS = 128
    MIN_NODE_SAMPLES = 4
    # Busy peers (summed shares of a prefill's time) below which a prefill counts as solo.
    SOLO_SHARE = 0.1

    def __init__(self, kv_bytes: Callable[[int], int], window: int = 64, shared_compute: bool = True) -> None:
        self.kv_bytes = kv_bytes
        # Whether the engines of a node share its compute (CPU replicas) and so slow each other; with a GPU each
        # they do not, and the planner neither prices nor tells apart turns beside busy engines.
        self.shared_compute = shared_compute
        self.prefill = OnlineLinearFit(("overhead_ms", "ms_per_token", "ms_per_ktoken_ctx"), self.PRIOR_PREFILL, window)
        self.pull = OnlineLinearFit(("fixed_ms", "ms_per_byte"), self.PRIOR_PULL, window)
        self.busy_holder_pull = OnlineLinearFit(("fixed_ms", "ms_per_byte"), self.PRIOR_PULL, window)
        self._window = window
        self.contention = self._contention_fit()
        # Each node's own slowdown fit, and each replica's node (`set_nodes`).
        self._node_contention: dict[str, OnlineLinearFit] = {}
        self._node_of: dict[str, str] = {}
        self.error = EstimateError(window)
        # One decode step of a request alone on its engine (a moving average over such requests).
        self.decode_step_ms = 20.0
        self._decode_samples = 0
        # How many more turns a conversation brings, and how long a turn decodes.
        self.workload = WorkloadForecast()
        # How long turns typically wait on each replica (what a conversation's later turns will find there).
        self.typical_wait = TypicalWait()
        # How often first turns start with each shared prefix, and how long each replica's cache keeps a block.
        self.shared_prefixes = SharedPrefixes()
        # Extra time of the first pull between two engines (NIXL's handshake), measured at start-up.
        self.handshake_ms = 0.0
        # Taking a hold from the KV directory before the turn that reads it is sent (a call to the directory's actor,
        # which makes the hold this turn's alone): a moving average of measured takes, 0 until one is measured.
        self.take_hold_ms = 0.0
        self._take_samples = 0
        # Per replica: recent measured / fleet-estimated prefill ratios, and their median once there are enough.
        self._speed_ratios: dict[str, deque[float]] = {}
        self._speed: dict[str, float] = {}
        self._typical_speed = 1.0  # the median of `_speed`

    # ---------------------------------------------------------------- estimates (pure)

    def recompute_ms(
        self, new_tokens: int, context_tokens: int = 0, busy_peers: int = 0, replica_id: str | None = None
    ) -> float:
        """Prefill `new_tokens` on top of `context_tokens` already in the replica's KV cache, while
        `busy_peers` other engines on its node are busy, on `replica_id` (at its measured speed) or a typical one."""
        if new_tokens <= 0:
            return 0.0
        return self._prefill_ms(_prefill_features(new_tokens, context_tokens), busy_peers, replica_id)

    def solo_prefill_ms(self, new_tokens: int, context_tokens: int = 0) -> float:
        """The fleet's prefill fit alone: `recompute_ms` on a typical replica with its node to itself."""
        return max(0.0, self.prefill.predict(_prefill_features(new_tokens, context_tokens)))

    def _prefill_ms(self, features: Sequence[float], busy_peers: int, replica_id: str | None) -> float:
        """The prefill fit at `features`, on `replica_id` while `busy_peers` engines beside it are busy."""
        slowdown, speed = self.prefill_factors(busy_peers, replica_id)
        return max(0.0, self.prefill.predict(features)) * slowdown * speed

    def prefill_factors(self, busy_peers: int, replica_id: str | None) -> tuple[float, float]:
        """What scales the fleet's prefill fit on `replica_id` while `busy_peers` engines beside it are busy: the
        node's slowdown and the replica's speed (`recompute_ms` = `solo_prefill_ms` x both)."""
        return self.slowdown(busy_peers, replica_id), self.speed_factor(replica_id)

    def speed_factor(self, replica_id: str | None) -> float:
        """How much longer than the fleet's fit a replica's prefills take: its recent median measured / estimated
        over solo prefills of at least MIN_SPEED_TOKENS, once it has MIN_SPEED_SAMPLES. Replicas differ (a slower
        core, a noisy neighbour, another GPU), and one can slow down mid-run. A replica without that many yet (one
        that mostly works beside a busy engine) runs as the measured ones do, their median: the fit is off for all
        of them alike (every quick multi-turn run of 2026-11-27 measured the busier replica at 0.79-0.93 of it),
        and taking it at face value for the other replica made that one's contended prefills look less slowed
        down than they were. None: the fit itself."""
        if replica_id is None:
            return 1.0
        return self._speed.get(replica_id, self._typical_speed)

    def set_nodes(self, node_of: dict[str, str]) -> None:
        """Which node each live replica runs on (mutates; keeps the caller's dict): contention is learned and priced
        per node."""
        self._node_of = node_of

    def _contention_fit(self) -> OnlineLinearFit:
        return OnlineLinearFit(("slowdown_per_busy_peer",), (0.0,), self._window)

    def _contention(self, replica_id: str | None) -> OnlineLinearFit:
        """The slowdown fit of `replica_id`'s node once it has enough samples, else the fleet's."""
        fit = self._node_contention.get(self._node_of.get(replica_id, "")) if replica_id is not None else None
        return fit if fit is not None and len(fit.samples) >= self.MIN_NODE_SAMPLES else self.contention

    def slowdown(self, busy_peers: int, replica_id: str | None = None) -> float:
        """How much longer work takes on a replica while `busy_peers` other engines on its node are busy."""
        if busy_peers <= 0 or not self.shared_compute:
            return 1.0
        return 1.0 + max(0.0, self._contention(replica_id).predict((float(busy_peers),)))

    def pull_ms(self, num_tokens: int, holder: ReplicaView | None = None) -> float:
        """Transfer the KV of `num_tokens` tokens from `holder` (its view when planned; None: an idle one): the link's
        fixed handover part + bytes / bandwidth, and from a busy holder what reads from busy holders took, where that
        is longer. Each kind of holder is priced by the other's fit until its own has measured pulls."""
        features = (1.0, float(self.kv_bytes(num_tokens)))
        link, busy = self._measured(self.pull), self._measured(self.busy_holder_pull)
        link_ms = max(0.0, (self.pull if link or not busy else self.busy_holder_pull).predict(features))
        if holder is None or holder.idle or not busy:
            return link_ms
        busy_ms = max(0.0, self.busy_holder_pull.predict(features))
        return max(link_ms, busy_ms) if link else busy_ms

    @staticmethod
    def _measured(fit: OnlineLinearFit) -> bool:
        """Whether `fit` has been fitted to observations of its own (not its prior)."""
        return len(fit.samples) >= len(fit.names)

    def step_ms(self, load: ReplicaView) -> float:
        """One decode step on a replica: its measured token rate per request, else the default."""
        return 1e3 / load.decode_tok_s if load.decode_tok_s else self.decode_step_ms

    def queue_ms(self, load: ReplicaView) -> float:
        """Wait before a new request's first token beyond its own prefill: the known prefills ahead of it,
        other queued requests (256 tokens each, a guess), and one decode step if the engine is decoding (vLLM
        batches a new prefill with the running decodes, so they cost it about one step, not one each)."""
        peers, replica = load.busy_peers, load.replica_id
        ahead = self.backlog_ms(load)
        if load.waiting:
            ahead += load.waiting * self.recompute_ms(256, 0, peers, replica)
        return ahead + (self.step_ms(load) if load.running else 0.0)

    def backlog_ms(self, load: ReplicaView) -> float:
        """The prefills known to be queued or running on a replica beside its busy peers (`load.prefill_tokens`), less
        what its engine has done of them (`load.prefill_elapsed_ms`). Counted whole until their first tokens, a first
        turn's 1,000-token prefill half done still looked a whole one away, and of two CPU engines the busy one looked
        further off than it was."""
        return load.left_of(self.queued_prefill_ms(load.prefill_tokens, load.prefilling, load.busy_peers,
                                                   load.replica_id))

    def queued_prefill_ms(
        self, tokens: int, requests: int, busy_peers: int = 0, replica_id: str | None = None
    ) -> float:
        """Prefill `tokens` prompt tokens of `requests` queued requests: the per-token cost of all of them, but
        attention only within each prompt (of the average length) and the fixed cost once, since vLLM batches queued
        prefills into the same steps. Fitting them as one prompt of the summed length priced attention over the sum:
        a burst of ten 1k-token first turns was estimated at up to 5.3 s and took 2.7."""
        if tokens <= 0:
            return 0.0
        n = max(1, requests)
        return self._prefill_ms((1.0, float(tokens), tokens * (tokens / n) / 2 / 1e3), busy_peers, replica_id)

    def contention_impact_ms(self, overlap_ms: float, requests: float, replica_id: str | None = None) -> float:
        """Delay imposed on `requests` requests working on a busy engine of a node while one more of its engines
        (`replica_id`) works beside them for `overlap_ms`: each runs slower by the node's slowdown per busy peer."""
        return self.contention_per_peer(replica_id) * overlap_ms * requests

    def contention_per_peer(self, replica_id: str | None = None) -> float:
        """How much slower a busy engine beside `replica_id` works while `replica_id` works too (0 where a node's
        engines do not share compute): `contention_impact_ms` per ms of overlap and per request slowed."""
        if not self.shared_compute:
            return 0.0
        return max(0.0, self._contention(replica_id).predict((1.0,)))

    # ---------------------------------------------------------------- calibration (mutates)

    def observe_prefill(
        self, new_tokens: int, context_tokens: int, ms: float, busy_peers: float = 0, replica_id: str | None = None
    ) -> None:
        """A prefill that had its engine to itself, on `replica_id`: with no busy peer beside it, it teaches the
        fleet's fit and that replica's speed relative to the fit (the fit then describes the fleet's mix, and fit x
        factor each replica, whatever the mix); with busy peers, the slowdown, against that replica's solo speed.
        `busy_peers` counts each other engine of the node for the share of the prefill it was busy (a peer busy
        for a tenth of it or less leaves a solo sample: it slowed the prefill by a few percent at most).

        A replica's speed is learned from its solo prefills only. Learned from all of them (a contended one
        measured against the fit x the current slowdown), the speed of a replica that mostly works beside a busy
        one absorbed the slowdown the fit had not yet learned, and its contended prefills then measured none: the
        two held each other at the first guess (a quick multi-turn run: slowdown 0.09 per busy peer and the quieter
        replica 13% "slower" than the busier one, on two cores that compute alike, benchmarks/results/two_cores.json,
        where two engines each working measure 1.29x slower, scaling.json)."""
        if new_tokens <= 0 or ms <= 0:
            return
        fleet = self.recompute_ms(new_tokens, context_tokens)
        if busy_peers < self.SOLO_SHARE:
            busy_peers = 0
        # Short prefills measure the fit's error at small lengths (overheads), not the replica's speed.
        if busy_peers <= 0 and replica_id is not None and fleet > 0 and new_tokens >= self.MIN_SPEED_TOKENS:
            ratios = self._speed_ratios.setdefault(replica_id, deque(maxlen=32))
            ratios.append(ms / fleet)
            if len(ratios) >= self.MIN_SPEED_SAMPLES:
                self._speed[replica_id] = float(np.median(ratios))
                self._typical_speed = statistics.median(self._speed.values())
        if busy_peers <= 0:
            self.prefill.observe(_prefill_features(new_tokens, context_tokens), ms)
            return
        solo = self.recompute_ms(new_tokens, context_tokens, replica_id=replica_id)
        if solo > 0:
            sample = ((float(busy_peers),), ms / solo - 1.0)
            self.contention.observe(*sample)
            node = self._node_of.get(replica_id or "")
            if node:
                if node not in self._node_contention:
                    self._node_contention[node] = self._contention_fit()
                self._node_contention[node].observe(*sample)

    def observe_decode(self, step_ms: float) -> None:
        """A decode step measured on a request that had its engine to itself (mutates the moving average)."""
        if step_ms > 0:
            self._decode_samples += 1
            weight = 0.2 if self._decode_samples > 1 else 1.0  # the first measurement replaces the prior
            self.decode_step_ms = (1 - weight) * self.decode_step_ms + weight * step_ms

    def observe_take_hold(self, ms: float) -> None:
        """A hold taken from the directory in `ms` before its turn was sent (mutates the moving average)."""
        if ms >= 0:
            self._take_samples += 1
            weight = 0.2 if self._take_samples > 1 else 1.0
            self.take_hold_ms = (1 - weight) * self.take_hold_ms + weight * ms

    def observe_pull(self, num_tokens: int, ms: float, holder_busy: bool = False) -> None:
        """`ms`: how long a pulling request waited for the KV of `num_tokens` tokens (mutates). From a holder idle
        when the pull was planned it teaches the link fit; from a busy one, the busy holders' fit, with the time it
        took (not what it took beyond the link fit at the time: that fit may still be at its prior)."""
        if num_tokens <= 0 or ms <= 0:
            return
        features = (1.0, float(self.kv_bytes(num_tokens)))
        (self.busy_holder_pull if holder_busy else self.pull).observe(features, ms)

    def learn_handshake(self) -> None:
        """The pulls observed so far were each the first between their two engines (mutates): their mean transfer
        time is what a pull costs between engines that have not met yet (NIXL's handshake, hundreds of ms), and
        they are dropped as transfer samples, returning the pull fit to its priors."""
        times = [ms for _, ms in self.pull.samples]
        if times:
            self.handshake_ms = float(np.mean(times))
        self.pull.samples.clear()
        self.pull.coef = np.asarray(self.PRIOR_PULL, dtype=float)

    def _holder_load(self) -> dict[str, float]:
        """How much longer pulls from busy holders take than from idle ones, per pull and per byte (0 until both
        kinds have been measured)."""
        both = self._measured(self.pull) and self._measured(self.busy_holder_pull)
        extra = self.busy_holder_pull.coef - self.pull.coef if both else np.zeros(2)
        return {"busy_holder_ms": float(extra[0]), "busy_holder_ms_per_byte": float(extra[1]),
                "samples": len(self.busy_holder_pull.samples)}

    def snapshot(self) -> dict[str, object]:
        bw = self.pull.coef[1]
        return {
            "shared_compute": self.shared_compute,
            "prefill": self.prefill.as_dict(),
            "contention": self.contention.as_dict(),
            "contention_by_node": {node: fit.as_dict() for node, fit in sorted(self._node_contention.items())},
            "pull": self.pull.as_dict() | {"bandwidth_gb_s": (1e-6 / bw) if bw > 0 else None},
            "holder_load": self._holder_load(),
            "busy_holder_pull": self.busy_holder_pull.as_dict(),
            "decode_step_ms": self.decode_step_ms,
            "typical_output_tokens": self.workload.typical_output_tokens,
            "handshake_ms": self.handshake_ms,
            "take_hold_ms": round(self.take_hold_ms, 2),
            "continuation_share": round(self.workload.continuation_share, 3),
            "expected_future_turns": round(self.workload.expected_future_turns(), 2),
            "expected_future_turns_after_first": round(self.workload.expected_future_turns(0), 2),
            "replica_speed": {r: round(f, 3) for r, f in sorted(self._speed.items())},
            "estimate_error": self.error.as_dict(),
            "typical_wait_ms": self.typical_wait.as_dict(),
            "shared_prefixes": self.shared_prefixes.as_dict(),
        }
