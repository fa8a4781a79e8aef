"""A replica whose engine is modelled (`kvtransfer/sim/engine.py`), behind the engine replica's interface.

`engine.kind: sim` deploys it in place of `EngineReplica`, so the real ingress, KV directory, mirrors and planner
run over replicas that need neither a model nor an accelerator. The modelled engine steps in real time: each step
takes the profile's modelled time times `engine.sim_dilation` (real seconds per modelled second, in the replica's
identity). Its prefix cache publishes vLLM's KV event batches, byte for byte as vLLM encodes them, on a publisher
that speaks vLLM's ZMQ protocol (`actors/sim_kv_events.py`), and the replica's directory reporter forwards them as it
does a real engine's. A finished request leaves a hold (its blocks pinned until read, released or its lease ends); a
request that pulls a hold waits the profile's transfer time, then asks the holder, through the engine pool, to free
the hold (`release_hold`), as NIXL's read notification does: a hold no longer there fails the pull, and the ingress
recomputes. Replies are a fixed English passage in the model's tokenizer.

Nothing here imports vLLM or torch (the ingress sends these replicas `ReplyParams`, not vLLM's SamplingParams): a
replica's process costs a Ray worker, not an engine's half gigabyte and seconds of imports, so a fleet of tens of
them fits on one machine. Never a stand-in for a real engine in a test of the engine path (tokens, NIXL pulls, fast
prefill, migration).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from actors.directory_reporter import DirectoryReporter
from actors.engine_site import events_endpoints, node_identity, replica_place
from actors.engine_stats import EngineStats, ReportsLoad
from actors.replica_api import (
    GenerateDelta,
    GenerateRequest,
    HoldRelease,
    InvalidRequestError,
    ReplicaIdentity,
)
from actors.sim_kv_events import EventPublisher, KVEventBatch, event_batch
from configs.engine import EngineConfig
from kvtransfer.connector import LOAD_FAILED
from kvtransfer.sim.block_cache import vllm_block_hashes
from kvtransfer.sim.engine import Hold as HeldBlocks
from kvtransfer.sim.engine import SimEngine, SimRequest
from kvtransfer.sim.profile import load_profile
from kvtransfer.types import Hold, HoldId
from model_prep.store import model_path_without_torch

logger = logging.getLogger(__name__)

# What a simulated replica answers, cycled to the reply's length: ordinary words, so every token id is one the
# model's tokenizer encodes and decodes like any other.
REPLY_PASSAGE = (
    "The river bends twice before it reaches the old mill, where the water slows and the reeds grow thick. "
    "Travellers stop there to rest, trade news of the valley, and watch the light change on the stone bridge. "
)
# Hold extra keys: which replica holds the blocks, and on which modelled node (the link a pull takes).
HOLDER_KEY, NODE_KEY = "sim_replica_id", "sim_node"


class Replies:
    """The passage's token ids in the model's tokenizer (`tokenizers`, not transformers: quick to import), and their
    text."""

    def __init__(self, model_dir: os.PathLike[str] | str) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        self._passage = self._tokenizer.encode(REPLY_PASSAGE, add_special_tokens=False).ids

    def token_ids(self, count: int) -> list[int]:
        return [self._passage[i % len(self._passage)] for i in range(count)]

    def text(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)


class SimEngineReplica(ReportsLoad):
    """One modelled engine, stepped on the replica's event loop. Methods are coroutines on that loop."""

    HEARTBEAT_S = 0.5

    def __init__(self, config: EngineConfig | dict[str, Any], directory: Any = None, log_level: str | None = None,
                 hold_key: str | None = None) -> None:
        """As `EngineReplica`: with `directory`, report identity, load and KV events to it; `hold_key` seals holds."""
        if log_level is not None:
            logger.setLevel(log_level)
        self.config = EngineConfig.model_validate(config)
        if self.config.kind != "sim" or self.config.sim_profile is None:
            raise ValueError("SimEngineReplica runs engine.kind: sim with a sim_profile")
        self._hold_key = (hold_key or secrets.token_hex(16)).encode()
        place = replica_place()
        self.replica_id, self.pool, self._app = place.replica_id, place.deployment, place.app_name
        self.node_id, self._node_ip = node_identity()
        self.engine_id = f"{self.replica_id}-{uuid.uuid4().hex[:8]}"
        self._hold_serials = itertools.count()  # this engine's holds' ids (`HoldId`), minted at export
        self.dilation = self.config.sim_dilation
        # Block size is the deployment's (the directory hashes by it); the rest is the profile's hardware.
        profile = load_profile(self.config.sim_profile).model_copy(update={"block_size": self.config.block_size})
        self.profile = profile
        # The modelled node this replica sits on (the profile's replicas per node, by rank): the link a pull takes.
        self.sim_node = place.rank // profile.replicas_per_node
        self.engine = SimEngine(self.replica_id, str(self.sim_node), profile,
                                max_held_fraction=self.config.nixl.max_held_fraction)
        self.engine.prefix_caching = self.config.enable_prefix_caching
        self.engine.on_finish = self._on_finish
        self.replies = Replies(model_path_without_torch(self.config.model))
        self.load = EngineStats()
        self._epoch = time.monotonic()
        self._work = asyncio.Event()
        self._driver: asyncio.Task[None] | None = None
        self._progress: dict[str, asyncio.Event] = {}
        self._met: set[str] = set()  # holders this engine has pulled from: the handshake is paid once
        self._reused = self._prompted = 0
        self._pool_handle: Any = None
        self._publisher = self._reporter = None
        if directory is not None and self.config.enable_prefix_caching:
            self._publisher = EventPublisher(*events_endpoints(self.engine_id))
        if directory is not None:
            self._reporter = DirectoryReporter(directory, self._identity(), self._stats_now, self.HEARTBEAT_S,
                                               events_endpoints(self.engine_id) if self._publisher else None,
                                               event_batch=KVEventBatch)
        logger.info("replica %s runs simulated engine %s (profile %s, %.3g real s per modelled s)",
                    self.replica_id, self.engine_id, profile.name, self.dilation)

    # ----------------------------------------------------------------------------- time

    def _now(self) -> float:
        """Modelled seconds since the replica started."""
        return (time.monotonic() - self._epoch) / self.dilation

    def _real(self, modelled: float) -> float:
        """The time.monotonic() instant of a modelled one."""
        return self._epoch + modelled * self.dilation

    async def _drive(self) -> None:
        """Step the engine while it has work, each step lasting its modelled time; sleep while it has none."""
        engine = self.engine
        while True:
            now = self._now()
            end = engine.next_step(now)
            if end is None:
                self._work.clear()
                await self._work.wait()
                continue
            await asyncio.sleep((end - now) * self.dilation)
            # A late wake-up (a busy loop) lengthens the step: the model runs on this replica's real clock.
            engine.finish_step(max(end, self._now()))
            events = engine.cache.take_events()
            if events and self._publisher is not None:
                self._publisher.publish(event_batch(events))
            self.load.observe_engine(len(engine.waiting), engine.cache.used_blocks / engine.cache.num_blocks,
                                     self._reused / self._prompted if self._prompted else 0.0)
            for progress in self._progress.values():
                progress.set()

    def _on_finish(self, request: SimRequest, hold: HeldBlocks | None) -> None:
        self._reused += request.reused_tokens
        self._prompted += request.prompt_len
        if hold is not None:  # its lease, in real seconds as the directory counts it
            asyncio.get_running_loop().call_later(self.config.nixl.hold_ttl_s, hold.release)

    # ----------------------------------------------------------------------------- serving

    async def generate(self, request: GenerateRequest | dict[str, Any]) -> AsyncIterator[GenerateDelta]:
        """Stream one generation as deltas; the last delta carries totals and the hold the engine left."""
        request = GenerateRequest.model_validate(request)
        prompt = request.prompt_token_ids
        if prompt is None:
            raise InvalidRequestError("a simulated replica takes prompt_token_ids, not a text prompt")
        if request.params.n != 1:
            raise InvalidRequestError(f"n={request.params.n}: a replica runs one sequence per request; send n=1")
        request.check_context(self.config.max_model_len)
        pull = request.pull
        if pull is not None and not (pull.authentic(self._hold_key) and pull.covers(prompt)):
            logger.warning("request %s names a hold not sealed for its prompt; not reading it", request.request_id)
            yield self._failed_pull()
            return
        if pull is not None and request.own_hold and pull.engine_id != self.engine_id:
            pull = None  # to stay on a holder Serve could not route to: compute here rather than pull from it
        if self._driver is None or self._driver.done():
            self._driver = asyncio.get_running_loop().create_task(self._drive())
        max_tokens = request.params.max_tokens or self.config.max_model_len - len(prompt)
        output = self.replies.token_ids(max_tokens)
        bs = self.profile.block_size
        alone, started_as = self.load.request_started()
        started = time.monotonic()
        sim = SimRequest(request.request_id, prompt, output, vllm_block_hashes(prompt + output, bs,
                                                                               request.cache_salt),
                         self._now(), cache_salt=request.cache_salt, skip_cache=request.skip_prefix_cache,
                         export_hold=(request.export_hold and self.config.nixl.enabled
                                      and self.config.nixl.bidirectional))
        progress = self._progress[request.request_id] = asyncio.Event()
        sent = 0
        try:
            if pull is not None and not request.skip_prefix_cache:
                read = await self._read(pull, sim.hashes[: len(prompt) // bs])
                if read is None:
                    yield self._failed_pull()
                    return
                sim.pulled_tokens, sim.arrival = read, self._now()
            self.engine.add(sim)
            self._work.set()
            while sim.finished_at is None:
                await progress.wait()
                progress.clear()
                if sim.generated > sent and sim.finished_at is None:
                    delta = self._delta(sim, sent)
                    # Counted before the yield: the engine steps on while the caller holds the delta (on Serve's
                    # throughput-optimized path the consumer resumes this generator a step or more later), and tokens
                    # generated meanwhile belong to the next delta.
                    sent += len(delta.token_ids)
                    yield delta
            yield self._last_delta(sim, sent, started, alone and not self.load.started_since(started_as))
        finally:
            self._progress.pop(request.request_id, None)
            self.load.request_ended()
            if sim.finished_at is None:  # the caller went away: end the reply at its next step, leave no hold
                sim.export_hold = False
                del sim.output_ids[max(sim.generated, 1):]

    def _delta(self, sim: SimRequest, sent: int) -> GenerateDelta:
        ids = sim.output_ids[sent: sim.generated]
        text = self.replies.text(sim.output_ids[: sim.generated])[len(self.replies.text(sim.output_ids[:sent])):]
        return GenerateDelta(token_ids=ids, text=text, replica_id=self.replica_id)

    def _last_delta(self, sim: SimRequest, sent: int, started: float, alone: bool) -> GenerateDelta:
        delta = self._delta(sim, sent)
        first_token_at, finished_at = self._real(sim.first_token_at or 0.0), self._real(sim.finished_at or 0.0)
        prefill_s = ((sim.first_token_at or 0.0) - (sim.prefill_started_at or 0.0)) * self.dilation
        completion = sim.generated
        delta.finished, delta.finish_reason = True, "length"
        delta.prompt_tokens, delta.completion_tokens, delta.num_cached_tokens = sim.prompt_len, completion, \
            sim.reused_tokens
        delta.prefill_s = self.load.observe_request(started, first_token_at, finished_at, prefill_s,
                                                    sim.prompt_len - sim.reused_tokens, completion, alone)
        # From the request's arrival (a pull's transfer included) to its first step, as vLLM's queued-to-scheduled.
        delta.wait_s = (sim.prefill_started_at or 0.0) * self.dilation + self._epoch - started
        delta.ran_alone = alone and sim.ran_alone
        if delta.ran_alone and completion > 1:
            delta.decode_step_s = (finished_at - first_token_at) / (completion - 1)
        held = self.engine.holds.get(sim.request_id)
        if held is not None:
            delta.hold = Hold(
                engine_id=self.engine_id, host=self._node_ip, port=0, block_ids=[[len(held.refs) + held.private]],
                num_tokens=held.num_tokens, hold_id=HoldId(self.engine_id, next(self._hold_serials)),
                request_id=sim.request_id,
                extra={HOLDER_KEY: self.replica_id, NODE_KEY: self.sim_node},
            ).sealed(self._hold_key, sim.token_ids + sim.output_ids)
        return delta

    def _failed_pull(self) -> GenerateDelta:
        return GenerateDelta(token_ids=[], text="", finished=True, finish_reason=LOAD_FAILED,
                             replica_id=self.replica_id)

    async def _read(self, hold: Hold, prompt_hashes: list[bytes]) -> int | None:
        """Read `hold`: its tokens, once their KV is here; None if the hold is gone (the pull fails).

        This engine's own hold is read in place. Another's costs the profile's transfer of the tokens not cached here
        (plus the first handshake between the two), after which its holder frees it."""
        if hold.engine_id == self.engine_id:
            held = self.engine.holds.get(hold.request_id or "")
            if held is None:
                return None
            held.release()  # its blocks stay cached, unreferenced, for this request to match at admission
            return hold.num_tokens
        cached = self.engine.cache.match(prompt_hashes) * self.profile.block_size
        ms = self.profile.pull_ms(max(0, hold.num_tokens - cached), hold.extra.get(NODE_KEY) == self.sim_node,
                                  first_contact=hold.engine_id not in self._met)
        await asyncio.sleep(ms / 1e3 * self.dilation)
        self._met.add(hold.engine_id)
        freed = await self._pool().release_hold.remote(HoldRelease(hold=hold, target_replica=hold.extra[HOLDER_KEY]))
        return hold.num_tokens if freed else None

    def _pool(self) -> Any:
        """A handle to this replica's own deployment: holds are freed on their holders through it."""
        if self._pool_handle is None:
            from ray import serve

            if self._app is None:
                raise RuntimeError("a simulated replica outside Serve cannot reach another replica's hold")
            self._pool_handle = serve.get_deployment_handle(self.pool, self._app)
        return self._pool_handle

    async def release_hold(self, release: HoldRelease | dict[str, Any]) -> bool:
        """Free a hold: this engine's own at once; another's on its holder, through the engine pool. Returns whether
        the hold was still held (a pull reads it only then)."""
        release = HoldRelease.model_validate(release)
        hold = release.hold
        if not hold.authentic(self._hold_key):
            raise InvalidRequestError("this hold was not sealed by a replica of this app; it is not released")
        if hold.engine_id == self.engine_id:
            held = self.engine.holds.get(hold.request_id or "")
            if held is not None:
                held.release()
            return held is not None
        holder = hold.extra.get(HOLDER_KEY)
        if holder is None or release.target_replica == holder:
            return False  # sent to its holder, which Serve no longer has: the hold went with it
        return await self._pool().release_hold.remote(HoldRelease(hold=hold, target_replica=holder))

    # ----------------------------------------------------------------------------- introspection

    async def identity(self) -> ReplicaIdentity:
        return self._identity()

    def _identity(self) -> ReplicaIdentity:
        return ReplicaIdentity(
            replica_id=self.replica_id, engine_id=self.engine_id, nixl_host=None, nixl_port=None, node_id=self.node_id,
            pid=os.getpid(), cpu_cores=None, model=self.config.model, fast_prefill=self.config.fast_prefill,
            block_size=self.config.block_size, time_dilation=self.dilation,
        )

    async def check_health(self) -> None:
        """Serve calls this periodically: a stepping loop that died makes the replica restart."""
        if self._driver is not None and self._driver.done() and not self._driver.cancelled():
            raise RuntimeError(f"the simulated engine stopped: {self._driver.exception()!r}")

    def __del__(self) -> None:
        """Serve calls this on scale-down and shutdown: leave the directory first, then stop publishing."""
        if getattr(self, "_reporter", None) is not None:
            self._reporter.stop()  # its last act deregisters this replica
        if getattr(self, "_publisher", None) is not None:
            self._publisher.shutdown()
            for endpoint in events_endpoints(self.engine_id):  # ZMQ leaves its ipc socket files behind
                with contextlib.suppress(OSError):
                    os.unlink(endpoint.removeprefix("ipc://"))
        driver = getattr(self, "_driver", None)
        if driver is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed already
                driver.cancel()
