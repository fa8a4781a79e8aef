"""`serve run serve_config.yaml` as `make serve` runs it: the real default model on two replicas, answering on
the ingress replica's own port (Ray Serve's throughput-optimized mode; 8001 for `make serve`) and through Serve's
proxy (8000). The test runs the committed config and the Makefile's environment with only those ports moved to
free ones, so it needs no fixed port. Beside it, `serve run` in Serve's default mode, as `serve run serve_config.yaml`
runs without the Makefile's environment, to be stopped with SIGKILL."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import httpx
import psutil
import pytest

from app.serve_progress import ray_session_logs
from benchmarks.common import free_port
from benchmarks.served import healthy, ready, start_served, stop_served, wait_for
from configs.engine import NixlSettings
from tests.conftest import REPO_ROOT


def wait_until_healthy(proc: subprocess.Popen, log: Path, base_url: str, replicas: int, timeout_s: float) -> None:
    """Until `serve run` (`proc`, printing to `log`) answers /health with `replicas` engine replicas reporting."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"{base_url}/health", timeout=5).json().get("replicas") == replicas:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    pytest.fail(f"serve run did not become healthy in {timeout_s:.0f} s:\n" + log.read_text()[-3000:])


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    served = start_served(tmp_path_factory.mktemp("serve_run"))
    try:
        # Both replicas up: each engine reports once it has started, not necessarily together.
        wait_for(served, lambda: healthy(served), "healthy", timeout_s=900)
        yield served
    finally:
        stop_served(served, timeout_s=60)  # the last test may have killed the session itself


# What `make serve` prints, in order, one line each.
STAGES = ["install", "model preparation", "Ray", "engine 1", "engine 2", "calibration", "ready"]
STAGE_LINE = re.compile(r"\[\s*(\d+\.\d) s\] ([^:]+): (.*)")


def test_the_ray_line_names_the_session_serve_run_started_not_the_last_one(tmp_path):
    """Another Ray cluster started on the machine meanwhile moves `session_latest`; Ray names a session after the pid
    of the process that started it."""
    mine, other = tmp_path / "session_2026-12-07_10-00-00_000001_123", tmp_path / "session_2026-12-07_10-00-01_000002_9"
    mine.mkdir(), other.mkdir()
    (tmp_path / "session_latest").symlink_to(other)
    assert ray_session_logs(123, tmp_path) == mine / "logs"
    assert ray_session_logs(23, tmp_path) == other / "logs"  # serve run joined a running cluster: the latest


def test_make_serve_prints_one_line_per_stage_with_its_elapsed_seconds(served):
    deadline = time.monotonic() + 300  # the calibration runs after both engines are up
    while "] ready: " not in served.stages.read_text() and time.monotonic() < deadline:
        assert served.proc.poll() is None, served.stages.read_text()
        time.sleep(1)
    lines = served.stages.read_text().splitlines()
    parsed = [STAGE_LINE.fullmatch(line) for line in lines]
    assert all(parsed) and [m[2] for m in parsed] == STAGES, "\n".join(lines)
    seconds = [float(m[1]) for m in parsed]
    assert seconds == sorted(seconds), lines
    assert served.proxy in lines[-1] and served.base in lines[-1]  # Serve's proxy, and the ingress's own port
    # vLLM's start-up lines are not on the console but in Ray's log files, in the folder the Ray line names.
    logs = Path(re.search(r"included: (\S+)\)", lines[2])[1])
    assert any("Initializing a V1 LLM engine" in f.read_text(errors="replace") for f in logs.glob("worker-*")), logs


