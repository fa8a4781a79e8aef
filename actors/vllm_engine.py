"""Starting a replica's vLLM engine: the platform's limits, its arguments, its processes, and its clock for holds.

`start_engine` turns an `EngineConfig` and an `EngineSite` (`actors/engine_site.py`) into a running `AsyncLLM`;
`HoldStepper` keeps that engine stepping, slowly, while it may hold exported blocks (see `actors/lean_engine.py`).
vLLM is imported only inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from actors.engine_site import EngineSite, engine_process_env
from configs.engine import EngineConfig
from configs.models import CPU_ATTENTION_HEAD_SIZES
from kvtransfer.connector import kv_transfer_config

logger = logging.getLogger(__name__)


def check_platform_limits(config: EngineConfig, model_path: Path, device_type: str) -> None:
    """Refuse, with a message a user can act on, what this platform's attention backend cannot run."""
    if device_type != "cpu":
        return
    if config.block_size % 32:
        raise ValueError(f"block_size={config.block_size}: the CPU backend needs a multiple of 32")
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_path)
    hf = getattr(hf, "text_config", hf)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    if head_dim not in CPU_ATTENTION_HEAD_SIZES:
        raise ValueError(
            f"head size {head_dim} of {config.model!r} is not supported by vLLM's CPU attention (it has kernels for "
            f"{', '.join(map(str, CPU_ATTENTION_HEAD_SIZES))}); serve this model on a GPU, or pick another model"
        )


# CPU flags (/proc/cpuinfo) of instructions that compute bf16 natively: x86's AVX512-BF16 and AMX, Arm's BF16.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpuinfo_field(names: tuple[str, ...], cpuinfo: str | None = None) -> str | None:
    """The value of the first line of /proc/cpuinfo (or of the text `cpuinfo`) named one of `names`; None where
    there is none to read."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in names:
            return value.strip()
    return None


def cpu_flags(cpuinfo: str | None = None) -> set[str] | None:
    """The CPU's feature flags (`cpuinfo` as for `cpuinfo_field`; x86 names them "flags", Arm "Features"); None
    where there is none to read."""
    value = cpuinfo_field(("flags", "Features"), cpuinfo)
    return None if value is None else set(value.split())


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this machine's CPU computes bf16 natively (`cpuinfo` as for `cpu_flags`). True where its flags
    cannot be read: the model's recommended dtype stays."""
    flags = cpu_flags(cpuinfo)
    return flags is None or bool(NATIVE_BF16_FLAGS & flags)


def quiet_holds(config: EngineConfig, device_type: str) -> bool:
    """Whether the engine runs `QuietHoldsScheduler`: on CPU (where vLLM always schedules synchronously, which
    that Scheduler subclass assumes) whenever it exports holds."""
    nixl = config.nixl
    return device_type == "cpu" and nixl.enabled and nixl.bidirectional and nixl.hold_step_s > 0


def engine_args(
    config: EngineConfig, model_path: Path, site: EngineSite, device_type: str, native_bf16: bool = True
) -> dict[str, Any]:
    """vLLM's `AsyncEngineArgs` for this replica's engine on `device_type` ("cpu", "cuda", ...), as keyword
    arguments (pure: nothing starts, no device is needed). `native_bf16`: whether a CPU computes bf16 natively
    (`engine_dtype`)."""
    from actors.lean_engine import IN_PROCESS_EXECUTOR, QUIET_HOLDS_SCHEDULER

    events = site.events_endpoints
    cpu = device_type == "cpu"
    return {
        "model": str(model_path),
        "dtype": config.engine_dtype(not cpu or native_bf16),
        "max_model_len": config.max_model_len,
        "kv_cache_memory_bytes": config.kv_cache_memory_bytes,
        **({} if cpu else {"gpu_memory_utilization": config.gpu_memory_utilization}),
        "block_size": config.block_size,
        "enforce_eager": config.enforce_eager,
        "enable_prefix_caching": config.enable_prefix_caching,
        "kv_sharing_fast_prefill": config.fast_prefill,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "seed": config.seed,
        "kv_transfer_config": (
            kv_transfer_config(config.nixl, site.engine_id, device_type) if config.nixl.enabled else None
        ),
        "worker_extension_cls": "actors.worker_extension.KVRelayWorkerExtension",
        "distributed_executor_backend": IN_PROCESS_EXECUTOR if cpu and not config.separate_worker_process else None,
        "scheduler_cls": QUIET_HOLDS_SCHEDULER if quiet_holds(config, device_type) else None,
        "kv_events_config": (
            {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events[0], "replay_endpoint": events[1]}
            if events is not None
            else None
        ),
        # vLLM's periodic log lines off; the replica's stat logger still receives every step's stats.
        "disable_log_stats": True,
    }


