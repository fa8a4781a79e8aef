"""What the ingress's /metrics says about a turn and the KV directory, checked on the metrics object itself (the
dashboard test checks the running app exports every family)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from actors.replica_api import GenerateDelta
from app.metrics import DirectoryView, IngressMetrics
from app.turn_types import TurnOutcome
from kvtransfer.directory_index.results import DirectoryStats
from kvtransfer.options import Mode
from kvtransfer.planner import Plan

KV_BYTES_PER_TOKEN = 1000


def samples(metrics: IngressMetrics, directory: DirectoryView | None = None) -> dict[tuple, float]:
    body, _ = metrics.render(None, directory)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(body.decode()) for s in f.samples}


def plan(mode: Mode, estimate_ms: float, cached: int = 0) -> Plan:
    return Plan(replica_id="r1", mode=mode, holder="r2" if mode is Mode.PULL else None, reused_tokens=0,
                cached_tokens=cached, estimate_ms=estimate_ms, estimates_ms={}, reason="test")


def test_a_pull_counts_its_bytes_its_wait_and_the_planners_error():
    metrics = IngressMetrics(lambda tokens: tokens * KV_BYTES_PER_TOKEN)
    outcome = TurnOutcome(plan(Mode.PULL, estimate_ms=80.0, cached=64), reused_tokens=1064, ttft_ms=100.0)
    last = GenerateDelta(token_ids=[1], text="", finished=True, prompt_tokens=1100, num_cached_tokens=1064,
                         wait_s=0.02)
    metrics.observe_turn(outcome, last, 0.5, policy="kvrelay")
    got = samples(metrics)
    assert got[("kvrelay_plans_total", (("mode", "pull"), ("policy", "kvrelay")))] == 1
    assert got[("kvrelay_plans_total", (("mode", "local"), ("policy", "round_robin")))] == 0  # there from the start
    assert got[("kvrelay_pulled_tokens_total", ())] == 1000  # the holder's tokens, not the local prefix hit
    assert got[("kvrelay_pulled_bytes_total", ())] == 1000 * KV_BYTES_PER_TOKEN
    assert got[("kvrelay_pull_seconds_sum", ())] == 0.02
    assert abs(got[("kvrelay_estimate_error_ratio_sum", (("mode", "pull"),))] - 0.2) < 1e-9  # |100 - 80| / 100
    assert got[("kvrelay_measured_ttft_seconds_total", (("mode", "pull"),))] == 0.1
    assert got[("kvrelay_estimated_ttft_seconds_total", (("mode", "pull"),))] == 0.08


def test_a_failed_pull_teaches_neither_the_pull_figures_nor_the_estimate_error():
    metrics = IngressMetrics(lambda tokens: tokens)
    outcome = TurnOutcome(plan(Mode.PULL, estimate_ms=80.0), reused_tokens=0, ttft_ms=300.0, pull_failed=True)
    metrics.observe_turn(outcome, GenerateDelta(token_ids=[], text="", finished=True), 0.5, policy="kvrelay")
    got = samples(metrics)
    assert got[("kvrelay_plans_total", (("mode", "recompute"), ("policy", "kvrelay")))] == 1
    assert got[("kvrelay_pull_failures_total", ())] == 1 and got[("kvrelay_pulled_bytes_total", ())] == 0
    assert got[("kvrelay_estimate_error_ratio_count", (("mode", "recompute"),))] == 0


def directory_stats(**fields) -> DirectoryStats:
    values = {name: 0 for name in DirectoryStats._fields} | {"epoch": "e1", "hit_rate": 0.0, "holds_by_replica": {}}
    return DirectoryStats(**(values | fields))


def test_the_directorys_holds_size_and_feed_lag():
    metrics = IngressMetrics(lambda tokens: tokens)
    stats = directory_stats(entries=12, bytes=4096, holds_by_replica={"r1": 2, "r2": 1}, holds_consumed=5,
                            holds_expired=4, feed_seq=40)
    got = samples(metrics, DirectoryView(stats, mirror_epoch="e1", mirror_seq=37, holds_superseded=3))
    assert got[("kvrelay_directory_entries", ())] == 12 and got[("kvrelay_directory_bytes", ())] == 4096
    assert got[("kvrelay_holds_pending", (("replica", "r1"),))] == 2
    assert [got[("kvrelay_holds_released_total", (("reason", r),))] for r in ("consumed", "expired", "superseded")] \
        == [5, 4, 3]
    assert got[("kvrelay_directory_feed_lag_updates", ())] == 3
    # After a directory restart (a new epoch) the mirror must fetch everything again.
    restarted = DirectoryView(directory_stats(epoch="e2", feed_seq=6), mirror_epoch="e1", mirror_seq=37,
                              holds_superseded=0)
    assert samples(metrics, restarted)[("kvrelay_directory_feed_lag_updates", ())] == 6
