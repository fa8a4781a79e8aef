"""Two engine replicas in one Ray cluster behind Serve: own NIXL port and core each, both streaming."""

from __future__ import annotations

import asyncio
import socket
import uuid

import httpx
import pytest

from actors.replica_api import GenerateRequest, Sampling
from app.builder import build_app
from configs.app import AppConfig, PoolConfig
from configs.engine import EngineConfig

MiB = 1024**2


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_app(ray_cluster):
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = AppConfig(
        pool=PoolConfig(
            num_replicas=2,
            engine=EngineConfig(
                model="tiny-llama", dtype="float32", max_model_len=1024, kv_cache_memory_bytes=64 * MiB
            ),
        )
    )
    serve.run(build_app(config), name="replicas_test", route_prefix="/")
    engines = serve.get_deployment_handle("engines", app_name="replicas_test")
    yield engines, f"http://127.0.0.1:{port}"
    serve.delete("replicas_test")


def identities(engines) -> dict:
    """Ask until both replicas have answered (Serve picks a replica per call)."""
    seen = {}
    for _ in range(60):
        ident = engines.identity.remote().result(timeout_s=60)
        seen[ident.replica_id] = ident
        if len(seen) == 2:
            break
    return seen


def test_each_replica_has_its_own_nixl_port_core_and_engine_id(tiny_app):
    engines, _ = tiny_app
    seen = identities(engines)
    assert len(seen) == 2
    a, b = seen.values()
    assert a.nixl_port and b.nixl_port and a.nixl_port != b.nixl_port
    assert a.nixl_host == b.nixl_host == "127.0.0.1"
    assert a.cpu_cores and b.cpu_cores and a.cpu_cores != b.cpu_cores
    assert a.engine_id != b.engine_id


def test_both_replicas_stream_when_targeted(tiny_app):
    engines, _ = tiny_app
    replica_ids = list(identities(engines))

    async def stream(target: str) -> list:
        request = GenerateRequest(
            request_id=uuid.uuid4().hex,
            prompt="one two three four five",
            sampling=Sampling(max_tokens=8, ignore_eos=True),
            target_replica=target,
        )
        return [d async for d in engines.options(stream=True).generate.remote(request)]

    async def both():
        return await asyncio.gather(*(stream(r) for r in replica_ids))

    results = asyncio.run(both())
    for target, deltas in zip(replica_ids, results, strict=True):
        assert len(deltas) > 1, "expected a stream of several deltas"
        assert all(d.replica_id == target for d in deltas)
        assert deltas[-1].finished and deltas[-1].completion_tokens == 8


def test_minimal_http_ingress_lists_the_model(tiny_app):
    _, base = tiny_app
    models = httpx.get(f"{base}/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["tiny-llama"]
    assert httpx.get(f"{base}/health", timeout=30).status_code == 200