def start_engine(
    config: EngineConfig, model_path: Path, site: EngineSite, device_type: str, stat_logger: Callable[..., Any]
) -> Any:
    """Start vLLM's AsyncLLM for this replica (blocks until the engine is up)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = engine_args(config, model_path, site, device_type, device_type != "cpu" or cpu_has_native_bf16())
    if config.dtype is None and args["dtype"] != config.facts.dtype:
        logger.warning("running %s in %s, not its recommended %s: this CPU has no native %s", config.model,
                       args["dtype"], config.facts.dtype, config.facts.dtype)
    with engine_process_env(site):
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**args), stat_loggers=[stat_logger])


def engine_process_ids(engine: Any) -> list[int]:
    """Pids of the engine-core processes vLLM started for this AsyncLLM (their own children not included)."""
    manager = getattr(getattr(engine.engine_core, "resources", None), "engine_manager", None)
    return [p.pid for p in getattr(manager, "processes", ()) if p.pid is not None]


def lower_engine_priority(pids: list[int], nice: int) -> None:
    """Give every thread of the engine processes `pids` (and of their children) at least the nice value `nice` (a
    lower CPU priority: any process may lower its children's). Linux keeps a nice value per thread and a new thread
    starts with its creator's, so threads the engine starts later inherit it."""
    if nice <= 0:
        return
    # Until a pass finds every thread lowered: a thread a not-yet-lowered thread started while a pass ran was not in
    # its listing, and keeps its creator's nice 0 (seen once on a loaded machine, in a thread started during start-up).
    for _ in range(20):
        lowered = 0
        for tid in engine_threads(pids):
            try:
                if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                    os.setpriority(os.PRIO_PROCESS, tid, nice)
                    lowered += 1
            except OSError:  # the thread ended meanwhile
                continue
        if not lowered:
            return


def engine_threads(pids: list[int]) -> list[int]:
    """The thread ids of the processes `pids` and of every process they started (a separate worker process is the
    engine core's child); none where there is no /proc or a process is gone. A thread that ends while it is listed
    costs only its own children's listing, not its process's (that lost a whole engine's lowering now and then: an
    engine at nice 0 beside one at 19)."""
    threads, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            try:
                todo += [int(c) for c in open(f"/proc/{pid}/task/{tid}/children").read().split()]
            except OSError:  # the thread ended meanwhile
                continue
        threads += tids
    return threads


class HoldStepper:
    """Wakes an idle engine running `QuietHoldsScheduler` now and then while it may hold exported blocks.

    The engine frees a held request's blocks (pulled, released, expired) only during a step, and with that
    scheduler an engine with nothing but holds blocks on its input queue: this is its clock. An engine with work
    steps anyway and frees them then; an idle one has nobody waiting for its blocks, so the wake-ups thin out:
    `step_s` after a hold is exported (after the wait in progress, if one is), then twice as long each time, and
    twice just after the last lease has ended (one step frees the expired, the next whatever a late notice
    released). About 6 wake-ups over a 10 s lease instead of 40 at a fixed `step_s`. Any message wakes the engine
    loop, which then steps if the scheduler says it is time. One task per replica, on its loop.
    """

    def __init__(self, engine: Any, step_s: float, hold_ttl_s: float) -> None:
        self.engine = engine
        self.step_s = step_s
        self.hold_ttl_s = hold_ttl_s
        self._lease_end = 0.0
        self._gap = step_s
        self._task: asyncio.Task | None = None

    def hold_exported(self) -> None:
        """A turn left a hold: step soon again, and until its lease has surely ended."""
        self._lease_end = max(self._lease_end, time.monotonic() + self.hold_ttl_s)
        self._gap = self.step_s
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def next_wake(self, now: float) -> float | None:
        """When to step next, counting the back-off so far (mutates it); None once every lease has ended."""
        after_lease = [t for t in (self._lease_end + self.step_s, self._lease_end + 2 * self.step_s) if t > now]
        if not after_lease:
            return None
        wake = min(now + self._gap, after_lease[0])
        self._gap *= 2
        return wake

    async def _run(self) -> None:
        while (wake := self.next_wake(time.monotonic())) is not None:
            await asyncio.sleep(max(0.0, wake - time.monotonic()))
            await self.engine.engine_core.call_utility_async("is_sleeping")

    def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.get_loop().call_soon_threadsafe(self._task.cancel)
