"""The app as `make serve` starts it: `app.serve_progress` running the committed serve_config.yaml with the Makefile's
environment (SERVE_ENV), only its two ports moved to free ones, in a session of its own so that every process it
starts can be found. What the tests of `make serve` and the benchmarks of what a user runs (idle cost, log budget)
start."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import httpx

from benchmarks.common import REPO_ROOT, free_port, free_port_range

REPLICAS = 2  # serve_config.yaml's pool


def make_serve_env() -> dict[str, str]:
    """The variables `make serve` sets for `serve run` (SERVE_ENV in the Makefile)."""
    line = (REPO_ROOT / "Makefile").read_text().split("SERVE_ENV :=", 1)[1].split("\n\n", 1)[0]
    return dict(item.split("=", 1) for item in line.replace("\\", " ").split())


class Served(NamedTuple):
    proc: subprocess.Popen  # `make serve`'s console (app/serve_progress.py), which runs serve run
    stages: Path  # what `make serve` prints
    log: Path  # serve run's output
    base: str  # the ingress replica's own port
    proxy: str  # Serve's proxy
    ports: tuple[int, int]  # (ingress, proxy)

    def ray_logs(self) -> Path:
        """Ray's session log folder, which the Ray stage line names (vLLM's engines log there)."""
        return Path(re.search(r"included: (\S+)\)", self.stages.read_text())[1])


def start_served(folder: Path) -> Served:
    """Start the app in `folder` (its config, console and log go there); returns at once."""
    committed = (REPO_ROOT / "serve_config.yaml").read_text()
    serve_env = make_serve_env()
    if committed.count("port: 8000") != 1 or serve_env.get("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT") != "8001":
        raise ValueError("serve_config.yaml no longer names port 8000 once, or the Makefile's direct ingress 8001")
    proxy_port, ingress_port = free_port(), free_port_range(9)
    config, stages, log = folder / "serve_config.yaml", folder / "stages.txt", folder / "serve_run.log"
    config.write_text(committed.replace("port: 8000", f"port: {proxy_port}"))
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled",
               RAY_USAGE_STATS_ENABLED="0", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1")
    env.pop("RAY_ADDRESS", None)
    env |= serve_env | {"RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(ingress_port),
                        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(ingress_port + 8)}
    proxy = f"http://127.0.0.1:{proxy_port}"
    with open(stages, "wb") as out:
        # Its install and model stages find everything up to date; `--address local` keeps it apart from any
        # other Ray cluster on the machine.
        proc = subprocess.Popen([sys.executable, "-m", "app.serve_progress", str(config), "--url", proxy,
                                 "--log", str(log), "--address", "local"], cwd=REPO_ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return Served(proc, stages, log, f"http://127.0.0.1:{ingress_port}", proxy, (ingress_port, proxy_port))


def healthy(served: Served, replicas: int = REPLICAS) -> bool:
    """/health answers 200 with every replica reporting (the start-up calibration may still be running)."""
    try:
        reply = httpx.get(f"{served.base}/health", timeout=5)
        return reply.status_code == 200 and reply.json().get("replicas") == replicas
    except (httpx.HTTPError, ValueError):
        return False


def ready(served: Served) -> bool:
    """`make serve`'s "ready" line: healthy and calibrated."""
    return "] ready: " in served.stages.read_text()


def wait_for(served: Served, done: Callable[[], bool], what: str, timeout_s: float = 1200) -> None:
    """Until `done()`; raises with the console's end if the app exits or `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if served.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the app did not become {what} in {timeout_s:.0f} s:\n"
                               + served.stages.read_text()[-3000:] + "\n" + _tail(served.log))
        time.sleep(0.5)


def stop_served(served: Served, timeout_s: float = 90) -> None:
    """SIGTERM to `make serve`'s console alone (it passes it on to serve run, which shuts down cleanly); the whole
    session is killed if that takes longer than `timeout_s`."""
    try:
        served.proc.send_signal(signal.SIGTERM)
        served.proc.wait(timeout_s)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(served.proc.pid, signal.SIGKILL)
        served.proc.wait(30)


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""
