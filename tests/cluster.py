"""A two-node Ray cluster on one machine: each node in its own Linux network namespace, joined by a veth pair.

    with TwoNodeCluster() as cluster:
        cluster.python("-m", "tests.two_nodes_driver", ...)   # a Ray driver on the head node

The head node and the worker node see only their own loopback and one end of the veth link, with private addresses
the harness assigns (10.R.S.1 and 10.R.S.2); nothing else is reachable from them and nothing outside can reach
them. Every process of either node (Ray's, Serve's, vLLM's) lives in one of the two namespaces, so `stop` ends
exactly those, by PID, then deletes the namespaces (and with them the link). Ray drivers must run inside the head's
namespace too (`python`, `popen`): the test process itself stays on the host's network.

The worker node's processes are pinned to the machine's last core (`taskset`), as a second machine would bring
cores of its own; the head keeps the others. Needs root and iproute2; `unavailable()` says why not.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
GCS_PORT = 6380


def unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None if they can."""
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` command is not installed"
    probe = f"kvrp{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class TwoNodeCluster:
    """Two network namespaces, a veth pair between them, a Ray head in one and a Ray worker node in the other."""

    def __init__(self, head_cpus: int = 4, worker_cpus: int = 1) -> None:
        tag = f"{os.getpid() % 100000}"
        self.namespaces = {"head": f"kvr{tag}h", "worker": f"kvr{tag}w"}
        self.links = {"head": f"kvr{tag}a", "worker": f"kvr{tag}b"}
        octets = (100 + os.getpid() % 100, os.getpid() // 100 % 250)
        self.ips = {"head": f"10.{octets[0]}.{octets[1]}.1", "worker": f"10.{octets[0]}.{octets[1]}.2"}
        self.address = f"{self.ips['head']}:{GCS_PORT}"
        self.cpus = {"head": head_cpus, "worker": worker_cpus}
        self.temp_dir = tempfile.mkdtemp(prefix="kvrn", dir="/tmp")
        self._nodes: dict[str, subprocess.Popen] = {}
        self._made: list[str] = []

    def __enter__(self) -> TwoNodeCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- the network --------------------------------------------------------------------------------------------

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    def _make_network(self) -> None:
        for ns in self.namespaces.values():
            self._ip("netns", "add", ns)
            self._made.append(ns)
        self._ip("link", "add", self.links["head"], "type", "veth", "peer", "name", self.links["worker"])
        for node, ns in self.namespaces.items():
            link = self.links[node]
            self._ip("link", "set", link, "netns", ns)
            self._ip("-n", ns, "addr", "add", f"{self.ips[node]}/24", "dev", link)
            self._ip("-n", ns, "link", "set", "lo", "up")
            self._ip("-n", ns, "link", "set", link, "up")

    # -- processes ----------------------------------------------------------------------------------------------

    def env(self, node: str) -> dict[str, str]:
        """The environment of every process on `node`: Ray on the namespace's address, offline, no usage data,
        UCX on TCP over the veth link (see the README, "Deploying")."""
        env = dict(os.environ)
        env.pop("RAY_ADDRESS", None)
        env.update({
            "PYTHONPATH": str(REPO_ROOT),
            # Ray refuses a second node unless this is 1; it then binds all of the namespace's addresses, which are
            # only its loopback and its end of the link.
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
            "RAY_AUTH_MODE": "disabled",
            "RAY_USAGE_STATS_ENABLED": "0",
            "VLLM_NO_USAGE_STATS": "1",
            "HF_HUB_OFFLINE": "1",
            # Two nodes on one machine could reach each other through shared memory; as on two machines, KV crosses the
            # link: UCX's TCP transport (plus `self` for loopback within a process), on the veth device.
            "UCX_TLS": "tcp,self",
            "UCX_NET_DEVICES": self.links[node],
        })
        return env

    def _command(self, node: str, args: list[str]) -> list[str]:
        pin = []
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) > 1:
            mine = cores[-1:] if node == "worker" else cores[:-1]
            pin = ["taskset", "-c", ",".join(map(str, mine))]
        return ["ip", "netns", "exec", self.namespaces[node], *pin, *args]

    def popen(self, node: str, args: list[str], **kwargs: Any) -> subprocess.Popen:
        """A process on `node` (in its namespace, with its environment), started from the repository root."""
        return subprocess.Popen(self._command(node, args), env=self.env(node), cwd=REPO_ROOT, **kwargs)

    def python(self, *args: str, node: str = "head", timeout: float = 600) -> subprocess.CompletedProcess:
        """Run this venv's python on `node` (a Ray driver on the head, by default); output captured as text."""
        return subprocess.run(self._command(node, [sys.executable, *args]), env=self.env(node), cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=timeout)

    def driver_json(self, *args: str, timeout: float = 600) -> Any:
        """Run a driver module on the head node and return the JSON it prints last; fails with its output."""
        done = self.python(*args, timeout=timeout)
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines:
            raise RuntimeError(f"{' '.join(args)} exited {done.returncode}\n{done.stdout[-4000:]}\n"
                               f"{done.stderr[-8000:]}")
        return json.loads(lines[-1])

    def pids(self, node: str) -> list[int]:
        """Every process in `node`'s namespace."""
        return self._pids_in(self.namespaces[node])

    def link_bytes(self) -> int:
        """Bytes that have crossed the link so far (received by either end)."""
        total = 0
        for node, ns in self.namespaces.items():
            out = subprocess.run(["ip", "-n", ns, "-j", "-s", "link", "show", "dev", self.links[node]],
                                 check=True, capture_output=True, text=True)
            total += json.loads(out.stdout)[0]["stats64"]["rx"]["bytes"]
        return total

    def _ray(self) -> str:
        return str(Path(sys.executable).with_name("ray"))

    def start(self, timeout_s: float = 180) -> None:
        self._make_network()
        common = ["--block", f"--temp-dir={self.temp_dir}", "--object-store-memory=268435456",
                  "--disable-usage-stats"]
        self._nodes["head"] = self.popen("head", [
            self._ray(), "start", "--head", f"--port={GCS_PORT}", f"--node-ip-address={self.ips['head']}",
            f"--num-cpus={self.cpus['head']}",
            "--include-dashboard=false", *common,
        ], stdout=self._log("head"), stderr=subprocess.STDOUT)
        self._wait_for_nodes(1, timeout_s)
        self._nodes["worker"] = self.popen("worker", [
            self._ray(), "start", f"--address={self.address}", f"--node-ip-address={self.ips['worker']}",
            f"--num-cpus={self.cpus['worker']}", *common,
        ], stdout=self._log("worker"), stderr=subprocess.STDOUT)
        self._wait_for_nodes(2, timeout_s)

    def _log(self, node: str) -> Any:
        return open(Path(self.temp_dir) / f"ray-start-{node}.log", "w")  # noqa: SIM115 (the node's process keeps it)

    def _wait_for_nodes(self, count: int, timeout_s: float) -> None:
        probe = (
            "import ray, json, sys\n"
            f"ray.init(address='{self.address}', logging_level='ERROR')\n"
            "print(json.dumps(sum(n['Alive'] for n in ray.nodes())))\n"
        )
        deadline = time.monotonic() + timeout_s
        while True:
            for node, proc in self._nodes.items():
                if proc.poll() is not None:
                    log = (Path(self.temp_dir) / f"ray-start-{node}.log").read_text()[-3000:]
                    raise RuntimeError(f"the Ray {node} node exited ({proc.returncode}) while starting:\n{log}")
            try:
                done = self.python("-c", probe, timeout=60)
                if done.returncode == 0 and int(done.stdout.strip().splitlines()[-1]) >= count:
                    return
            except (subprocess.TimeoutExpired, ValueError, IndexError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count} Ray node(s) did not come up in {timeout_s:.0f} s")
            time.sleep(1)

    def stop(self) -> None:
        """End every process in both namespaces (SIGTERM, then SIGKILL), delete them and the temp dir."""
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            pids = [p for ns in self._made for p in self._pids_in(ns)]
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait_s
            while pids and time.monotonic() < deadline:
                pids = [p for ns in self._made for p in self._pids_in(ns)]
                time.sleep(0.2)
        for proc in self._nodes.values():
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        for ns in self._made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _pids_in(self, ns: str) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]
