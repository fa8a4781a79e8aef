"""Prometheus metrics of the ingress (plans by mode, reused tokens, time to first token, errors), and the engines'
own `vllm:*` metrics gathered from each replica and labelled with its id."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from actors.replica_api import GenerateDelta

VLLM_PREFIX = "vllm:"


class IngressMetrics:
    """One registry per ingress replica, served at /metrics."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.plans = Counter("kvrelay_plans", "Turns by the mode they ran in", ["mode"], registry=self.registry)
        self.reused_tokens = Counter(
            "kvrelay_reused_tokens", "Prompt tokens not computed (local prefix hit or pulled)", ["mode"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter("kvrelay_prompt_tokens", "Prompt tokens of finished turns", registry=self.registry)
        self.pull_failures = Counter("kvrelay_pull_failures", "Pulls that failed and were recomputed",
                                     registry=self.registry)
        self.ttft = Histogram(
            "kvrelay_ttft_seconds", "Time to first token seen by the ingress", ["mode"], registry=self.registry,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.errors = Counter("kvrelay_errors", "Requests that failed", ["kind"], registry=self.registry)

    def observe_turn(self, outcome, last: GenerateDelta, seconds: float) -> None:
        mode = outcome.public()["mode"]
        self.plans.labels(mode=mode).inc()
        self.reused_tokens.labels(mode=mode).inc(last.num_cached_tokens)
        self.prompt_tokens.inc(last.prompt_tokens)
        if outcome.pull_failed:
            self.pull_failures.inc()
        if outcome.ttft_ms is not None:
            self.ttft.labels(mode=mode).observe(outcome.ttft_ms / 1e3)

    def render(self, engine_metrics: dict[str, str] | None = None) -> tuple[bytes, str]:
        """This ingress's metrics, then each replica's `vllm:*` families (`engine_metrics`: replica id -> text)."""
        body = generate_latest(self.registry)
        if engine_metrics:
            registry = CollectorRegistry(auto_describe=False)
            registry.register(_Families(by_replica(engine_metrics)))
            body += generate_latest(registry)
        return body, CONTENT_TYPE_LATEST


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
