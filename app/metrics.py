"""Prometheus metrics of the ingress (turns by mode and policy, reused and pulled tokens, time to first token and the
planner's estimate of it, errors), the KV directory's size, holds and change feed as this ingress sees them, and the
engines' own `vllm:*` metrics gathered from each replica and labelled with its id. `deploy/grafana/dashboard.py`
charts them."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from actors.replica_api import GenerateDelta
from kvtransfer.directory_index.results import DirectoryStats
from kvtransfer.options import Mode
from kvtransfer.policies import policy_names

VLLM_PREFIX = "vllm:"
# kvrelay_errors' kinds: a client's mistake (4xx), a failure of ours (5xx), a full ingress or engine queue (429).
ERROR_KINDS = ("client", "server", "overload")


class DirectoryView(NamedTuple):
    """What /metrics reports of the KV directory: the actor's stats, and this ingress's mirror of its change feed."""

    stats: DirectoryStats
    mirror_epoch: str | None
    mirror_seq: int
    # Holds this ingress released because a later turn of their conversation left a longer one.
    holds_superseded: int

    @property
    def feed_lag(self) -> int:
        """Updates of the directory's feed the mirror has not applied yet (all of them after a directory restart)."""
        if self.mirror_epoch != self.stats.epoch:
            return self.stats.feed_seq
        return max(0, self.stats.feed_seq - self.mirror_seq)


