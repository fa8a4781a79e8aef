"""Placement policies behind one interface: the registry, each built-in policy's choice among hand-built options,
and a policy registered elsewhere placing turns through `plan_turn` by its name. Pure functions: no Ray, no engines."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvtransfer.cost_model import CostModel
from kvtransfer.load import ReplicaView
from kvtransfer.options import Mode, Option
from kvtransfer.planner import plan_turn
from kvtransfer.policies import PlacementPolicy, PolicyContext, base, get_policy, policy_names, register
from kvtransfer.policies.base import without_pull
from kvtransfer.types import HoldOffer, LookupResult, ReplicaMatch
from tests.conftest import make_hold

HOLD = HoldOffer("a", 960, 1e12, make_hold(960, "e-a"))
# Replica a holds the conversation's 960-token history (its prefix cache and a hold); c caches the 64-token system
# prompt; b holds nothing and has a request waiting.
REPLICAS = (ReplicaView("a"), ReplicaView("b", waiting=1), ReplicaView("c"))
LOOKUP = LookupResult(1000, (ReplicaMatch("a", 960, "hold", 960, HOLD), ReplicaMatch("c", 64, "resident", 64, None)))
A_LOCAL = Option(Mode.LOCAL, "a", None, 960, 960, 100.0, HOLD)
B_RECOMPUTE = Option(Mode.RECOMPUTE, "b", None, 0, 0, 300.0)
B_PULL = Option(Mode.PULL, "b", "a", 960, 0, 60.0, HOLD)
C_LOCAL = Option(Mode.LOCAL, "c", None, 64, 64, 250.0)
C_PULL = Option(Mode.PULL, "c", "a", 960, 64, 95.0, HOLD)
# In the order the planner lists them: per target, its own cache's option first, then pulls.
OPTIONS = (A_LOCAL, B_RECOMPUTE, B_PULL, C_LOCAL, C_PULL)


def context(preferred: str | None = None, rotation: int = 0, turn_index: int | None = 1) -> PolicyContext:
    # A fresh cost model: no measured estimate error yet, so only the stay margin guards a departure.
    return PolicyContext(LOOKUP, REPLICAS, CostModel(lambda n: 1000 * n), preferred, rotation, turn_index)


def choose(name: str, options: Sequence[Option] = OPTIONS, **kwargs) -> Option:
    return get_policy(name).choose(options, context(**kwargs))


def test_the_registry_knows_the_five_built_in_policies_and_which_of_them_pull():
    assert policy_names() == ["fixed_threshold", "kvrelay", "prefix_affinity", "round_robin", "session"]
    assert {name for name in policy_names() if get_policy(name).pulls} == {"kvrelay", "fixed_threshold"}
    with pytest.raises(ValueError, match=r"unknown placement policy 'nope'; known: \['fixed_threshold', "):
        get_policy("nope")


def test_round_robin_walks_the_targets_by_name_and_never_pulls():
    assert [choose("round_robin", rotation=r) for r in range(4)] == [A_LOCAL, B_RECOMPUTE, C_LOCAL, A_LOCAL]


def test_session_affinity_runs_on_the_sessions_replica_whatever_it_holds():
    assert choose("session", preferred="b") == B_RECOMPUTE
    assert choose("session", preferred="c", rotation=1) == C_LOCAL
    # No session, or one whose replica may not take the turn: round robin.
    assert choose("session", rotation=1) == B_RECOMPUTE
    assert choose("session", preferred="gone", rotation=2) == C_LOCAL


def test_prefix_affinity_takes_the_longest_holder_else_the_least_loaded():
    assert choose("prefix_affinity", rotation=1) == A_LOCAL
    # Without a: c holds 64 tokens, b none.
    assert choose("prefix_affinity", OPTIONS[1:]) == C_LOCAL
    # Nothing held on b or d: d, with no request waiting, before b.
    d = Option(Mode.RECOMPUTE, "d", None, 0, 0, 300.0)
    assert choose("prefix_affinity", (B_RECOMPUTE, d)) == d


def test_fixed_threshold_pulls_on_its_round_robin_target_when_the_pull_adds_64_tokens():
    assert choose("fixed_threshold", rotation=1) == B_PULL  # 960 tokens over b's none
    assert choose("fixed_threshold", rotation=2) == C_PULL  # 960 over c's 64
    assert choose("fixed_threshold", rotation=0) == A_LOCAL  # the holder itself: nothing to pull
    short = C_PULL._replace(reused_tokens=127)
    assert choose("fixed_threshold", (C_LOCAL, short), rotation=0) == C_LOCAL  # 63 tokens more: below the threshold
    assert choose("fixed_threshold", (C_LOCAL, short._replace(reused_tokens=128))).reused_tokens == 128


def test_kvrelay_leaves_the_history_only_for_a_clearly_cheaper_option():
    # A pull onto b at 60 ms against 100 ms staying on a: cheaper by more than 10% and 5 ms.
    assert choose("kvrelay") == B_PULL
    # At 88 ms it is not (100 * 0.9 - 5 = 85): the turn stays with its history...
    slower = (A_LOCAL, B_RECOMPUTE, B_PULL._replace(estimate_ms=88.0), C_LOCAL, C_PULL)
    assert choose("kvrelay", slower) == A_LOCAL
    # ...unless it is a conversation's first turn, which has no history of its own to stay with.
    assert choose("kvrelay", slower, turn_index=0) == slower[2]
    # The cost counts the delay an option imposes on others, not only its own time to first token.
    crowding = (A_LOCAL, B_RECOMPUTE, B_PULL._replace(impact_ms=50.0), C_LOCAL, C_PULL)
    assert choose("kvrelay", crowding, turn_index=0) == C_PULL
    # Within 2% and 5 ms of the cheapest, the session's replica.
    near = (A_LOCAL._replace(estimate_ms=64.0), B_PULL)
    assert choose("kvrelay", near, preferred="a", turn_index=0) == near[0]
    assert choose("kvrelay", near, preferred="b", turn_index=0) == B_PULL


def test_a_policy_registered_outside_the_planner_places_turns_by_its_name(monkeypatch):
    monkeypatch.setattr(base, "_POLICIES", dict(base._POLICIES))  # the registration ends with this test

    @register
    class LastByName(PlacementPolicy):
        """The last replica by name, on its own prefix cache: no built-in policy would choose c here."""

        name = "last_by_name"

        def choose(self, options: Sequence[Option], context: PolicyContext) -> Option:
            return without_pull(options, max(o.replica_id for o in options))

    assert "last_by_name" in policy_names()
    plan = plan_turn(1000, LOOKUP, REPLICAS, CostModel(lambda n: 1000 * n), policy="last_by_name", turn_index=1)
    assert (plan.replica_id, plan.mode, plan.reused_tokens) == ("c", Mode.LOCAL, 64)
    assert plan.reason.startswith("last_by_name policy: ")
    # Every estimate is still there, whatever chose.
    assert set(plan.estimates_ms) == {"local", "pull", "recompute"}
    with pytest.raises(ValueError, match="two placement policies are named 'last_by_name'"):
        register(LastByName)


def test_a_config_naming_no_registered_policy_is_refused_before_any_actor_starts():
    from app.builder import build_app  # imports Ray Serve and vLLM; starts neither

    with pytest.raises(ValueError, match=r"unknown placement policy 'nope'; known: \["):
        build_app({"policy": "nope"})
