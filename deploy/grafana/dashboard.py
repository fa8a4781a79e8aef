"""Generates kvrelay's Grafana dashboard (deploy/grafana/kvrelay.json) with grafanalib: the app's `kvrelay_*` and the
engines' `vllm:*` metrics, as the ingress's /metrics exports them (app/metrics.py).

    pip install -e ".[grafana]" && python deploy/grafana/dashboard.py     # rewrites kvrelay.json

Every ingress replica exports the directory's figures and every engine's `vllm:*` series, so panels take the max over
ingress replicas for those and sum the ingress's own counters.
"""

from __future__ import annotations

import json
from pathlib import Path

from grafanalib._gen import DashboardEncoder
from grafanalib.core import Dashboard, GridPos, RowPanel, Target, Template, Templating, Time, TimeSeries

OUTPUT = Path(__file__).with_name("kvrelay.json")
DATASOURCE = "${datasource}"
RATE = "[$__rate_interval]"
WIDTH, HEIGHT = 12, 8


def rate(selector: str, by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({selector}{RATE}))"


def quantile(q: float, histogram: str, by: str) -> str:
    return f"histogram_quantile({q}, sum by (le, {by}) (rate({histogram}_bucket{RATE})))"


# (row title, [(panel title, unit, [(expression, legend)])]), in the order they appear.
PANELS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]]]]]] = [
    ("Turns", [
        ("Turns by mode and policy", "reqps", [(rate("kvrelay_plans_total", "mode, policy"), "{{mode}} / {{policy}}")]),
        ("Time to first token by mode", "s", [
            (quantile(0.5, "kvrelay_ttft_seconds", "mode"), "p50 {{mode}}"),
            (quantile(0.9, "kvrelay_ttft_seconds", "mode"), "p90 {{mode}}"),
        ]),
        ("Planner's estimate error by mode (|measured - estimated| / measured)", "percentunit", [
            (quantile(0.5, "kvrelay_estimate_error_ratio", "mode"), "p50 {{mode}}"),
            (quantile(0.9, "kvrelay_estimate_error_ratio", "mode"), "p90 {{mode}}"),
        ]),
        ("Mean signed estimate error by mode (measured - estimated)", "s", [
            (f"({rate('kvrelay_measured_ttft_seconds_total', 'mode')} - "
             f"{rate('kvrelay_estimated_ttft_seconds_total', 'mode')}) / "
             f"{rate('kvrelay_estimate_error_ratio_count', 'mode')}", "{{mode}}"),
        ]),
    ]),
    ("KV pulls and holds", [
        ("Pull bandwidth (bytes over time waiting for them)", "Bps", [
            (f"{rate('kvrelay_pulled_bytes_total')} / {rate('kvrelay_pull_seconds_sum')}", "bandwidth"),
        ]),
        ("Bytes and tokens pulled", "Bps", [
            (rate("kvrelay_pulled_bytes_total"), "bytes/s"),
            (rate("kvrelay_pulled_tokens_total"), "tokens/s"),
        ]),
        ("Holds pending per replica", "short", [("max by (replica) (kvrelay_holds_pending)", "{{replica}}")]),
        ("Holds released by reason", "ops", [
            ('max by (reason) (rate(kvrelay_holds_released_total{reason!="superseded"}' + RATE + "))", "{{reason}}"),
            (rate('kvrelay_holds_released_total{reason="superseded"}', "reason"), "{{reason}}"),
        ]),
    ]),
    ("KV directory", [
        ("Directory size", "short", [
            ("max (kvrelay_directory_entries)", "entries"),
            ("max (kvrelay_directory_replicas)", "replicas reporting"),
        ]),
        ("Directory memory", "bytes", [("max (kvrelay_directory_bytes)", "index")]),
        ("Change feed lag per ingress replica", "short", [("kvrelay_directory_feed_lag_updates", "{{instance}}")]),
    ]),
    ("Engines and admission", [
        ("KV cache usage per replica", "percentunit", [("max by (replica) (vllm:kv_cache_usage_perc)", "{{replica}}")]),
        ("Requests running and waiting per replica", "short", [
            ("max by (replica) (vllm:num_requests_running)", "running {{replica}}"),
            ("max by (replica) (vllm:num_requests_waiting)", "waiting {{replica}}"),
        ]),
        ("429s (ingress or engine queue full)", "reqps", [(rate('kvrelay_errors_total{kind="overload"}'), "429")]),
    ]),
]


def dashboard() -> Dashboard:
    panels: list = []
    y = 0
    for row, row_panels in PANELS:
        panels.append(RowPanel(title=row, gridPos=GridPos(h=1, w=24, x=0, y=y)))
        y += 1
        for index, (title, unit, queries) in enumerate(row_panels):
            targets = [Target(expr=expr, legendFormat=legend, refId=chr(ord("A") + i), datasource=DATASOURCE)
                       for i, (expr, legend) in enumerate(queries)]
            grid = GridPos(h=HEIGHT, w=WIDTH, x=(index % 2) * WIDTH, y=y + (index // 2) * HEIGHT)
            panels.append(TimeSeries(title=title, dataSource=DATASOURCE, targets=targets, unit=unit, gridPos=grid))
        y += (len(row_panels) + 1) // 2 * HEIGHT
    source = Template(name="datasource", type="datasource", query="prometheus", label="Prometheus", default="")
    return Dashboard(title="kvrelay", uid="kvrelay", tags=["kvrelay", "vllm", "ray-serve"], refresh="10s",
                     time=Time("now-1h", "now"), templating=Templating(list=[source]),
                     panels=panels).auto_panel_ids()


def render() -> str:
    return json.dumps(dashboard().to_json_data(), cls=DashboardEncoder, indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT}")
