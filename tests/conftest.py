"""Shared fixtures: one Ray cluster per session, and in-process engine replicas on a background event loop."""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import tempfile
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from benchmarks.common import free_port
from kvtransfer.types import Hold, HoldId

# Set before anything imports ray or vllm: loopback only, no token file, no usage reporting, offline.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ.pop("RAY_ADDRESS", None)
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

T = TypeVar("T")
REPO_ROOT = Path(__file__).resolve().parents[1]
# Modules that judge the session's app as its start-up calibration left it: they run before any other test's turns.
FIRST_MODULES = ("test_planner_vs_measured.py",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.path.name not in FIRST_MODULES)  # stable: the rest keep their order


class LoopThread:
    """An asyncio loop on its own thread: AsyncLLM binds its output task to one loop for its lifetime."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 300) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="session")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


async def collect(stream) -> list:
    """All items of an async iterator (a replica's generate stream)."""
    return [item async for item in stream]


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """A local Ray cluster on loopback for the whole session (starting one costs about 13 s)."""
    import ray

    temp_dir = tempfile.mkdtemp(prefix="kvr", dir="/tmp")
    # Logical CPUs are Ray's scheduling accounting only (vLLM's processes are not counted): room for
    # the several small apps a session runs side by side on this 2-core machine.
    ray.init(
        address="local",
        num_cpus=8,
        include_dashboard=False,
        object_store_memory=512 * 1024**2,
        _temp_dir=temp_dir,
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}},
    )
    yield ray
    # No `serve.shutdown()` first: it waited about 20 s for every app's graceful drain, which no test reads. Ray
    # ends its workers, and each engine process exits with its replica's (test_lean_engine).
    ray.shutdown()
    if os.environ.get("KVRELAY_KEEP_RAY_LOGS"):  # debugging: every process's log stays under temp_dir/session_*/logs
        print(f"Ray's logs kept in {temp_dir}")
    else:
        shutil.rmtree(temp_dir, ignore_errors=True)


# Block size of the directory actors the directory tests start (small, so short token lists fill blocks).
DIRECTORY_BLOCK_SIZE = 4


_HOLD_SERIALS = itertools.count()


def make_hold(
    num_tokens: int, engine_id: str = "e1", request_id: str = "req-1", block_ids: list[list[int]] | None = None
) -> Hold:
    """A new hold as an engine replica reports it: the fields vLLM's connector exports, and an id of its own, minted
    as a replica mints it (every call is another hold)."""
    return Hold(engine_id=engine_id, host="127.0.0.1", port=1, block_ids=block_ids or [[1, 2, 3]],
                num_tokens=num_tokens, hold_id=HoldId(engine_id, next(_HOLD_SERIALS)), request_id=request_id)


def start_directory_actor(name: str, block_size: int = DIRECTORY_BLOCK_SIZE) -> Any:
    """A named KV directory actor as a plain Ray actor (the app deploys it with Serve instead).

    Ray restarts it, empty, if it dies; calls in flight then fail (no task retries: a replayed `record_hold`
    could offer a consumed hold twice) and later calls reach the restarted actor.
    """
    import ray

    from actors.kv_directory import KVDirectoryActor

    options = {"name": name, "namespace": "kvrelay-test", "max_restarts": -1, "max_task_retries": 0, "num_cpus": 0.01}
    return ray.remote(KVDirectoryActor).options(**options).remote(block_size=block_size)


@pytest.fixture
def directory(ray_cluster: Any) -> Any:
    """A fresh KV directory actor per test (named uniquely), killed at the end."""
    import uuid

    handle = start_directory_actor(f"kvd-{uuid.uuid4().hex[:8]}")
    yield handle
    ray_cluster.kill(handle, no_restart=True)


class ServedApp:
    """A kvrelay app running in the session's Serve instance."""

    def __init__(self, name: str, base_url: str, api_key: str | None = None) -> None:
        from ray import serve

        self.name = name
        self.base_url = base_url
        # What HTTP calls must send (the app's first API key), empty when it has none.
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.ingress = serve.get_app_handle(name)
        self.engines = serve.get_deployment_handle("engines", app_name=name)

    def replica_ids(self, count: int, timeout_s: float = 120) -> list[str]:
        """Ids of the live engine replicas, once at least `count` of them have reported to the directory; fails
        with what the ingress and Serve saw when they have not within `timeout_s`."""
        import time

        from ray import serve

        deadline = time.monotonic() + timeout_s
        while True:
            ids = sorted(r["replica_id"] for r in self.ingress.stats.remote().result()["replicas"])
            if len(ids) >= count:
                return ids
            if time.monotonic() > deadline:
                engines = serve.status().applications[self.name].deployments["engines"]
                raise AssertionError(
                    f"app {self.name!r}: {len(ids)} engine replicas reported to the directory after {timeout_s:.0f} s, "
                    f"expected {count}: {ids}; Serve's engine replicas by state: {dict(engines.replica_states)} "
                    f"({engines.status}: {engines.message or 'no message'})")
            time.sleep(0.5)


@pytest.fixture(scope="session")
def serve_port(ray_cluster) -> int:
    from ray import serve

    port = free_port()
    # Serve's per-request INFO access logs would otherwise stream into pytest's output.
    serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config={"log_level": "WARNING"})
    return port


def run_app(name: str, route_prefix: str, port: int, **config: Any) -> ServedApp:
    from ray import serve

    from app.builder import build_app

    # Serve's per-request INFO access logs would otherwise stream into pytest's output.
    serve.run(build_app({"log_level": "WARNING", **config, "name": name}), name=name, route_prefix=route_prefix)
    keys = config.get("openai", {}).get("api_keys") or [None]
    return ServedApp(name, f"http://127.0.0.1:{port}{route_prefix.rstrip('/')}", keys[0])


def delete_app(name: str) -> None:
    """Delete app `name` without waiting for it to go: its replicas drain (Serve's wait loop), deregister and stop
    their engines (about 15 s a blocking delete waited) while the next tests start. No test reads an app after its own
    tests; the session's `serve.shutdown()` waits for any still stopping."""
    from ray import serve

    serve.delete(name, _blocking=False)


TINY_ENGINE = {
    "dtype": "float32",
    "max_model_len": 2048,
    "kv_cache_memory_bytes": 64 * 1024**2,
    # Long enough that a loaded CI box still pulls a hold within its lease (the directory stops offering
    # a hold 30% before its end), short enough that pending holds, which keep engines stepping, expire. Every pull
    # checked against its holder's digests (kvtransfer/kv_digest.py).
    "nixl": {"hold_ttl_s": 30, "verify_pulls": True},
}


API_KEYS = ("test-key", "other-tenant-key")


@pytest.fixture(scope="session")
def tiny_app(serve_port) -> Iterator[ServedApp]:
    """tiny-llama on two replicas, behind two API keys (tenants): the app most tests talk to. It runs until the
    session's Ray cluster ends."""
    app = run_app("tiny", "/", serve_port, pool={"num_replicas": 2, "engine": dict(TINY_ENGINE, model="tiny-llama")},
                  openai={"api_keys": list(API_KEYS)})
    app.replica_ids(2)
    # Tests that check placement start once the start-up calibration's own turns are done.
    app.ingress.calibrated.remote().result()
    yield app
