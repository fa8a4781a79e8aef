"""Workloads for the fleet study: conversations as token ids, with arrival times, tenants and think times.

The four multi-turn configs in `benchmarks/configs/` (the real benchmark's,
`benchmarks.multi_turn_workload.BenchConfig`) scaled to the fleet, plus workloads only a fleet has: a trace-shaped one
(`trace`), bursts (`bursts`), one hot tenant (`hot_tenant`) and 20k-30k-token contexts (`long_context`), defined in
`benchmarks/configs/fleet_*.json` with their sources.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from benchmarks.multi_turn_workload import BenchConfig

CONFIGS = Path(__file__).resolve().parent / "configs"
# The real benchmark's workloads, each sized for two replicas (`BenchConfig.num_replicas`).
MULTI_TURN = ("today", "saturating", "long_history", "think_time")


class Dist(BaseModel):
    """A count or a duration drawn from a distribution."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["uniform", "lognormal", "geometric", "exponential", "constant"] = "uniform"
    min: float = 0
    max: float = math.inf
    mean: float = 0  # lognormal, geometric, exponential, constant
    sigma: float = 0.5  # lognormal: of the underlying normal

    def draw(self, rng: random.Random) -> float:
        if self.kind == "uniform":
            value = rng.uniform(self.min, self.max)
        elif self.kind == "lognormal":
            value = rng.lognormvariate(math.log(max(self.mean, 1e-9)) - self.sigma**2 / 2, self.sigma)
        elif self.kind == "geometric":  # number of trials to the first success, mean `mean`
            value = 1 + math.floor(math.log(1 - rng.random()) / math.log(1 - 1 / self.mean)) if self.mean > 1 else 1
        elif self.kind == "exponential":
            value = rng.expovariate(1 / self.mean) if self.mean > 0 else 0.0
        else:
            value = self.mean
        return min(self.max, max(self.min, value))

    def count(self, rng: random.Random) -> int:
        return max(1, round(self.draw(rng)))


class Workload(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = ""
    conversations: int = Field(ge=1)
    turns: Dist
    system_prefix_tokens: int = Field(ge=0)
    conversation_prefix_tokens: Dist
    user_tokens: Dist
    output_tokens: Dist
    think_time_s: Dist = Dist(kind="constant", mean=0)
    arrival: Literal["concurrency", "poisson"] = "concurrency"
    concurrency: int = Field(default=4, ge=1)
    rate: float = Field(default=1.0, gt=0)  # conversations per second (poisson)
    # Bursts: during [start_s, start_s + duration_s) conversations start `factor` times as fast (poisson).
    bursts: list[tuple[float, float, float]] = Field(default_factory=list)
    tenants: int = Field(default=1, ge=1)
    # The share of conversations that belong to tenant 0, whose conversations share a longer system prompt.
    hot_tenant_share: float = Field(default=0.0, ge=0, le=1)
    hot_tenant_system_tokens: int = Field(default=0, ge=0)
    # Scaled with the fleet: conversations and concurrency (or rate) per replica, as the config has for `per_replicas`.
    per_replicas: int = Field(default=2, ge=1)
    sources: dict[str, str] = Field(default_factory=dict)

    def scaled(self, replicas: int, load: float = 1.0) -> Workload:
        """This workload with its load per replica kept (times `load`: a GPU replica serves many times a CPU's
        users): conversations and concurrency (or rate) grow with the fleet."""
        f = replicas / self.per_replicas * load
        return self.model_copy(update={
            "conversations": max(1, round(self.conversations * f)), "concurrency": max(1, round(self.concurrency * f)),
            "rate": self.rate * f, "per_replicas": replicas})


def from_bench_config(name: str, config: BenchConfig) -> Workload:
    def span(s) -> Dist:
        return Dist(kind="uniform", min=s.min, max=s.max)

    return Workload(
        name=name, conversations=config.conversations, turns=span(config.turns),
        system_prefix_tokens=config.system_prefix_tokens,
        conversation_prefix_tokens=span(config.conversation_prefix_tokens), user_tokens=span(config.user_tokens),
        output_tokens=span(config.output_tokens), think_time_s=Dist(kind="constant", mean=config.think_time_s),
        arrival=config.arrival, concurrency=config.concurrency, rate=config.rate, per_replicas=config.num_replicas,
        sources={"all": f"benchmarks/configs/{name}.json (the real multi-turn benchmark's workload)"})


def load_workload(name: str) -> Workload:
    """A workload by name: one of the multi-turn configs, or `benchmarks/configs/fleet_NAME.json`."""
    if name in MULTI_TURN:
        return from_bench_config(name, BenchConfig.model_validate_json((CONFIGS / f"{name}.json").read_text()))
    path = CONFIGS / f"fleet_{name}.json"
    if not path.exists():
        known = [*MULTI_TURN, *sorted(p.stem.removeprefix("fleet_") for p in CONFIGS.glob("fleet_*.json"))]
        raise FileNotFoundError(f"no fleet workload {name!r}; known: {known}")
    return Workload.model_validate({"name": name, **json.loads(path.read_text())})


class Turn(BaseModel):
    user_tokens: list[int]
    output_tokens: list[int]
    think_s: float


class Conversation(BaseModel):
    conv_id: str
    tenant: str
    # The start-up calibration's (benchmarks/fleet_calibration.py): forced turns that still teach the estimate error.
    calibration: bool = False
    # A calibration conversation whose second turn pulls its first's history: of the calibration's turns, only such a
    # first turn leaves a hold (`Turn.keeps_history` in app/turn_types.py).
    calibration_hold: bool = False
    start_s: float | None  # poisson arrivals; None: when a client is free
    prefix_tokens: list[int]  # system prompt and the conversation's own prefix
    turns: list[Turn]
    # Whether it starts with the hot tenant's long system prompt (`hot_tenant_system_tokens`); the hot tenant's other
    # conversations, drawn among all tenants', start with its short one.
    hot: bool = False


def conversations(workload: Workload, seed: int, vocab: int = 32000) -> list[Conversation]:
    """The workload's conversations as token ids, deterministic for a seed. Token ids stand for text: equal ids are
    equal text, so a shared system prompt is shared KV."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    systems = {t: tokens(workload.system_prefix_tokens) for t in range(workload.tenants)}
    hot_system = tokens(workload.hot_tenant_system_tokens)
    out, t = [], 0.0
    for i in range(workload.conversations):
        hot = rng.random() < workload.hot_tenant_share
        tenant = 0 if hot else rng.randrange(workload.tenants)
        system = hot_system if hot and workload.hot_tenant_system_tokens else systems[tenant]
        start = None
        if workload.arrival == "poisson":
            factor = next((f for s, d, f in workload.bursts if s <= t < s + d), 1.0)
            t += rng.expovariate(workload.rate * factor)
            start = t
        turns = [Turn(user_tokens=tokens(workload.user_tokens.count(rng)),
                      output_tokens=tokens(workload.output_tokens.count(rng)),
                      think_s=workload.think_time_s.draw(rng) if k else 0.0)
                 for k in range(workload.turns.count(rng))]
        out.append(Conversation(conv_id=f"c{i}", tenant=f"tenant-{tenant}", start_s=start,
                                prefix_tokens=system + tokens(workload.conversation_prefix_tokens.count(rng)),
                                turns=turns, hot=hot and workload.hot_tenant_system_tokens > 0))
    return out
