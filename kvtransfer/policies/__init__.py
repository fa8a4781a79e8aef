"""Placement policies: how a turn's (replica, mode) is chosen among the options the planner priced. Each policy is
one file that registers its class (`base.register`); importing it here is what makes its name known.
"""

from __future__ import annotations

from kvtransfer.policies import fixed_threshold, kvrelay, prefix_affinity, round_robin, session  # noqa: F401
from kvtransfer.policies.base import (
    DEFAULT_POLICY,
    PlacementPolicy,
    PolicyContext,
    get_policy,
    policy_names,
    register,
)

__all__ = ["DEFAULT_POLICY", "PlacementPolicy", "PolicyContext", "get_policy", "policy_names", "register"]