class IngressMetrics:
    """One registry per ingress replica, served at /metrics."""

    def __init__(self, kv_bytes: Callable[[int], int]) -> None:
        """`kv_bytes`: the bytes of KV a number of tokens of context occupy (what a pull of them moves)."""
        self.kv_bytes = kv_bytes
        self.registry = CollectorRegistry()
        self.plans = Counter("kvrelay_plans", "Turns by the mode they ran in and the policy that placed them",
                             ["mode", "policy"], registry=self.registry)
        self.reused_tokens = Counter(
            "kvrelay_reused_tokens", "Prompt tokens not computed (local prefix hit or pulled)", ["mode"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter("kvrelay_prompt_tokens", "Prompt tokens of finished turns", registry=self.registry)
        self.pull_failures = Counter("kvrelay_pull_failures", "Pulls that failed and were recomputed",
                                     registry=self.registry)
        self.pulls_verified = Counter("kvrelay_pulls_verified", "Pulls whose every block matched its holder's digest",
                                      registry=self.registry)
        self.pulls_refused = Counter("kvrelay_pulls_refused", "Pulls whose KV the reading engine refused (a block "
                                     "unlike its holder's, or read too close to the hold's lease end) and recomputed",
                                     registry=self.registry)
        self.ttft = Histogram(
            "kvrelay_ttft_seconds", "Time to first token seen by the ingress", ["mode"], registry=self.registry,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.errors = Counter("kvrelay_errors", "Requests that failed", ["kind"], registry=self.registry)
        # The planner's estimate of each measured turn's time to first token: with kvrelay_ttft_seconds' sum and count,
        # the mean signed error per mode.
        self.estimated_ttft = Counter("kvrelay_estimated_ttft_seconds",
                                      "The planner's estimates of the time to first token of turns whose TTFT was "
                                      "measured", ["mode"], registry=self.registry)
        self.measured_ttft = Counter("kvrelay_measured_ttft_seconds",
                                     "The measured time to first token of the turns kvrelay_estimated_ttft_seconds "
                                     "counts", ["mode"], registry=self.registry)
        self.estimate_error = Histogram(
            "kvrelay_estimate_error_ratio", "|measured - estimated| / measured time to first token, per turn", ["mode"],
            registry=self.registry, buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 1, 2, 5),
        )
        self.pulled_tokens = Counter("kvrelay_pulled_tokens", "Tokens whose KV turns pulled from another replica",
                                     registry=self.registry)
        self.pulled_bytes = Counter("kvrelay_pulled_bytes", "Bytes of KV turns pulled from another replica",
                                    registry=self.registry)
        self.pull_seconds = Histogram(
            "kvrelay_pull_seconds", "How long a pulling turn waited for its KV before the engine scheduled it",
            registry=self.registry, buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
        )
        # Every series a dashboard queries exists from the start (at 0), not only after its first event.
        for mode in Mode:
            for metric in (self.reused_tokens, self.ttft, self.estimated_ttft, self.measured_ttft, self.estimate_error):
                metric.labels(mode=mode.value)
            for policy in policy_names():
                self.plans.labels(mode=mode.value, policy=policy)
        for kind in ERROR_KINDS:
            self.errors.labels(kind=kind)

    def observe_turn(self, outcome, last: GenerateDelta, seconds: float, policy: str) -> None:
        mode = outcome.public()["mode"]
        self.plans.labels(mode=mode, policy=policy).inc()
        self.reused_tokens.labels(mode=mode).inc(last.num_cached_tokens)
        self.prompt_tokens.inc(last.prompt_tokens)
        if outcome.pull_failed:
            self.pull_failures.inc()
        if outcome.read_check is not None:
            (self.pulls_verified if outcome.read_check == "verified" else self.pulls_refused).inc()
        if outcome.ttft_ms is not None:
            self.ttft.labels(mode=mode).observe(outcome.ttft_ms / 1e3)
            estimate_ms = outcome.plan.estimate_ms
            if not outcome.pull_failed and not outcome.migrations and estimate_ms > 0 and outcome.ttft_ms > 0:
                self.estimated_ttft.labels(mode=mode).inc(estimate_ms / 1e3)
                self.measured_ttft.labels(mode=mode).inc(outcome.ttft_ms / 1e3)
                self.estimate_error.labels(mode=mode).observe(abs(outcome.ttft_ms - estimate_ms) / outcome.ttft_ms)
        pulled = outcome.reused_tokens - outcome.plan.cached_tokens
        if outcome.plan.mode is Mode.PULL and not outcome.pull_failed and pulled > 0:
            self.pulled_tokens.inc(pulled)
            self.pulled_bytes.inc(self.kv_bytes(pulled))
            if last.wait_s is not None:
                self.pull_seconds.observe(last.wait_s)

    def render(
        self, engine_metrics: dict[str, str] | None = None, directory: DirectoryView | None = None
    ) -> tuple[bytes, str]:
        """This ingress's metrics, the directory's (`directory`), then each replica's `vllm:*` families
        (`engine_metrics`: replica id -> text)."""
        body = generate_latest(self.registry)
        families = directory_families(directory) if directory is not None else []
        if engine_metrics:
            families += by_replica(engine_metrics)
        if families:
            registry = CollectorRegistry(auto_describe=False)
            registry.register(_Families(families))
            body += generate_latest(registry)
        return body, CONTENT_TYPE_LATEST


def directory_families(view: DirectoryView) -> list[Metric]:
    """The KV directory's size, its holds (pending per replica, and how they ended) and this ingress's feed lag."""
    stats = view.stats
    entries = GaugeMetricFamily("kvrelay_directory_entries", "Prefix entries the KV directory keeps")
    entries.add_metric([], stats.entries)
    size = GaugeMetricFamily("kvrelay_directory_bytes", "Estimated memory of the KV directory's index")
    size.add_metric([], stats.bytes)
    replicas = GaugeMetricFamily("kvrelay_directory_replicas", "Engine replicas reporting to the KV directory")
    replicas.add_metric([], stats.replicas)
    pending = GaugeMetricFamily("kvrelay_holds_pending", "Exported holds not yet pulled, released or expired",
                                labels=["replica"])
    for replica, count in sorted(stats.holds_by_replica.items()):
        pending.add_metric([replica], count)
    released = CounterMetricFamily("kvrelay_holds_released", "Holds that ended, by how: read by a turn (consumed), "
                                   "lease over (expired), or released by this ingress for a longer one (superseded)",
                                   labels=["reason"])
    released.add_metric(["consumed"], stats.holds_consumed)
    released.add_metric(["expired"], stats.holds_expired)
    released.add_metric(["superseded"], view.holds_superseded)
    lag = GaugeMetricFamily("kvrelay_directory_feed_lag_updates",
                            "Updates of the directory's change feed this ingress's mirror has not applied yet")
    lag.add_metric([], view.feed_lag)
    return [entries, size, replicas, pending, released, lag]


def by_replica(engine_metrics: dict[str, str]) -> list[Metric]:
    """vLLM's metric families of every replica merged, each sample labelled `replica`."""
    families: dict[str, Metric] = {}
    for replica, text in engine_metrics.items():
        for family in text_string_to_metric_families(text):
            if not family.name.startswith(VLLM_PREFIX):
                continue
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            merged.samples += [Sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)
                               for s in family.samples]
    return list(families.values())


class _Families:
    """A collector that yields already-built families."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families
