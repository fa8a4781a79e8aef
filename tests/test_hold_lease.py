"""The reader's lease checks (kvtransfer/hold_lease.py) against a stand-in for vLLM's NIXL worker: the clock and
the queues those checks read. The real engines' side of it is in tests/test_pull_integrity.py."""

from __future__ import annotations

import queue
import time
from types import SimpleNamespace

from kvtransfer.hold_lease import METADATA_ATTR, LeaseGuard, lease_ends, stamp_lease

HOLDER = "holder-engine"


def worker(offset: float | None = 0.0) -> SimpleNamespace:
    """vLLM's NIXL worker as the guard sees it: the holder's clock offset once handshaken, its handshake queue."""
    return SimpleNamespace(_engine_clock_offset={} if offset is None else {HOLDER: offset},
                           _ready_requests=queue.Queue(), _recving_metadata={})


def read(awaiting: bool = True) -> SimpleNamespace:
    remote = SimpleNamespace(engine_id=HOLDER, request_id="hold-1")
    return SimpleNamespace(remote=remote, awaiting_kvs=awaiting)


def metadata(lease_end: float, **reqs: SimpleNamespace) -> SimpleNamespace:
    meta = SimpleNamespace(reqs_to_recv=dict(reqs))
    setattr(meta, METADATA_ATTR, {req_id: lease_end for req_id in reqs})
    return meta


def test_the_holder_stamps_the_end_of_its_lease_and_the_reader_finds_it():
    params = stamp_lease({"remote_engine_id": HOLDER}, 123.5)
    request = SimpleNamespace(kv_transfer_params=params)
    assert lease_ends({"r": (request, [], (), True), "other": (SimpleNamespace(kv_transfer_params=None),)}) == \
        {"r": 123.5}
    assert stamp_lease({}, None) == {}  # no hold kept, nothing stamped


def test_a_read_that_cannot_finish_within_the_lease_is_not_started_and_fails():
    guard = LeaseGuard(worker(), margin_s=1.0)
    step = metadata(time.perf_counter() + 0.5, late=read(), notice=read(awaiting=False))
    guard.admit(step)
    assert step.reqs_to_recv == {}  # vLLM's worker sees neither
    assert guard.declined == {"late"} and guard.reads_declined == 1 and guard.notices_dropped == 1


def test_a_read_in_time_starts_and_counts_only_if_it_finished_in_time():
    guard = LeaseGuard(worker(), margin_s=1.0)
    lease_end = time.perf_counter() + 1.3
    step = metadata(lease_end, ok=read(), slow=read())
    guard.admit(step)
    assert set(step.reqs_to_recv) == {"ok", "slow"} and not guard.declined
    assert guard.refuse_late({"ok"}, failed=set()) == set()
    time.sleep(0.35)  # the lease now ends within the margin: a read finishing now may have read reused blocks
    assert guard.refuse_late({"slow"}, failed=set()) == {"slow"} and guard.reads_refused == 1


def test_the_holders_clock_is_translated_with_the_handshakes_offset():
    # The holder's clock runs 100 s ahead of the reader's: its lease end, 2 s from now, reads 102 s ahead.
    guard = LeaseGuard(worker(offset=100.0), margin_s=1.0)
    step = metadata(time.perf_counter() + 102.0, r=read())
    guard.admit(step)
    assert "r" in step.reqs_to_recv
    # Read in the reader's own clock this lease would end in 2 s; in the holder's it ended 98 s ago.
    step = metadata(time.perf_counter() + 2.0, r=read())
    guard = LeaseGuard(worker(offset=100.0), margin_s=1.0)
    guard.admit(step)
    assert step.reqs_to_recv == {} and guard.declined == {"r"}


def test_a_read_waiting_for_its_handshake_is_checked_when_the_handshake_is_done():
    w = worker(offset=None)
    guard = LeaseGuard(w, margin_s=1.0)
    lease_end = time.perf_counter() + 1.2
    waiting, fresh = read(), read()
    guard.admit(metadata(lease_end, waiting=waiting))  # no offset yet: vLLM handshakes first, then reads
    guard.admit(metadata(time.perf_counter() + 60, fresh=fresh))
    w._engine_clock_offset[HOLDER] = 0.0
    w._ready_requests.put(("waiting", waiting))
    w._ready_requests.put(("fresh", fresh))
    w._recving_metadata.update(waiting=waiting, fresh=fresh)
    time.sleep(0.3)  # the handshake took long: the first read can no longer finish in time
    guard.admit(metadata(0.0))
    assert [w._ready_requests.get_nowait()[0]] == ["fresh"] and w._ready_requests.empty()
    assert guard.declined == {"waiting"} and "waiting" not in w._recving_metadata


def test_a_read_that_failed_anyway_is_not_counted_as_refused():
    guard = LeaseGuard(worker(), margin_s=1.0)
    guard.admit(metadata(time.perf_counter() + 1.05, r=read()))
    time.sleep(0.1)
    assert guard.refuse_late({"r"}, failed={"r"}) == set() and guard.reads_refused == 0
