"""`serve run` in Serve's default mode (as `serve run serve_config.yaml` runs without the Makefile's environment),
stopped as a harness, `timeout` or a supervisor stops it: SIGKILL to its whole process group, so nobody shuts the
engines down. Every process `serve run` started (Ray, Serve's replicas, vLLM's engines: those the replicas reported
by pid, and anything left in its session) is gone 15 s later. SIGTERM, in the throughput-optimized mode `make serve`
runs in, is the last test of `test_serve_run.py`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from benchmarks.common import free_port
from tests.conftest import REPO_ROOT
from tests.test_serve_run import assert_ended, replica_processes, running, session_processes, wait_until_healthy

CONFIG = """\
http_options: {{host: 127.0.0.1, port: {port}}}
applications:
  - name: sigkill
    route_prefix: /
    import_path: app.builder:build_app
    args:
      log_level: WARNING
      calibrate: false
      pool:
        num_replicas: 1
        engine: {{model: tiny-llama, dtype: float32, max_model_len: 1024, kv_cache_memory_bytes: 67108864}}
"""


def test_nothing_survives_a_sigkill_of_serve_runs_process_group(tmp_path):
    port = free_port()
    config = tmp_path / "serve_config.yaml"
    config.write_text(CONFIG.format(port=port))
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
               RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    log, url = tmp_path / "serve_run.log", f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "serve"), "run", "--address", "local", str(config)],
                                cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until_healthy(proc, log, url, replicas=1, timeout_s=600)
        reported = running(replica_processes(url, replicas=1))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        assert_ended(reported, proc.pid, timeout_s=15)
    finally:
        if proc.poll() is None or session_processes(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
