"""A pulled KV is used only when it is provably the holder's: read inside the hold's lease, and (verification on)
byte for byte what the holder held. Two engine replicas in this process, reading each other's holds over NIXL.

The lease: a holder frees a hold's blocks once its lease ends, read or not, and a busy holder hands them to other
requests at once; a reader queued behind a long prefill could start, or finish, its read after that. Such a read is
not made (or, finished too late, refused), and a release that would arrive after the lease is not sent: its late
notice is what vLLM logs as "Potentially invalid KV blocks for unrecognized request" (kvtransfer/hold_lease.py).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import replace

import httpx
import pytest

from actors.engine_replica import EngineReplica
from actors.replica_api import HoldRelease
from configs.engine import EngineConfig, NixlSettings
from kvtransfer.kv_digest import DIGESTS_KEY
from tests.test_turns import KEY, converse, first_turn, generate

LEASE_S = 4.0
MARGIN_S = 1.0
INVALID_READ = "Potentially invalid KV blocks"


def replica(core: int) -> EngineReplica:
    return EngineReplica(EngineConfig(
        model="tiny-llama", dtype="float32", max_model_len=1024, kv_cache_memory_bytes=64 * 1024**2,
        nixl=NixlSettings(hold_ttl_s=LEASE_S, lease_margin_s=MARGIN_S, verify_pulls=True), cpu_core_offset=core),
        hold_key=KEY)


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[EngineReplica, EngineReplica]]:
    """A holder and a puller, shared by this module's tests (each its own holds)."""
    holder, puller = replica(0), replica(1)
    try:
        yield holder, puller
    finally:
        holder.engine.shutdown()
        puller.engine.shutdown()


def tokens(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def test_a_pull_reads_its_holders_very_bytes_and_one_that_differs_is_refused(loop_thread, pair):
    holder, puller = pair
    rng = random.Random("verified pulls")
    hold, _, follow_up = first_turn(loop_thread, holder, rng, 200)
    digests = hold.extra[DIGESTS_KEY]
    assert digests and all(region for region in digests[0]), "the holder took a digest of every block"
    pulled = generate(loop_thread, puller, follow_up, pull=hold)
    assert pulled[-1].read_check == "verified" and pulled[-1].num_cached_tokens == hold.num_tokens
    # Every token was streamed before the verdict and the new hold's digests were collected from the engine: the
    # finishing delta carries only them (a one-token turn's first token waits for neither).
    assert tokens(pulled[:-1]) and not tokens(pulled[-1:]) and pulled[-1].hold is not None
    scratch = generate(loop_thread, puller, follow_up, own_kv_only=True)
    assert tokens(pulled) == tokens(scratch)

    # The same check on a read whose bytes are not what the holder recorded (its digests altered and the hold
    # sealed again with the app's key: a stand-in for blocks reused under a reader): refused before any use.
    other, _, follow_other = first_turn(loop_thread, holder, rng, 200)
    tampered = [[[[block, crc ^ 1] for block, crc in region] for region in rank]
                for rank in other.extra[DIGESTS_KEY]]
    forged = replace(other, extra={**other.extra, DIGESTS_KEY: tampered}, seal=None)
    forged = forged.sealed(KEY.encode(), follow_other)
    refused = generate(loop_thread, puller, follow_other, pull=forged)
    assert refused[-1].finish_reason == "error" and not tokens(refused)
    assert refused[-1].read_check == "refused: digest"


def test_no_read_or_release_of_a_hold_whose_lease_ends_first_and_no_error_logged(loop_thread, pair, capfd):
    holder, puller = pair
    counted = loop_thread.run(puller.engine.collective_rpc("kvrelay_lease_counts"))[0]
    rng = random.Random("lease races")
    late, _, follow_late = first_turn(loop_thread, holder, rng, 200)
    released, _, _ = first_turn(loop_thread, holder, rng, 200)
    handshake, _, follow_handshake = first_turn(loop_thread, holder, rng, 64)
    assert generate(loop_thread, puller, follow_handshake, pull=handshake)[-1].read_check == "verified"

    # Less than the margin left: the read could not be sure to finish before the holder frees the blocks.
    time.sleep(LEASE_S - MARGIN_S + 0.3)
    declined = generate(loop_thread, puller, follow_late, pull=late)
    assert declined[-1].finish_reason == "error" and declined[-1].read_check == "refused: lease"

    # The lease over, a release through the puller: no notice goes out, and the holder (stepping for a request
    # of its own) has nothing unrecognized to log.
    time.sleep(MARGIN_S + 0.5)
    loop_thread.run(puller.release_hold(HoldRelease(hold=released, target_replica=puller.replica_id)))
    time.sleep(0.5)
    generate(loop_thread, holder, [7] * 40)
    counts = loop_thread.run(puller.engine.collective_rpc("kvrelay_lease_counts"))[0]
    assert {name: n - counted[name] for name, n in counts.items()} == {
        "reads_declined": 1, "reads_refused": 0, "notices_dropped": 1}
    assert INVALID_READ not in "".join(capfd.readouterr())


def test_the_apps_pulls_are_verified_and_counted(tiny_app):
    """The suite's apps verify every pull: /kvrelay/stats and /metrics count them."""
    before = tiny_app.ingress.stats.remote().result()["counters"]
    assert converse(tiny_app, "pull", seed=12) == converse(tiny_app, "recompute", seed=12)
    after = tiny_app.ingress.stats.remote().result()["counters"]
    assert after["pulls_verified"] - before["pulls_verified"] == 3  # turns 2 to 4 pulled
    assert after["pulls_refused"] == before["pulls_refused"]
    metrics = httpx.get(f"{tiny_app.base_url}/metrics", headers=tiny_app.headers, timeout=30).text
    assert f"kvrelay_pulls_verified_total {float(after['pulls_verified'])}" in metrics
    assert f"kvrelay_pulls_refused_total {float(after['pulls_refused'])}" in metrics
