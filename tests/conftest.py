"""Shared fixtures: one Ray cluster per session, and in-process engine replicas on a background event loop."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

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
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=512 * 1024**2,
        _temp_dir=temp_dir,
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}},
    )
    yield ray
    try:
        from ray import serve

        serve.shutdown()
    except Exception:
        pass
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)
