"""The KV directory as a Ray actor: concurrent callers, single-use holds, restart."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from kvtransfer.directory_index.results import ClearResident, DirectoryStats, ResidentResult, StoreResident
from kvtransfer.prefix_key import PrefixKey, Scope
from kvtransfer.types import LookupResult
from tests.conftest import DIRECTORY_BLOCK_SIZE, make_hold

T = TypeVar("T")
SCOPE = Scope("m", "tenant-a")
BS = DIRECTORY_BLOCK_SIZE


def key(tokens: list[int] | range) -> PrefixKey:
    return PrefixKey.build(tokens, SCOPE, BS)


def far_future() -> float:
    return time.time() + 3600


async def retry(call: Callable[[], Awaitable[T]], timeout_s: float = 60.0) -> T:
    """Retry a call while the actor is restarting (in-flight calls fail fast: no task retries)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await call()
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


def test_record_lookup_consume_through_ray(directory: Any) -> None:
    async def scenario() -> None:
        history = key(range(10))
        held = make_hold(10, "e1")
        assert (await directory.record_hold.remote("r1", history, held, far_future())).kept
        result = await directory.lookup.remote(history.extend([1, 2, 3]))
        assert isinstance(result, LookupResult)
        best = result.best()
        assert best is not None and best.kind == "hold" and best.num_tokens == 10
        # Raw token ids work too (the actor hashes them).
        raw = await directory.lookup.remote(list(range(10)), SCOPE)
        assert raw.best() == best
        assert best.hold.hold_id == held.hold_id  # the id its replica minted
        assert await directory.consume_hold.remote(held.hold_id) == held
        assert await directory.consume_hold.remote(held.hold_id) is None
        stats = await directory.stats.remote()
        assert isinstance(stats, DirectoryStats) and stats.holds == 0 and stats.lookups == 2
        await directory.check_integrity.remote()

    asyncio.run(scenario())


def test_many_concurrent_callers(directory: Any) -> None:
    conversations = [key([c] * 4 + list(range(c, c + 20))) for c in range(60)]

    async def scenario() -> None:
        # Records, lookups and resident updates from many callers at once, interleaved.
        calls: list[Awaitable[Any]] = []
        for c, conv in enumerate(conversations):
            calls.append(directory.record_hold.remote(f"r{c % 4}", conv, make_hold(24, f"e{c}"), far_future()))
            calls.append(directory.lookup.remote(conv.extend([7])))
            calls.append(directory.apply_resident.remote(f"r{(c + 1) % 4}", [StoreResident(None, conv.block_hashes)]))
        await asyncio.gather(*calls)
        results = await asyncio.gather(*(directory.lookup.remote(conv.extend([7])) for conv in conversations))
        for c, result in enumerate(results):
            by_replica = {m.replica_id: m for m in result.matches}
            assert by_replica[f"r{c % 4}"].kind == "hold" and by_replica[f"r{c % 4}"].num_tokens == 24
            assert by_replica[f"r{(c + 1) % 4}"].cached_tokens == 24
        await directory.check_integrity.remote()

        # A hold is consumed exactly once however many planners race for it.
        hold = results[0].matches[0].hold if results[0].matches[0].hold else results[0].matches[1].hold
        assert hold is not None
        got = await asyncio.gather(*(directory.consume_hold.remote(hold.hold_id) for _ in range(50)))
        assert sum(g is not None for g in got) == 1

    asyncio.run(scenario())


def test_restart_comes_back_empty_and_replicas_re_report(ray_cluster: Any, directory: Any) -> None:
    import ray

    conv = key(range(16))

    async def scenario() -> None:
        before = await directory.stats.remote()
        await directory.record_hold.remote("r1", conv, make_hold(16), far_future())
        await directory.apply_resident.remote("r2", [StoreResident(None, conv.block_hashes)])
        assert len((await directory.lookup.remote(conv)).matches) == 2

        ray.kill(directory, no_restart=False)
        after = await retry(lambda: directory.stats.remote())
        deadline = time.monotonic() + 60
        while after.epoch == before.epoch:  # the kill lands asynchronously; calls may still reach the old one
            assert time.monotonic() < deadline, "the directory actor did not come back"
            await asyncio.sleep(0.2)
            after = await retry(lambda: directory.stats.remote())
        assert after.entries == 0 and after.holds == 0
        assert (await directory.lookup.remote(conv)).matches == ()

        # A forwarder notices the new epoch in the reply and re-reports its replica's whole cache.
        snapshot = [ClearResident(), StoreResident(None, conv.block_hashes)]
        reply = await directory.apply_resident.remote("r2", snapshot)
        assert isinstance(reply, ResidentResult) and reply.epoch == after.epoch and reply.stored == 4
        best = (await directory.lookup.remote(conv)).best()
        assert best is not None and best.replica_id == "r2" and best.cached_tokens == 16
        await directory.check_integrity.remote()

    asyncio.run(scenario())


def test_a_replica_that_left_gets_no_new_hold_until_it_reports_again(directory: Any) -> None:
    """A turn that ends on a replica after it deregistered (scale-down drains it) records a hold the directory must
    not offer: a pull from it would fail. A heartbeat (a replica deregistered after one failed pull lives on)
    makes it a holder again; the stats count how each replica left."""
    from tests.test_directory_mirror import identity, stats

    async def scenario() -> None:
        await directory.heartbeat.remote(identity("r1"), stats("r1"))
        assert (await directory.record_hold.remote("r1", key(range(16)), make_hold(16, "e1"), far_future())).kept
        await directory.deregister.remote("r1")
        late = await directory.record_hold.remote("r1", key(range(32)), make_hold(32, "e1"), far_future())
        assert not late.kept
        figures = await directory.stats.remote()
        assert figures.holds == 0 and figures.holds_by_replica == {}
        assert (figures.replicas_left, figures.replicas_silent) == (1, 0)
        await directory.heartbeat.remote(identity("r1"), stats("r1"))
        again = await directory.record_hold.remote("r1", key(range(32)), make_hold(32, "e1"), far_future())
        assert again.kept
        assert (await directory.stats.remote()).holds_by_replica == {"r1": 1}

    asyncio.run(scenario())
