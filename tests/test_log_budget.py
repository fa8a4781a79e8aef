"""A healthy app logs no ERROR and only allowed warnings (benchmarks/log_budget.py's allowlist, each entry with why it
is harmless), here over a multi-turn load on the suite's own app: what its engine replicas (and through them vLLM's
engines and NIXL), ingress and directory write to Ray's session logs while it serves."""

from __future__ import annotations

from pathlib import Path

from benchmarks.log_budget import LogWindow, judge, multi_turn_load
from tests.test_turns import converse


def test_a_multi_turn_load_with_pulls_logs_no_error_and_no_unexplained_warning(tiny_app):
    import ray

    window = LogWindow(Path(ray._private.worker.global_worker.node.get_logs_dir_path()))
    before = tiny_app.ingress.stats.remote().result()["counters"]
    for seed in range(5):  # 20 turns, 15 of them pulling their history from the other replica
        converse(tiny_app, "pull", seed=100 + seed)
    sent = multi_turn_load(tiny_app.base_url, "tiny-llama", requests=80, headers=tiny_app.headers)
    after = tiny_app.ingress.stats.remote().result()["counters"]
    assert sent == 80 and after["plans_pull"] - before.get("plans_pull", 0) >= 15
    verdict = judge(window.lines())
    assert verdict["errors"] == [] and verdict["unexplained_warnings"] == [], verdict


def test_the_budget_catches_errors_and_unexplained_warnings():
    lines = [
        "(EngineCore pid=1) ERROR 11-28 10:52:06 [pull_worker.py:667] Potentially invalid KV blocks for request x",
        "(EngineCore pid=1) WARNING 11-28 10:47:04 [cpu_worker.py:114] libtcmalloc is not found in LD_PRELOAD.",
        "WARNING 2026-11-28 10:47:04,001 app.turns -- pull for turn-1 from r1 failed; recomputing",
        "E1128 10:47:04.000000 1234 agent.cpp:12] NIXL: transfer failed",
        "RAY_ERROR_INFO_CHANNEL",
        "INFO 11-28 10:47:05 [core.py:402] init engine took 1.7 s",
    ]
    verdict = judge(lines)
    assert verdict["errors"] == [lines[0], lines[3]]
    assert verdict["unexplained_warnings"] == [lines[2]]
    assert sum(verdict["allowed_warnings"].values()) == 1
