"""An ingress's mirror of the KV directory: it follows a real directory actor through its change feed, answers
lookups without a remote call, hands out a hold only once and only if the actor still has that very hold, and
starts over from a snapshot when the directory restarts."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from actors.replica_api import ReplicaIdentity, ReplicaStats
from app.directory_mirror import DirectoryMirror
from kvtransfer.directory_index.changes import Changes
from kvtransfer.directory_index.results import StoreResident
from tests.conftest import make_hold
from tests.test_kv_directory_actor import BS, key


def identity(replica_id: str) -> ReplicaIdentity:
    return ReplicaIdentity(replica_id=replica_id, engine_id=f"e-{replica_id}", nixl_host=None, nixl_port=None,
                           node_id="n", pid=1, cpu_cores=None, model="m", fast_prefill=False, block_size=BS)


def stats(replica_id: str) -> ReplicaStats:
    return ReplicaStats(replica_id=replica_id, at=time.time(), running=0, waiting=0, kv_cache_usage=0.0,
                        prefix_cache_hit_rate=0.0, prefill_tok_s=None, decode_tok_s=None, requests_finished=0)


async def until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "the mirror did not catch up"
        await asyncio.sleep(0.02)


def test_the_mirror_sees_what_others_record_and_plans_locally(directory: Any) -> None:
    conv = key(range(16))

    async def scenario() -> None:
        mirror = DirectoryMirror(directory, BS)
        mirror.start()
        await until(lambda: mirror.epoch is not None, timeout_s=30)
        # Updates arrive through the actor, from replicas (heartbeats, cache events) and other ingresses (holds).
        await directory.heartbeat.remote(identity("r1"), stats("r1"))
        await directory.heartbeat.remote(identity("r2"), stats("r2"))
        await directory.record_hold.remote("r1", conv, make_hold(16), time.time() + 3600, prompt_tokens=13)
        await directory.apply_resident.remote("r2", [StoreResident(None, conv.block_hashes[:2])])
        await until(lambda: len(mirror.lookup(conv.extend([9])).matches) == 2)
        assert [r.replica_id for r in mirror.live()] == ["r1", "r2"]
        assert mirror.stats()["lag_ms"]["samples"] >= 1  # the feed says when the actor logged what it brings
        local = mirror.lookup(conv.extend([9]))
        assert local.get("r1").hold.num_tokens == 16 and local.get("r2").cached_tokens == 8
        remote = await directory.lookup.remote(conv.extend([9]))

        def shape(result):  # a hold has one id in every copy: the one its replica minted
            return [(m.replica_id, m.kind, m.num_tokens, m.cached_tokens, m.hold and m.hold.hold_id)
                    for m in result.matches]

        assert shape(local) == shape(remote)
        # The hold's turn had a 13-token prompt: a next turn whose reply tokens came back different continues it.
        assert mirror.continues(key([*range(12), 99, 98, 97, 96, 5]))
        assert not mirror.continues(key([*range(4), 99, *range(5, 16)]))

        # A replica that leaves takes its holdings with it, in the mirror too.
        await directory.deregister.remote("r2")
        await until(lambda: mirror.lookup(conv).get("r2") is None)
        assert [r.replica_id for r in mirror.live()] == ["r1"]

    asyncio.run(scenario())


def test_the_mirror_reports_how_far_behind_the_actor_it_applies_updates() -> None:
    mirror = DirectoryMirror(None, BS)
    assert mirror.stats()["lag_ms"] is None
    mirror.apply(Changes("epoch", 1, [("leave", "r1")], first_at=time.time() - 0.25))
    mirror.apply(Changes("epoch", 1, []))  # an idle poll's empty answer is no sample
    lag = mirror.stats()["lag_ms"]
    assert lag["samples"] == 1 and 250 <= lag["p50"] < 5_000


def test_a_hold_is_handed_out_once_across_mirrors(directory: Any) -> None:
    conv = key(range(12))
    hold = make_hold(12)

    async def scenario() -> None:
        mirrors = [DirectoryMirror(directory, BS) for _ in range(2)]
        for m in mirrors:
            m.start()
        await until(lambda: all(m.epoch is not None for m in mirrors), timeout_s=30)
        # One ingress records its turn's hold; it sees it at once, the other through the feed.
        recorded = mirrors[0].record_hold("r1", conv, hold, time.time() + 3600)
        assert mirrors[0].lookup(conv).get("r1").hold is not None  # before the actor has answered
        await recorded
        await until(lambda: mirrors[1].lookup(conv).get("r1") is not None)
        offers = [m.lookup(conv).get("r1").hold for m in mirrors]
        got = await asyncio.gather(*(m.consume_hold(o.hold_id) for m, o in zip(mirrors, offers, strict=True)))
        assert sorted(g is not None for g in got) == [False, True]
        assert next(g for g in got if g is not None) == hold
        # Both copies forget it: neither offers it again.
        await until(lambda: all(m.lookup(conv).get("r1") is None for m in mirrors))

    asyncio.run(scenario())


def test_a_hold_taken_before_the_directory_answered_is_still_handed_out_once(directory: Any) -> None:
    conv = key(range(20))
    hold = make_hold(20)

    async def scenario() -> None:
        mirror = DirectoryMirror(directory, BS)
        mirror.start()
        await until(lambda: mirror.epoch is not None, timeout_s=30)
        # The next turn may plan a pull before the actor has recorded the hold: taking it waits for that answer.
        mirror.record_hold("r1", conv, hold, time.time() + 3600)
        offer = mirror.lookup(conv).get("r1").hold
        assert await mirror.consume_hold(offer.hold_id) == hold
        assert await mirror.consume_hold(offer.hold_id) is None
        at_actor = (await directory.lookup.remote(conv)).get("r1")
        assert at_actor is None or at_actor.hold is None  # the actor handed it out, once

    asyncio.run(scenario())


class SlowAnswers:
    """The real directory actor, with its answers to `record_hold` held back a second, as on a loaded machine:
    the change feed then brings the hold to the mirror before the answer does. (Only the timing is staged.)"""

    def __init__(self, actor: Any) -> None:
        self._actor = actor

    def __getattr__(self, name: str) -> Any:
        return getattr(self._actor, name)

    @property
    def record_hold(self) -> Any:
        actor = self._actor

        class Delayed:
            async def remote(self, *args: Any, **kwargs: Any) -> Any:
                answer = await actor.record_hold.remote(*args, **kwargs)
                await asyncio.sleep(1.0)
                return answer

        return Delayed()


def test_a_hold_planned_before_the_feed_and_the_answer_arrive_is_still_pulled(directory: Any) -> None:
    conv = key(range(24))
    hold = make_hold(24)

    async def scenario() -> None:
        mirror = DirectoryMirror(SlowAnswers(directory), BS)
        mirror.start()
        await until(lambda: mirror.epoch is not None, timeout_s=30)
        mirror.record_hold("r1", conv, hold, time.time() + 3600)
        offer = mirror.lookup(conv).get("r1").hold  # the next turn plans its pull now
        assert await mirror.consume_hold(offer.hold_id) == hold
        # One copy of the hold was kept, and it is gone now.
        assert mirror.lookup(conv).get("r1") is None or mirror.lookup(conv).get("r1").hold is None

    asyncio.run(scenario())


def test_a_mirror_resyncs_after_the_directory_restarts(ray_cluster: Any, directory: Any) -> None:
    import ray

    conv = key(range(8))

    async def scenario() -> None:
        mirror = DirectoryMirror(directory, BS)
        mirror.start()
        await until(lambda: mirror.epoch is not None, timeout_s=30)
        await directory.record_hold.remote("r1", conv, make_hold(8), time.time() + 3600)
        await until(lambda: mirror.lookup(conv).get("r1") is not None)
        epoch = mirror.epoch
        ray.kill(directory, no_restart=False)
        # The restarted directory is empty: the mirror must drop what it had, not keep offering it.
        await until(lambda: mirror.epoch not in (None, epoch), timeout_s=60)
        assert mirror.lookup(conv).matches == ()
        assert mirror.resyncs == 2
        await directory.record_hold.remote("r2", conv, make_hold(8, "e2"), time.time() + 3600)
        await until(lambda: mirror.lookup(conv).get("r2") is not None)

    asyncio.run(scenario())


def test_the_feed_brings_each_replica_s_latest_report_once_and_none_for_a_replica_gone() -> None:
    from actors.kv_directory import KVDirectoryActor

    async def scenario() -> None:
        actor = KVDirectoryActor(block_size=BS)
        first = await actor.changes(None, 0, 0.0)  # a new mirror starts from a snapshot
        for running in (1, 2, 3):
            await actor.heartbeat(identity("r1"), stats("r1").model_copy(update={"running": running}))
        await actor.heartbeat(identity("r2"), stats("r2"))
        await actor.deregister("r2")
        answer = await actor.changes(first.epoch, first.seq, 0.0)
        assert answer.seq == first.seq + 5  # every update counts, however the answer carries it
        assert [(u[0], u[1].replica_id, u[2].running) if u[0] == "beat" else u for u in answer.updates] == [
            ("beat", "r1", 3), ("leave", "r2")]
        mirror = DirectoryMirror(None, BS)
        mirror.apply(first)
        mirror.apply(answer)
        assert [(r.replica_id, r.running) for r in mirror.live()] == [("r1", 3)]

    asyncio.run(scenario())
