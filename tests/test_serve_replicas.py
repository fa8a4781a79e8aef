"""Two engine replicas in one Ray cluster behind Serve: own NIXL port and core each, both streaming."""

from __future__ import annotations

import asyncio
import uuid

import httpx

from actors.replica_api import GenerateRequest, Sampling
from configs.app import PoolConfig


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
    seen = identities(tiny_app.engines)
    assert len(seen) == 2
    a, b = seen.values()
    assert a.nixl_port and b.nixl_port and a.nixl_port != b.nixl_port
    assert a.nixl_host == b.nixl_host == "127.0.0.1"
    assert a.cpu_cores and b.cpu_cores and a.cpu_cores != b.cpu_cores
    assert a.engine_id != b.engine_id


def test_both_replicas_stream_when_targeted(tiny_app):
    engines = tiny_app.engines
    replica_ids = list(identities(engines))

    async def stream(target: str) -> list:
        request = GenerateRequest(
            request_id=uuid.uuid4().hex,
            prompt="one two three four five",
            params=Sampling(max_tokens=8, ignore_eos=True).to_params(),
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


def test_a_request_waits_for_the_replica_it_targets_rather_than_take_another_ones(tiny_app):
    """Serve's power-of-two router hands a replica found for one pending request to the oldest pending one (its FIFO
    mixin). So while the replica a turn targets is full, a later turn's replica went to it: the turn ran where it
    was not planned (without its cached history), and bursts of first turns planned on two replicas all ran on one."""
    engines = tiny_app.engines
    full, free = sorted(identities(engines))
    slots = PoolConfig().max_ongoing_requests  # the tiny app keeps the default

    streams = []

    async def run(target: str, max_tokens: int) -> str:
        request = GenerateRequest(
            request_id=uuid.uuid4().hex,
            prompt="one two three",
            params=Sampling(max_tokens=max_tokens, ignore_eos=True).to_params(),
            target_replica=target,
        )
        streams.append(stream := engines.options(stream=True).generate.remote(request))
        deltas = [d async for d in stream]
        return deltas[-1].replica_id

    async def scenario() -> list[str]:
        occupying = [asyncio.ensure_future(run(full, 400)) for _ in range(slots)]
        await asyncio.sleep(0.5)  # every slot of `full` is taken
        waiting = asyncio.ensure_future(run(full, 2))
        await asyncio.sleep(0.2)  # its routing is pending when the next request comes
        served = [await run(free, 2)]
        # One occupying turn cancelled frees a slot of `full` for the waiting turn (rather than 400 steps later);
        # then the others, whose engine requests end now.
        streams[0].cancel()
        served.append(await waiting)
        for stream in streams[1:slots]:
            stream.cancel()
        await asyncio.gather(*occupying, return_exceptions=True)
        return served

    assert asyncio.run(scenario()) == [free, full]


def test_minimal_http_ingress_lists_the_model(tiny_app):
    base = tiny_app.base_url
    models = httpx.get(f"{base}/v1/models", headers=tiny_app.headers, timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["tiny-llama"]
    assert httpx.get(f"{base}/health", timeout=30).status_code == 200
