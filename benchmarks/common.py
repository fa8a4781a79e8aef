"""Shared set-up for benchmarks: a local Ray cluster on loopback and a kvrelay app with the default model."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors import engine_site

REPO_ROOT = Path(__file__).resolve().parents[1]


def machine() -> dict[str, Any]:
    """What a result was measured on, for its JSON: the same benchmark runs about 10x slower on an AVX2-only CPU than
    on one with AMX, so figures compare only between runs on the same kind of CPU."""
    from actors.vllm_engine import cpu_flags, cpu_has_native_bf16, cpuinfo_field

    return {"cpu": cpuinfo_field(("model name",)) or platform.machine(), "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "simd_flags": sorted(f for f in cpu_flags() or () if f.startswith(("avx", "amx")) or f == "bf16"),
            "native_bf16": cpu_has_native_bf16()}


RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.rstrip() if done.returncode == 0 else None  # leading spaces are porcelain's status column


def command_line() -> str:
    """This process's command as a reader would type it: `python -m benchmarks.NAME ARGS` for a module run."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    head = ["python", "-m", spec.name] if spec is not None else ["python", sys.argv[0]]
    return shlex.join(head + sys.argv[1:])


def provenance() -> dict[str, Any]:
    """Where a result came from, for its JSON: the commit, whether tracked code differed from it (changes under
    benchmarks/results/ do not count: earlier runs write there), the command line, the date and the machine."""
    changed = _git("status", "--porcelain", "--untracked-files=no")
    dirty_paths = None if changed is None else [
        line[3:] for line in changed.splitlines() if not line[3:].startswith("benchmarks/results/")]
    return {
        "commit": _git("rev-parse", "HEAD") or "unknown",
        "dirty": None if dirty_paths is None else bool(dirty_paths),
        "dirty_paths": (dirty_paths or [])[:20],
        "command": command_line(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
    }


def write_result(out: Path | str, result: dict[str, Any], **dumps: Any) -> dict[str, Any]:
    """Write a benchmark's result as JSON at `out` with its provenance; returns what was written. Every benchmark
    saves through here, so every results file says which code, command and machine produced it."""
    out = Path(out)
    written = {**result, "provenance": provenance()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(written, indent=2, **dumps) + "\n")
    return written


def loopback_ray_env() -> None:
    """Ray binds 127.0.0.1, writes no token file, reports nothing; vLLM stays offline; Serve exports its cached
    metrics once a second and the request path runs at the default CPU priority, above the engines, as `make serve`
    runs them (Makefile, SERVE_ENV). Call before importing ray."""
    os.environ.setdefault("RAY_SERVE_METRICS_EXPORT_INTERVAL_MS", "1000")
    os.environ.setdefault("RAY_worker_niceness", "0")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ.pop("RAY_ADDRESS", None)
    for key in ("VLLM_NO_USAGE_STATS", "DO_NOT_TRACK", "HF_HUB_OFFLINE"):
        os.environ.setdefault(key, "1")


# Ports for the servers a benchmark or test starts (Serve's proxy, the ingress replica's own ports): below Ray's fixed
# ports (6379 and up), its worker ports (10002-19999) and the engines' side channels (`SIDE_CHANNEL_PORTS`), and
# outside the kernel's ephemeral range, from which any process may take a port before the server binds it (a Ray
# worker's gRPC server took the ingress's first port once, and the ingress answered on the next).
SERVER_PORTS = (1024, 5999)


def free_port_range(count: int) -> int:
    """The first of `count` consecutive ports free on 127.0.0.1 now, for a server that binds them later."""
    return engine_site.free_port_range("127.0.0.1", count, SERVER_PORTS)


def free_port() -> int:
    """A port free on 127.0.0.1 now, for a server that binds it later."""
    return free_port_range(1)


@dataclass
class BenchApp:
    ingress: Any
    engines: Any
    base_url: str
    model: str
    vocab_size: int
    temp_dir: str
    # Ray Serve's throughput-optimized mode: the ingress replica's own HTTP port (direct ingress, no proxy hop).
    direct_url: str | None = None

    def replica_ids(self, count: int, timeout_s: float = 600) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while True:
            ids = sorted(r["replica_id"] for r in self.ingress.stats.remote().result()["replicas"])
            if len(ids) >= count or time.monotonic() > deadline:
                return ids
            time.sleep(0.5)


def start_app(
    model: str | None = None, num_replicas: int = 2, pool: dict[str, Any] | None = None,
    throughput_optimized: bool = False, decode_pool: dict[str, Any] | None = None, app: dict[str, Any] | None = None,
    ingress_replicas: int = 1, **engine: Any
) -> BenchApp:
    """Start Ray and serve a kvrelay app (default model unless given); waits until replicas report.

    `pool` adds PoolConfig fields (e.g. `num_gpus: 1` on GPU machines); `engine` adds EngineConfig fields.
    `decode_pool` (PoolConfig fields; its `engine` merged over `engine`) makes it prefill/decode disaggregated.
    `app` adds AppConfig fields (e.g. `openai`). `ingress_replicas` runs that many ingress replicas, each with its own
    mirror of the directory (as serve_config.yaml's `deployments` override would).
    `throughput_optimized` runs Ray Serve's fast path (RAY_SERVE_THROUGHPUT_OPTIMIZED) in the cluster; this
    driver keeps its handles' router on a loop of its own so that its blocking calls still work."""
    loopback_ray_env()
    worker_env = {"PYTHONPATH": str(REPO_ROOT)}
    direct_port = None
    if throughput_optimized:
        # Ingress replicas take ports from this range in the order they start: the app's ingress gets the first.
        direct_port = free_port_range(16)
        os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] = "1"
        os.environ["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] = "1"
        os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] = str(direct_port)
        os.environ["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"] = str(direct_port + 15)
        worker_env |= {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}
    import ray
    from ray import serve
    from transformers import AutoTokenizer

    from app.builder import build_app
    from configs.models import DEFAULT_MODEL
    from model_prep.store import model_path

    model = model or DEFAULT_MODEL
    temp_dir = tempfile.mkdtemp(prefix="kvb", dir="/tmp")
    ray.init(address="local", num_cpus=8, include_dashboard=False, object_store_memory=512 * 1024**2,
             _temp_dir=temp_dir, logging_level="WARNING", log_to_driver=False,
             runtime_env={"env_vars": worker_env})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config={"log_level": "WARNING"})
    config: dict[str, Any] = {**(app or {}), "name": "bench",
                              "pool": dict(pool or {}, num_replicas=num_replicas,
                                           engine=dict(engine, **(pool or {}).get("engine", {}), model=model))}
    if decode_pool is not None:
        decode_engine = dict(engine, **decode_pool.get("engine", {}), model=model)
        config |= {"topology": "disaggregated", "decode_pool": dict(decode_pool, engine=decode_engine)}
    application = build_app(config)
    if ingress_replicas != 1:
        from ray.serve import Application

        application = Application(application._bound_deployment.options(num_replicas=ingress_replicas))
    serve.run(application, name="bench", route_prefix="/")
    bench = BenchApp(
        ingress=serve.get_app_handle("bench"),
        engines=serve.get_deployment_handle("engines", app_name="bench"),
        base_url=f"http://127.0.0.1:{port}",
        model=model,
        vocab_size=len(AutoTokenizer.from_pretrained(model_path(model))),
        temp_dir=temp_dir,
        direct_url=f"http://127.0.0.1:{direct_port}" if direct_port else None,
    )
    bench.replica_ids(num_replicas + (decode_pool or {}).get("num_replicas", 1 if decode_pool is not None else 0))
    return bench


def stop_app(app: BenchApp) -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
    shutil.rmtree(app.temp_dir, ignore_errors=True)
