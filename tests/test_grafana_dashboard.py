"""The Grafana dashboard (deploy/grafana/kvrelay.json) is what its grafanalib generator makes, charts what the issue
asks for, and queries only metrics (and label values) the running app's /metrics exports."""

from __future__ import annotations

import importlib.util
import json
import re
from typing import Any

import httpx
import pytest

from tests.conftest import REPO_ROOT

GENERATOR = REPO_ROOT / "deploy/grafana/dashboard.py"
COMMITTED = REPO_ROOT / "deploy/grafana/kvrelay.json"
# A metric name in PromQL, with the label matchers that follow it, if any.
SELECTOR = re.compile(r"\b((?:kvrelay_|vllm:)[a-zA-Z0-9_:]+)(\{[^}]*\})?")
MATCHER = re.compile(r'(\w+)\s*(=|!=)\s*"([^"]*)"')


def generator() -> Any:
    spec = importlib.util.spec_from_file_location("kvrelay_dashboard", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def panels(dashboard: dict[str, Any]) -> dict[str, list[str]]:
    """Each chart's title and its PromQL expressions."""
    return {p["title"]: [t["expr"] for t in p["targets"]] for p in dashboard["panels"] if p["type"] != "row"}


def test_the_committed_dashboard_is_the_generated_one():
    assert COMMITTED.read_text() == generator().render(), "run: python deploy/grafana/dashboard.py"


def test_the_dashboard_charts_what_an_operator_watches():
    charts = panels(json.loads(COMMITTED.read_text()))
    text = json.dumps(charts)
    for needle in ("kvrelay_plans_total", "mode, policy", "kvrelay_ttft_seconds_bucket", "kvrelay_estimate_error_ratio",
                   "kvrelay_pulled_bytes_total", "kvrelay_pull_seconds_sum", "kvrelay_holds_pending",
                   "kvrelay_holds_released_total", "kvrelay_directory_entries", "kvrelay_directory_feed_lag_updates",
                   "vllm:kv_cache_usage_perc", 'kvrelay_errors_total{kind=\\"overload\\"}'):
        assert needle in text, needle
    assert all(exprs for exprs in charts.values())


def exported(text: str) -> tuple[set[str], list[tuple[str, dict[str, str]]]]:
    """Names /metrics exports (families, and their samples' names), and every sample's name and labels."""
    from prometheus_client.parser import text_string_to_metric_families

    names, samples = set(), []
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        for sample in family.samples:
            names.add(sample.name)
            samples.append((sample.name, sample.labels))
    return names, samples


@pytest.fixture(scope="module")
def metrics_text(tiny_app) -> str:
    # One turn of our own, so that every labelled family the calibration may not have touched has run once too.
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    assert httpx.post(f"{tiny_app.base_url}/v1/chat/completions", json=body, headers=tiny_app.headers,
                      timeout=120).status_code == 200
    response = httpx.get(f"{tiny_app.base_url}/metrics", headers=tiny_app.headers, timeout=30)
    assert response.status_code == 200
    return response.text


def test_every_metric_a_panel_queries_is_exported_by_the_running_app(metrics_text):
    names, samples = exported(metrics_text)
    missing = []
    for title, exprs in panels(json.loads(COMMITTED.read_text())).items():
        for expr in exprs:
            for name, matchers in SELECTOR.findall(expr):
                if name not in names:
                    missing.append(f"{title}: {name}")
                    continue
                # A label value a query selects on (kind="overload") must exist too, or the panel stays empty.
                for label, op, value in MATCHER.findall(matchers):
                    if op == "=" and not any(n == name and labels.get(label) == value for n, labels in samples):
                        missing.append(f"{title}: {name}{{{label}={value!r}}}")
    assert not missing, missing
