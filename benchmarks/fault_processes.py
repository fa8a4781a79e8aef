"""The fault benchmark's reach into the app's processes: find a replica's process tree, a Serve deployment's
processes and the engines the app's replicas reported, and kill or signal them."""

from __future__ import annotations

import time

import psutil

from benchmarks.common import BenchApp


def app_engine_processes() -> list[psutil.Process]:
    """The vLLM engine processes of the app's live replicas, as they reported them (other apps' engines on this
    machine are not this app's)."""
    from ray import serve

    directory = serve.get_deployment_handle("kv_directory", app_name="bench")
    found = []
    for identity in directory.replica_identities.remote().result(timeout_s=30):
        for pid in identity.engine_pids:
            try:
                found.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                continue
    return found


def serve_replica_processes(deployment: str) -> list[psutil.Process]:
    """The processes of one of the app's Serve deployments (by the name Ray gives its replica actors)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or ())
        if f"ServeReplica:bench:{deployment}" in cmdline:
            found.append(proc)
    return found


def replica_tree(app: BenchApp, replica_id: str) -> list[psutil.Process]:
    """A replica's actor process and the engine processes it started (its pid as it reported to the directory)."""
    from ray import serve

    directory = serve.get_deployment_handle("kv_directory", app_name="bench")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = [i for i in directory.replica_identities.remote().result(timeout_s=30) if i.replica_id == replica_id]
        if found:
            replica = psutil.Process(found[0].pid)
            return replica.children(recursive=True) + [replica]
        time.sleep(0.5)  # a restarted directory waits for the replica's next heartbeat
    raise RuntimeError(f"replica {replica_id} is not registered")


def kill(processes: list[psutil.Process]) -> None:
    for proc in processes:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=30)


def signal_all(processes: list[psutil.Process], sig: int) -> None:
    for proc in processes:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass

