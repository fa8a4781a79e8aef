"""SIGTERM to `serve run` alone (what a supervisor or `kill PID` sends) in each Serve mode the app runs in: the app
shuts down, the replica and engine processes it reported are gone, and no process of its session is left. Runs
before the session's own Ray cluster starts (see conftest), as `test_serve_run.py` does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.common import free_port, free_port_range
from tests.conftest import REPO_ROOT
from tests.test_serve_run import assert_ended, replica_processes, running, session_processes, wait_until_healthy

CONFIG = """\
http_options: {{host: 127.0.0.1, port: {port}}}
applications:
  - name: sigterm
    route_prefix: /
    import_path: app.builder:build_app
    args:
      log_level: WARNING
      pool:
        num_replicas: 1
        engine: {{model: tiny-llama, dtype: float32, max_model_len: 1024, kv_cache_memory_bytes: 67108864}}
"""


@pytest.mark.parametrize("mode", ["default", "throughput_optimized"])
def test_sigterm_to_serve_run_leaves_no_process_behind(mode, tmp_path):
    port = free_port()
    config = tmp_path / "serve_config.yaml"
    config.write_text(CONFIG.format(port=port))
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
               RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    if mode == "throughput_optimized":
        first = free_port_range(4)
        env |= {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(first),
                "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(first + 3)}
    log, url = tmp_path / "serve_run.log", f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "serve"), "run", "--address", "local", str(config)],
                                cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until_healthy(proc, log, url, replicas=1, timeout_s=600)
        reported = running(replica_processes(url, replicas=1))
        proc.send_signal(signal.SIGTERM)  # to serve run alone, not its process group
        proc.wait(90)
        assert_ended(reported, proc.pid, timeout_s=10)
    finally:
        if proc.poll() is None or session_processes(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
