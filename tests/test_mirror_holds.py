"""One id for a hold, from the replica's export to every mirror: the directory actor, its change feed and each
ingress's mirror name a hold by the `HoldId` its replica minted, whatever order the actor's answers and the feed
reach a mirror in.

The actor runs in this event loop (no Ray), called as a Ray handle is (`handle.method.remote(...)`), and each
mirror applies the feed only when a test says so: the orders seen on a loaded machine are staged exactly.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from actors.kv_directory import KVDirectoryActor
from app.directory_mirror import DirectoryMirror
from kvtransfer.directory_index.changes import Changes
from kvtransfer.types import Hold
from tests.conftest import make_hold
from tests.test_kv_directory_actor import BS, far_future, key


class InProcess:
    """A directory actor's methods as `handle.method.remote(...)`. `record_hold` answers only once `answer` is set
    (set at first), and records only once `record` is set: a test holds either back."""

    def __init__(self, actor: KVDirectoryActor) -> None:
        self.actor = actor
        self.record, self.answer = asyncio.Event(), asyncio.Event()
        self.record.set()
        self.answer.set()

    def __getattr__(self, name: str) -> Any:
        return SimpleNamespace(remote=getattr(self.actor, name))

    @property
    def record_hold(self) -> Any:
        async def remote(*args: Any, **kwargs: Any) -> Any:
            await self.record.wait()
            result = await self.actor.record_hold(*args, **kwargs)
            await self.answer.wait()
            return result

        return SimpleNamespace(remote=remote)


async def catch_up(mirror: DirectoryMirror, actor: KVDirectoryActor, updates: int | None = None) -> None:
    """Apply the actor's feed to `mirror` (only its next `updates` updates, if given), as `follow` would."""
    changes = await actor.changes(mirror.epoch, mirror.seq, 0.0)
    snapshot = None
    if changes.snapshot_parts:
        snapshot = b"".join([await actor.snapshot_part(changes.epoch, changes.seq, i)
                             for i in range(changes.snapshot_parts)])
    elif updates is not None:
        changes = Changes(changes.epoch, mirror.seq + updates, changes.updates[:updates])
    mirror.apply(changes, snapshot)


def offered(mirror: DirectoryMirror, tokens: range, replica: str = "r1") -> Hold | None:
    match = mirror.lookup(key(tokens)).get(replica)
    return match.hold.hold if match is not None and match.hold is not None else None


async def started(*mirrors: DirectoryMirror) -> None:
    for mirror in mirrors:
        await catch_up(mirror, mirror.directory.actor)


def test_a_hold_recorded_through_one_mirror_is_taken_through_another_by_the_id_its_replica_minted() -> None:
    async def scenario() -> None:
        actor = KVDirectoryActor(block_size=BS)
        one, other = DirectoryMirror(InProcess(actor), BS), DirectoryMirror(InProcess(actor), BS)
        await started(one, other)
        # The other ingress recorded holds of its own first: no directory copy numbers holds of its own any more.
        for n in (8, 12):
            await other.record_hold("r2", key(range(100, 100 + n)), make_hold(n, "e2"), far_future())
        hold, later = make_hold(16, "e1"), make_hold(20, "e1")
        await one.record_hold("r1", key(range(16)), hold, far_future())
        await one.record_hold("r1", key(range(50, 70)), later, far_future())
        await catch_up(other, actor)
        await catch_up(one, actor)
        # Every copy offers the hold under the id its replica minted.
        at_actor = (await actor.lookup(key(range(16)))).get("r1").hold
        assert at_actor.hold_id == hold.hold_id
        assert offered(one, range(16)) == offered(other, range(16)) == hold
        # Taken through the other mirror by that id: once, and the mirror it was recorded through forgets it.
        assert await other.consume_hold(hold.hold_id) == hold
        assert await other.consume_hold(hold.hold_id) is None
        await catch_up(one, actor)
        assert offered(one, range(16)) is None
        assert await one.consume_hold(hold.hold_id) is None
        assert await one.consume_hold(later.hold_id) == later
        for mirror in (one, other):
            mirror._copy.check_integrity()

    asyncio.run(scenario())


def test_a_hold_the_feed_brings_before_the_actors_answer_is_kept_once() -> None:
    async def scenario() -> None:
        actor = KVDirectoryActor(block_size=BS)
        directory = InProcess(actor)
        mirror = DirectoryMirror(directory, BS)
        await started(mirror)
        directory.answer.clear()  # a loaded machine: the answer comes after the feed
        hold = make_hold(16)
        recorded = mirror.record_hold("r1", key(range(16)), hold, far_future())
        await asyncio.sleep(0.01)  # the actor records it now
        await catch_up(mirror, actor)
        assert mirror.stats()["holds"] == 1 and offered(mirror, range(16)) == hold
        taking = asyncio.ensure_future(mirror.consume_hold(hold.hold_id))  # planned before the answer: it waits
        await asyncio.sleep(0.01)
        assert not taking.done()
        directory.answer.set()
        await recorded
        assert await taking == hold
        assert offered(mirror, range(16)) is None and (await actor.lookup(key(range(16)))).matches == ()
        mirror._copy.check_integrity()

    asyncio.run(scenario())


def test_a_pending_hold_survives_a_snapshot_taken_before_the_actor_recorded_it() -> None:
    async def scenario() -> None:
        actor = KVDirectoryActor(block_size=BS)
        directory = InProcess(actor)
        mirror = DirectoryMirror(directory, BS)
        await started(mirror)
        directory.record.clear()
        hold = make_hold(16)
        recorded = mirror.record_hold("r1", key(range(16)), hold, far_future())
        # The mirror starts over from a snapshot (it fell behind the log) that the hold is not in yet.
        snapshot = await actor.changes(None, 0, 0.0)
        parts = [await actor.snapshot_part(snapshot.epoch, snapshot.seq, i) for i in range(snapshot.snapshot_parts)]
        mirror.apply(snapshot, b"".join(parts))
        assert offered(mirror, range(16)) is None
        directory.record.set()
        await recorded
        # Kept by the actor: this copy follows the answer, and the feed's copy of it changes nothing.
        assert offered(mirror, range(16)) == hold
        await catch_up(mirror, actor)
        assert mirror.stats()["holds"] == 1
        assert await mirror.consume_hold(hold.hold_id) == hold

    asyncio.run(scenario())


def test_a_late_copy_of_a_taken_hold_and_a_refused_hold_are_never_offered() -> None:
    async def scenario() -> None:
        actor = KVDirectoryActor(block_size=BS)
        mirror = DirectoryMirror(InProcess(actor), BS)
        await started(mirror)
        hold = make_hold(16)
        await mirror.record_hold("r1", key(range(16)), hold, far_future())
        assert await mirror.consume_hold(hold.hold_id) == hold
        # The feed's record of the hold reaches the mirror after it took the hold (its "consume" comes later).
        await catch_up(mirror, actor, updates=1)
        assert offered(mirror, range(16)) is None
        await catch_up(mirror, actor)
        # A hold of a replica that has left is refused by the actor, and the mirror drops its own record of it.
        await actor.deregister("r1")
        refused = make_hold(20)
        answered = mirror.record_hold("r1", key(range(20)), refused, far_future())
        assert offered(mirror, range(20)) == refused  # offered here at once, before the actor answers
        await answered
        assert offered(mirror, range(20)) is None and mirror.stats()["holds"] == 0
        assert await mirror.consume_hold(refused.hold_id) is None
        mirror._copy.check_integrity()

    asyncio.run(scenario())

