"""A simulated replica's KV events without vLLM (`actors/sim_kv_events.py`): the bytes vLLM's own classes encode, and
the directory reporter's forwarder reading them from its publisher, replay included. No Ray, no engine."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import msgspec

from actors.kv_events import KVEventForwarder, ResidentTracker
from actors.sim_kv_events import EventPublisher, KVEventBatch, event_batch
from kvtransfer.directory_index.results import ResidentOp, ResidentResult, StoreResident
from kvtransfer.sim.block_cache import BlockRemoved, BlockStored, external_block_hash, vllm_block_hashes

REPO_ROOT = Path(__file__).resolve().parents[1]
BS = 16


def cache_events(salt: str | None = None) -> list[BlockStored | BlockRemoved]:
    """A step's events as the modelled cache records them: two blocks stored (the first salted), one evicted."""
    hashes = [external_block_hash(h) for h in vllm_block_hashes(list(range(40)), BS, salt)]
    stored = BlockStored(hashes, None, list(range(32)), BS, extra_keys=[("salt-a",), None] if salt else None)
    return [stored, BlockRemoved([hashes[0]])]


def test_a_simulated_batch_is_the_bytes_vllm_encodes_and_each_side_decodes_the_other() -> None:
    from vllm.distributed.kv_events import BlockRemoved as VllmRemoved
    from vllm.distributed.kv_events import BlockStored as VllmStored
    from vllm.distributed.kv_events import KVEventBatch as VllmBatch

    ours = event_batch(cache_events("salt-a"))
    ours.data_parallel_rank = 0
    theirs = VllmBatch(ts=ours.ts, data_parallel_rank=0, events=[
        VllmStored(**e._asdict(), lora_name=None) if isinstance(e, BlockStored) else VllmRemoved(**e._asdict())
        for e in cache_events("salt-a")
    ])
    encoded = msgspec.msgpack.encode(ours)
    assert encoded == msgspec.msgpack.encode(theirs)
    assert msgspec.to_builtins(msgspec.msgpack.Decoder(VllmBatch).decode(encoded)) == msgspec.to_builtins(ours)
    assert msgspec.to_builtins(msgspec.msgpack.Decoder(KVEventBatch).decode(encoded)) == msgspec.to_builtins(theirs)


def test_the_simulated_replica_imports_neither_vllm_nor_torch() -> None:
    probe = ("import sys, actors.sim_engine_replica; "
             "print(sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'torch', 'transformers'}))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_reporters_forwarder_reads_the_publisher_and_replays_what_it_missed() -> None:
    async def run() -> list[ResidentOp]:
        base = Path(tempfile.gettempdir()) / f"kvr-sim-events-{uuid.uuid4().hex[:8]}"
        publish, replay = f"ipc://{base}.pub", f"ipc://{base}.replay"
        publisher = EventPublisher(publish, replay)
        sent: list[ResidentOp] = []

        async def send(replica_id: str, ops: list[ResidentOp]) -> ResidentResult:
            sent.extend(ops)
            return ResidentResult(len(ops), 0, 0, "epoch")

        # Published before anyone subscribed: only the replay socket can tell it.
        publisher.publish(event_batch(cache_events()[:1]))
        forwarder = KVEventForwarder("r1", publish, ResidentTracker("m", BS), send, replay_endpoint=replay,
                                     batch_type=KVEventBatch)
        forwarder.start()
        try:
            for _ in range(200):
                if sent:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # the subscription settles
            publisher.publish(event_batch(cache_events()[1:]))
            for _ in range(200):
                if len(sent) > 1:
                    break
                await asyncio.sleep(0.01)
        finally:
            await forwarder.stop()
            publisher.shutdown()
            for endpoint in (publish, replay):
                Path(endpoint.removeprefix("ipc://")).unlink(missing_ok=True)
        assert forwarder.stats().replayed_batches == 1
        return sent

    ops = asyncio.run(run())
    assert [type(op).__name__ for op in ops] == ["StoreResident", "RemoveResident"]
    stored = ops[0]
    assert isinstance(stored, StoreResident) and len(stored.hashes) == 2