def test_serve_run_serves_the_default_model(served):
    models = httpx.get(f"{served.base}/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["smollm2-135m-instruct"]
    question = [{"role": "user", "content": "What is the capital of France?"}]
    body = {"model": "smollm2-135m-instruct", "messages": question, "max_tokens": 16, "temperature": 0}
    reply = httpx.post(f"{served.base}/v1/chat/completions", json=body, timeout=120).json()
    assert "Paris" in reply["choices"][0]["message"]["content"]
    assert httpx.get(f"{served.base}/health", timeout=30).json()["replicas"] == 2
    # Both replicas reached the directory and the ingress's mirror of it through their heartbeats.
    assert httpx.get(f"{served.proxy}/health", timeout=30).json()["replicas"] == 2


def test_json_mode_returns_parseable_json(served):
    """With the official client and a real model: random-weight test models never close the object they open."""
    import openai

    client = openai.OpenAI(base_url=f"{served.base}/v1", api_key="none", max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model="smollm2-135m-instruct", temperature=0, max_tokens=400, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": 'What is the capital of France? Answer only {"answer": "<city>"}'}])
    assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


class ReplicaProcesses(NamedTuple):
    pid: int  # the replica's own process (a Ray worker)
    engine_pids: list[int]  # the vLLM engine processes it started


def replica_processes(base_url: str, replicas: int) -> dict[str, ReplicaProcesses]:
    """Each replica's process and its engine processes, as the replicas report them in `GET /kvrelay/stats`."""
    reported = httpx.get(f"{base_url}/kvrelay/stats", timeout=30).json()["replicas"]
    found = {r["replica_id"]: ReplicaProcesses(r["pid"], r["engine_pids"]) for r in reported}
    assert len(found) == replicas and all(p.engine_pids for p in found.values()), reported
    return found


def running(found: dict[str, ReplicaProcesses]) -> list[psutil.Process]:
    """The processes behind every reported pid, replicas' and engines' (raises NoSuchProcess if one is not running).
    A `psutil.Process` also knows its start time, so a pid reused later by another process is not taken for it."""
    return [psutil.Process(pid) for p in found.values() for pid in (p.pid, *p.engine_pids)]


def still_running(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those of `processes` that still run (a zombie waiting to be reaped has ended)."""
    left = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                left.append(process)
        except psutil.NoSuchProcess:
            continue
    return left


def listening_pids(port: int) -> set[int]:
    """The processes with a listening TCP socket on `port`."""
    return {c.pid for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid is not None}


def test_the_engines_compute_below_the_request_path(served):
    """On CPU `make serve` runs Ray's workers (the ingress, Serve's proxy and replicas) at nice 0 and the engine
    processes at 19, so the request path's work runs before the models' (docs/design.md)."""
    reported = replica_processes(served.base, replicas=2)
    engines = {pid: psutil.Process(pid).nice() for p in reported.values() for pid in p.engine_pids}
    assert len(engines) >= 2 and set(engines.values()) == {19}, engines
    # The request path: each replica's own process, the ingress (answering on its own port) and Serve's proxy.
    ingress, proxy = (listening_pids(port) for port in served.ports)
    assert ingress and proxy, (served.ports, ingress, proxy)
    serve = {pid: psutil.Process(pid).nice() for pid in {p.pid for p in reported.values()} | ingress | proxy}
    assert set(serve.values()) == {0}, serve


def listening_addresses(port: int) -> set[str]:
    """Local IPv4 addresses with a listening TCP socket on `port` (from /proc/net/tcp)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, port_hex = local.split(":")
        if state == "0A" and int(port_hex, 16) == port:
            found.add(".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return found


def test_serve_run_listens_on_loopback_only(served):
    for port in served.ports:
        assert listening_addresses(port) == {"127.0.0.1"}


def wait_until_quiet(served, quiet_s: float, timeout_s: float) -> None:
    """Until `make serve` has printed "ready" at least `quiet_s` ago and serve run's console has printed nothing for
    `quiet_s`; fails with what it printed last after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    size, changed = served.log.stat().st_size, time.monotonic()
    while True:
        assert ready(served), served.stages.read_text()
        now, grown = time.monotonic(), served.log.stat().st_size
        if grown != size:
            size, changed = grown, now
        if now - changed >= quiet_s and time.time() - served.stages.stat().st_mtime >= quiet_s:
            return
        assert now < deadline, f"serve run's console never went quiet for {quiet_s:.0f} s:\n" + "\n".join(
            served.log.read_text(errors="replace").splitlines()[-20:])
        time.sleep(0.5)


@pytest.mark.usefixtures("default_mode")  # starts the SIGKILL test's app while this test mostly waits
def test_the_console_prints_a_line_per_client_request_and_nothing_while_idle(served):
    """Heartbeats and the directory's feed run all the time; they used to print ~2.4 access-log lines a second,
    and every turn's hold expiring unread printed a warning of vLLM's."""
    # Start-up's own lines (engines, the calibration's first pulls) reach the console late: start once the last
    # one is a hold's lease and more behind, and the calibration ("ready") as long ago.
    lease_s = NixlSettings().hold_ttl_s  # serve_config.yaml's engines keep the default
    wait_until_quiet(served, quiet_s=lease_s + 5, timeout_s=120)
    log = served.log
    before = log.read_bytes()
    body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert httpx.post(f"{served.base}/v1/chat/completions", json=body, timeout=120).status_code == 200
    time.sleep(2 * lease_s)  # well past the turn's hold's lease
    printed = log.read_bytes()[len(before):].decode(errors="replace").splitlines()
    assert len(printed) <= 1, "\n".join(printed)


def session_processes(sid: int) -> dict[int, str]:
    """pid -> command line of every live process in session `sid` (zombies left out)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if os.getsid(int(entry.name)) != sid or state == "Z":
                continue
            found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ProcessLookupError):
            continue
    return found


def assert_ended(reported: list[psutil.Process], sid: int, timeout_s: float) -> None:
    """Wait up to `timeout_s` for the `reported` processes and every process of session `sid` to end, then fail with
    those left. A reported one still running is killed first: an engine left behind would hold its memory and a core
    for the rest of the suite."""
    deadline = time.monotonic() + timeout_s
    while (still_running(reported) or session_processes(sid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    escaped = still_running(reported)
    for process in escaped:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    assert not escaped, f"reported processes still running {timeout_s:.0f} s later: {escaped}"
    assert not (left := session_processes(sid)), left


DEFAULT_MODE_CONFIG = """\
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


class DefaultModeRun(NamedTuple):
    proc: subprocess.Popen
    log: Path
    url: str


@pytest.fixture(scope="module")
def default_mode(tmp_path_factory):
    """`serve run` of a tiny-llama app in Serve's default mode (none of the Makefile's environment), in a session of
    its own; returns at once."""
    folder = tmp_path_factory.mktemp("serve_run_default_mode")
    port = free_port()
    config = folder / "serve_config.yaml"
    config.write_text(DEFAULT_MODE_CONFIG.format(port=port))
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
               RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    log = folder / "serve_run.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "serve"), "run", "--address", "local", str(config)],
                                cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield DefaultModeRun(proc, log, f"http://127.0.0.1:{port}")
    finally:
        if proc.poll() is None or session_processes(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def test_nothing_survives_a_sigkill_of_serve_runs_process_group(default_mode):
    """`serve run` stopped as a harness, `timeout` or a supervisor stops it: SIGKILL to its whole process group, so
    nobody shuts the engines down. Every process it started (Ray, Serve's replicas, vLLM's engines: those the
    replicas reported by pid, and anything left in its session) is gone 15 s later."""
    proc = default_mode.proc
    wait_until_healthy(proc, default_mode.log, default_mode.url, replicas=1, timeout_s=600)
    reported = running(replica_processes(default_mode.url, replicas=1))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    assert_ended(reported, proc.pid, timeout_s=15)


def test_sigterm_to_make_serve_leaves_no_process_behind(served):
    """What a supervisor or `kill PID` sends to `make serve`'s console: it passes the signal on to serve run, which
    shuts the app down. The replica and engine processes the replicas reported by pid, and every process of the
    session, are gone 10 s after the console exits (SIGKILL of serve run's whole group, in Serve's default mode: the
    test before). Runs last in this module: it ends the app the other tests used."""
    proc = served.proc
    reported = running(replica_processes(served.base, replicas=2))
    proc.send_signal(signal.SIGTERM)  # to the console alone, not its process group
    proc.wait(90)
    assert_ended(reported, proc.pid, timeout_s=10)
