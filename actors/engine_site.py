"""Where a replica and its engine run: the replica's place in Serve and Ray, its engine's cores, NIXL side channel and
KV event endpoints, and the environment the engine's processes inherit while they are spawned."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from configs.engine import EngineConfig

# ipc socket files of the engines' KV event publishers.
_EVENTS_DIR = tempfile.gettempdir()
_QUIET_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}


class ReplicaPlace(NamedTuple):
    """A replica's place in Serve: its id, its ranks in its deployment, the deployment and the app."""

    replica_id: str
    rank: int  # across all nodes
    local_rank: int  # on its node
    deployment: str
    app_name: str | None


def replica_place() -> ReplicaPlace:
    """This replica's place inside Serve; a fresh id, rank 0 and no app outside it."""
    try:
        from ray import serve

        ctx = serve.get_replica_context()
        return ReplicaPlace(ctx.replica_id.unique_id, ctx.rank.rank, ctx.rank.local_rank, ctx.deployment, ctx.app_name)
    except Exception:  # not running as a Serve replica (a test or benchmark constructing it directly)
        return ReplicaPlace(f"local-{uuid.uuid4().hex[:8]}", 0, 0, "engines", None)


def node_identity() -> tuple[str, str]:
    """(node id, node IP) from Ray when available, else this host on loopback."""
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()
    except Exception:
        pass
    return socket.gethostname(), "127.0.0.1"


@dataclass(frozen=True)
class EngineSite:
    """Where one engine runs: its id, its cores (CPU only), its NIXL side channel, its KV event endpoints."""

    engine_id: str
    cpu_cores: list[int] | None
    nixl_host: str | None
    nixl_port: int | None
    # (publish, replay) ZMQ endpoints of vLLM's KV cache events, or None when nothing listens to them.
    events_endpoints: tuple[str, str] | None


def choose_cores(config: EngineConfig, local_rank: int) -> list[int]:
    """The cores a replica with this local rank binds its model threads to (from the cores Ray gives it)."""
    cores = sorted(os.sched_getaffinity(0))
    threads = config.cpu_threads
    first = (config.cpu_core_offset + local_rank * threads) % len(cores)
    return [cores[(first + i) % len(cores)] for i in range(threads)]


@contextlib.contextmanager
def engine_process_env(site: EngineSite) -> Iterator[None]:
    """Environment the engine's processes inherit while they are spawned; this process's is restored after.

    vLLM's multiprocessing executor binds a worker's OpenMP threads itself (VLLM_CPU_OMP_THREADS_BIND). With the
    model in the engine-core process nothing in vLLM does, so this sets what that executor would set for a
    worker: the OpenMP master thread (the engine loop) and every thread it starts later stay on the replica's
    cores. The NIXL connector reads its side channel from the environment in those processes.
    """
    env = dict(_QUIET_ENV)
    if site.cpu_cores is not None:
        cores = [str(c) for c in site.cpu_cores]
        env |= {
            "VLLM_CPU_OMP_THREADS_BIND": ",".join(cores),
            "OMP_NUM_THREADS": str(len(cores)),
            "GOMP_CPU_AFFINITY": " ".join(cores),
            "KMP_AFFINITY": f"granularity=fine,explicit,proclist=[{','.join(cores)}]",
        }
    if site.nixl_host is not None:
        env |= {"VLLM_NIXL_SIDE_CHANNEL_HOST": site.nixl_host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(site.nixl_port)}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def choose_site(
    config: EngineConfig, engine_id: str, local_rank: int, node_ip: str, is_cpu: bool, report_events: bool
) -> EngineSite:
    """The site of a replica's engine: cores by its local rank (CPU only), a NIXL side channel on its node's IP and a
    free port unless the config names them, and KV event endpoints when `report_events` and prefix caching is on."""
    nixl = config.nixl
    nixl_host = (nixl.side_channel_host or node_ip) if nixl.enabled else None
    return EngineSite(
        engine_id=engine_id,
        cpu_cores=choose_cores(config, local_rank) if is_cpu else None,
        nixl_host=nixl_host,
        nixl_port=(nixl.side_channel_port or free_port_range(nixl_host)) if nixl_host else None,
        events_endpoints=events_endpoints(engine_id) if report_events and config.enable_prefix_caching else None,
    )


def events_endpoints(engine_id: str) -> tuple[str, str]:
    """(publish, replay) ZMQ endpoints of an engine's KV events: ipc sockets on this host, where the replica's
    forwarder runs."""
    return f"ipc://{_EVENTS_DIR}/{engine_id}.pub", f"ipc://{_EVENTS_DIR}/{engine_id}.replay"


# Where side-channel ports are drawn from: above Ray's worker ports (10002-19999 by default), below the kernel's
# ephemeral range. A port the kernel hands out (bind to 0) is free now, but the engine binds it only after its
# start-up (seconds), and meanwhile any outgoing connection may take it: vLLM's handshake listener then fails to
# bind and the engine waits for it forever (seen once in the test suite).
SIDE_CHANNEL_PORTS = (20000, 32767)


_handed_out: set[tuple[str, int]] = set()


def free_port_range(host: str, count: int = 1, ports: tuple[int, int] = SIDE_CHANNEL_PORTS, tries: int = 200) -> int:
    """The first of `count` consecutive ports free on `host` now, from `ports` less the kernel's ephemeral range,
    for a server that binds them later; never the same port twice in one process."""
    low, high = ports
    ephemeral = _ephemeral_ports()
    if ephemeral is not None:
        high = min(high, ephemeral[0] - 1)
    firsts = range(low, high - count + 2)
    for first in random.sample(firsts, min(tries, len(firsts))):
        wanted = [(host, port) for port in range(first, first + count)]
        if _handed_out.intersection(wanted):
            continue
        try:
            with contextlib.ExitStack() as stack:
                for _, port in wanted:
                    stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)).bind((host, port))
        except OSError:
            continue
        _handed_out.update(wanted)
        return first
    raise RuntimeError(f"no {count} consecutive free ports on {host} in {low}-{high}")


def _ephemeral_ports() -> tuple[int, int] | None:
    """The kernel's range for outgoing connections' local ports (Linux), else None."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    except OSError:
        return None
    return int(low), int(high)
