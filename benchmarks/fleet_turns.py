"""What the fleet simulation (`benchmarks/fleet_sim.py`) keeps per conversation and per turn in flight, and what
a run measured: one `TurnRecord` per served turn, gathered in a `FleetResult`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from benchmarks.fleet_workloads import Conversation
from kvtransfer.planner import Plan
from kvtransfer.prefix_key import PrefixKey
from kvtransfer.sim.engine import SimRequest


@dataclass
class TurnRecord:
    """One served turn as the fleet study counts it (the start-up calibration's turns are not counted)."""

    conv_id: str
    turn: int
    policy: str
    start_s: float
    ttft_ms: float
    prompt_tokens: int
    reused_tokens: int
    mode: str
    replica: str
    estimate_ms: float
    pulled_bytes: int = 0


@dataclass
class LiveConversation:
    """A conversation being served: its history as token ids, hashed both ways, and its turns to come."""

    conv: Conversation
    tokens: list[int]
    vllm_hashes: list[bytes]
    key: PrefixKey
    next_turn: int = 0


@dataclass
class TurnInFlight:
    """A turn from its plan to its last token: what its first token and its end need to record it, teach the cost
    model and start what comes next."""

    live: LiveConversation
    index: int
    plan: Plan
    start: float
    prompt: list[int]
    request: SimRequest
    pulled_bytes: int = 0
    busy_peers: int = 0
    forced: bool = False
    on_done: Callable[[], None] | None = None
    kv_wait_ms: float | None = None
    decode_stage: bool = False  # P/D: the decode pool's part of the turn (its first token was the prefill's)
    output: list[int] = field(default_factory=list)
    leaves_hold: bool = False  # its last stage leaves a hold for the next turn (its policy pulls; not a calibration's)


@dataclass
class FleetResult:
    """What serving one workload under one policy measured (`Fleet.run`)."""

    records: list[TurnRecord] = field(default_factory=list)
    counters: Counter = field(default_factory=Counter)
    requests_per_replica: Counter = field(default_factory=Counter)
    duration_s: float = 0.0
    cost_model: dict = field(default_factory=dict)

