"""The placement policy interface and its registry: a policy picks one of a turn's options, and a class
decorated with `register` can be named wherever a policy is (the app's config, `x-kvrelay-policy`, the fleet study).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar, NamedTuple, TypeVar

from kvtransfer.cost_model import CostModel
from kvtransfer.load import ReplicaView
from kvtransfer.options import Mode, Option
from kvtransfer.types import LookupResult

# The policy a deployment runs unless its config or a request names another.
DEFAULT_POLICY = "kvrelay"


class PolicyContext(NamedTuple):
    """What a policy may weigh besides the options: the turn's inputs as `plan_turn` received them."""

    lookup: LookupResult
    replicas: Sequence[ReplicaView]
    cost: CostModel
    # The session's usual replica (rendezvous hash of its id over the eligible replicas), or None.
    preferred_replica: str | None
    # The caller's turn counter: what round robin walks by, and what breaks exact ties elsewhere.
    rotation: int
    # The turn's place in its conversation (0: its first; None: not known).
    turn_index: int | None


class PlacementPolicy(ABC):
    """Chooses where a turn runs and how: one of the options the planner built and priced.

    `choose` reads its arguments only and keeps no state, so one instance serves every turn, concurrently.
    """

    name: ClassVar[str]
    # Whether the policy ever chooses a pull: only then must a turn leave a pullable hold behind for the next one.
    pulls: ClassVar[bool] = False

    @abstractmethod
    def choose(self, options: Sequence[Option], context: PolicyContext) -> Option:
        """One of `options` (never empty; every option's target is a replica the turn may run on)."""


_POLICIES: dict[str, PlacementPolicy] = {}
P = TypeVar("P", bound=type[PlacementPolicy])


def register(cls: P) -> P:
    """Class decorator: make the policy available by its `name` (one instance, made here without arguments, serves
    every turn)."""
    if cls.name in _POLICIES:
        raise ValueError(f"two placement policies are named {cls.name!r}: rename one")
    _POLICIES[cls.name] = cls()
    return cls


def get_policy(name: str) -> PlacementPolicy:
    """The registered policy called `name`; ValueError naming the known ones if there is none."""
    try:
        return _POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown placement policy {name!r}; known: {policy_names()}") from None


def policy_names() -> list[str]:
    """Every registered policy's name, sorted."""
    return sorted(_POLICIES)


def without_pull(options: Sequence[Option], target: str) -> Option:
    """What a router that never moves KV runs on `target`: the option there that reuses its prefix cache as far as it
    goes, or recomputes (the planner lists it first for each target, before reading a hold or pulling)."""
    return next(o for o in options if o.replica_id == target and o.mode is not Mode.PULL)
