"""A modelled engine's KV events as vLLM publishes them, without importing vLLM (which brings torch).

`KVEventBatch`, `BlockStored`, `BlockRemoved` and `AllBlocksCleared` are msgspec structs with vLLM 0.32's fields in
vLLM's order and its struct options (`vllm/distributed/kv_events.py`): a batch encodes to the bytes vLLM's own
classes encode, and either side's decoder reads the other's (`tests/test_sim_kv_events.py` checks both ways).
`EventPublisher` sends them as vLLM's `ZmqEventPublisher` does: (topic, 8-byte big-endian sequence, payload) on a PUB
socket, with the recent batches replayed on request from a ROUTER socket, so the replica's directory reporter
(`actors/kv_events.py`) reads a simulated replica exactly as it reads a vLLM engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvtransfer.sim.block_cache import BlockRemoved as CacheRemoved
from kvtransfer.sim.block_cache import BlockStored as CacheStored

# A block hash as vLLM's events carry it: an int (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, the default) or bytes.
ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base of the events; the tag is the class name, as vLLM's."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def event_batch(events: Sequence[CacheStored | CacheRemoved]) -> KVEventBatch:
    """The modelled cache's events as the batch a vLLM engine publishes after a step."""
    return KVEventBatch(ts=time.time(), events=[
        BlockStored(**e._asdict(), lora_name=None) if isinstance(e, CacheStored) else BlockRemoved(**e._asdict())
        for e in events
    ])


class EventPublisher:
    """Publishes batches on `endpoint` and replays the latest `buffer_steps` of them on `replay_endpoint` (both bound
    here). Call `publish` on the replica's event loop (it does not block): replays are served on that loop from the
    first call on; a subscriber asking before then waits its replay timeout and reads on."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, endpoint: str, replay_endpoint: str, buffer_steps: int = 10_000, topic: str = "",
                 hwm: int = 100_000) -> None:
        self._pub = zmq.Context.instance().socket(zmq.PUB)  # sync: a full queue raises zmq.Again at once
        self._pub.set_hwm(hwm)
        self._pub.bind(endpoint)
        self._replay = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self._replay.bind(replay_endpoint)
        self._topic = topic.encode()
        self._encoder = msgspec.msgpack.Encoder()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._replayer: asyncio.Task[None] | None = None

    def publish(self, batch: KVEventBatch) -> None:
        if self._replayer is None:
            self._replayer = asyncio.get_running_loop().create_task(self._serve_replays())
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = 0
        payload, seq = self._encoder.encode(batch), self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        # A PUB socket drops what a slow subscriber cannot take (beyond the high-water mark); replay fills the gap.
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)

    async def _serve_replays(self) -> None:
        while True:
            frame = await self._replay.recv_multipart()
            if len(frame) != 3:
                continue
            client, _, start = frame
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            await self._replay.send_multipart((client, b"", b"", self.END_SEQ, b""))

    def shutdown(self) -> None:
        if self._replayer is not None:
            self._replayer.cancel()
        self._pub.close(linger=0)
        self._replay.close(linger=0)
