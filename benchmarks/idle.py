"""What the app started as `make serve` starts it costs while nobody uses it: cores per process, every 10 s.

Starts `app.serve_progress` with the committed serve_config.yaml and the Makefile's SERVE_ENV (only the ports moved
to free ones). From /health's first 200 with both replicas it samples every process of the app's session (psutil's
cpu_times) for `--idle-s`, noting when `make serve` prints "ready" (the start-up calibration has run); then it sends a
burst of multi-turn chats over the OpenAI endpoint (conversations in parallel; every other one asks for the
`fixed_threshold` policy, so the burst surely pulls) and samples again for `--after-s` from the last answer.
kvrelay's own processes (engine replicas and their vLLM engine processes, as /kvrelay/stats reports their pids; the
ingress and the directory, Serve replica actors) are summed apart from Ray's and Serve's; each window also lists the
threads of kvrelay's processes that used CPU, by name, with their wake-ups (/proc/PID/task/TID), so a cause shows in
the result.

    python -m benchmarks.idle [--idle-s 300] [--after-s 120] [--out benchmarks/results/idle.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import psutil

from benchmarks.common import RESULTS_DIR, write_result
from benchmarks.served import REPLICAS, healthy, ready, start_served, stop_served, wait_for

WINDOW_S = 10.0
# The target: kvrelay's own processes together, in every window from this long after ready or the last answer.
TARGET_CORES = 0.05
TARGET_AFTER_S = 30.0
# Threads listed per window: those that used at least this share of a core.
THREAD_FLOOR_CORES = 0.001
APP = "kvrelay"


def session_pids(sid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def ray_label(cmdline: list[str]) -> str:
    """A short name for one of Ray's or Serve's processes."""
    if not cmdline:
        return "?"
    if cmdline[0].startswith("ray::"):
        return cmdline[0].split(".", 1)[0]
    for part in cmdline:
        if part.endswith((".py", "gcs_server", "raylet")) or part.startswith("app."):
            return Path(part).name
    return Path(cmdline[0]).name


def kvrelay_processes(base: str, sid: int) -> dict[int, str]:
    """pid -> label of kvrelay's own processes: each engine replica and its engine processes (as the replicas report
    them), the ingress and the directory (Serve replica actors of the app)."""
    deadline = time.monotonic() + 60
    while True:  # each replica's pids reach the ingress with its heartbeats
        replicas = httpx.get(f"{base}/kvrelay/stats", timeout=30).json()["replicas"]
        if (len(replicas) == REPLICAS and all(r.get("pid") and r.get("engine_pids") for r in replicas)) \
                or time.monotonic() > deadline:
            break
        time.sleep(1)
    found: dict[int, str] = {}
    for n, replica in enumerate(sorted(replicas, key=lambda r: r["replica_id"])):
        found[replica["pid"]] = f"engine replica {n}"
        for k, pid in enumerate(replica["engine_pids"]):
            found[pid] = f"engine process {n}" + (f".{k}" if k else "")
    for pid in session_pids(sid):
        try:
            cmdline = " ".join(psutil.Process(pid).cmdline())
        except psutil.Error:
            continue
        for deployment in ("ingress", "kv_directory"):
            if f"ServeReplica:{APP}:{deployment}" in cmdline and pid not in found:
                found[pid] = deployment
    return found


def thread_times(pid: int) -> dict[int, tuple[str, int, int]]:
    """tid -> (thread name, nanoseconds on a CPU, voluntary context switches, i.e. wake-ups) for every thread of
    `pid` (/proc's schedstat: finer than cpu_times' clock ticks)."""
    found = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tids:
        task = Path(f"/proc/{pid}/task/{tid}")
        try:
            name = (task / "comm").read_text().strip()
            ns = int((task / "schedstat").read_text().split()[0])
            status = (task / "status").read_text()
        except (OSError, ValueError, IndexError):
            continue
        wakeups = int(status.split("voluntary_ctxt_switches:", 1)[1].split()[0])
        found[int(tid)] = (name, ns, wakeups)
    return found


class Sample(NamedTuple):
    at: float
    cpu: dict[int, float]  # pid -> user + system seconds
    threads: dict[int, dict[int, tuple[str, int, int]]]  # kvrelay pid -> its threads' times


class Meter:
    """Cores per process between samples, for kvrelay's processes and the rest of the app's session."""

    def __init__(self, kvrelay: dict[int, str], sid: int) -> None:
        self.kvrelay = kvrelay
        self.sid = sid
        self.processes: dict[int, psutil.Process] = {}
        self.labels: dict[int, str] = dict(kvrelay)

    def sample(self) -> Sample:
        for pid in session_pids(self.sid):
            if pid not in self.processes:
                try:
                    process = psutil.Process(pid)
                    self.processes[pid] = process
                    self.labels.setdefault(pid, ray_label(process.cmdline()))
                except psutil.Error:
                    continue
        cpu = {}
        for pid, process in self.processes.items():
            try:
                times = process.cpu_times()
                cpu[pid] = times.user + times.system
            except psutil.Error:
                continue
        return Sample(time.monotonic(), cpu, {pid: thread_times(pid) for pid in self.kvrelay})

    def window(self, before: Sample, after: Sample, since_s: float) -> dict[str, Any]:
        span = after.at - before.at
        cores = {pid: (after.cpu[pid] - before.cpu.get(pid, 0.0)) / span for pid in after.cpu}
        own = {f"{self.labels[pid]} ({pid})": round(c, 4) for pid, c in cores.items() if pid in self.kvrelay}
        others: dict[str, float] = {}
        for pid, c in cores.items():
            if pid not in self.kvrelay:
                others[self.labels[pid]] = others.get(self.labels[pid], 0.0) + c
        threads = []
        for pid, now in after.threads.items():
            then = before.threads.get(pid, {})
            for tid, (name, ns, wakeups) in now.items():
                _, ns_then, wakeups_then = then.get(tid, (name, 0, 0))
                used = (ns - ns_then) / 1e9 / span
                if used >= THREAD_FLOOR_CORES:
                    threads.append({"process": self.labels[pid], "thread": name, "tid": tid, "cores": round(used, 4),
                                    "wakeups_per_s": round((wakeups - wakeups_then) / span, 1)})
        return {
            "from_s": round(since_s, 1), "seconds": round(span, 2),
            "kvrelay_cores": round(sum(c for pid, c in cores.items() if pid in self.kvrelay), 4),
            "ray_serve_cores": round(sum(others.values()), 4),
            "kvrelay": own,
            "ray_serve": {k: round(v, 4) for k, v in sorted(others.items(), key=lambda kv: -kv[1]) if v >= 0.001},
            "kvrelay_threads": sorted(threads, key=lambda t: -t["cores"]),
        }


def measure(meter: Meter, start: float, seconds: float, label: str,
            watch: Any = None) -> tuple[list[dict[str, Any]], float | None]:
    """Windows of WINDOW_S from `start` (time.monotonic) for `seconds`, printed as they end; and, with `watch` (a
    check polled every 0.5 s meanwhile), the seconds from `start` at which it first held (None: not within them)."""
    windows: list[dict[str, Any]] = []
    seen: float | None = None
    previous = meter.sample()
    while previous.at - start < seconds - 1e-3:
        end = start + WINDOW_S * (len(windows) + 1)
        while (left := end - time.monotonic()) > 0:
            if watch is not None and seen is None and watch():
                seen = time.monotonic() - start
            time.sleep(min(left, 0.5) if watch is not None and seen is None else left)
        now = meter.sample()
        window = meter.window(previous, now, previous.at - start)
        windows.append(window)
        top = ", ".join(f"{t['process']}/{t['thread']} {t['cores']:.3f}" for t in window["kvrelay_threads"][:4])
        print(f"{label} {window['from_s']:6.1f} s: kvrelay {window['kvrelay_cores']:.4f} cores, Ray/Serve "
              f"{window['ray_serve_cores']:.4f}; {top}", flush=True)
        previous = now
    return windows, seen


# Multi-turn chats: each conversation a long system prompt of its own and a few user turns.
TOPICS = ["rivers of Europe", "the history of printing", "how bridges carry loads", "growing tomatoes",
          "the planets of the solar system", "baking bread"]


async def chat_burst(base: str, model: str, conversations: int, turns: int, max_tokens: int) -> dict[str, Any]:
    """`conversations` chats of `turns` turns each, all at once. Every other conversation asks for the
    `fixed_threshold` policy (round robin, pulling the history from its holder), so the burst pulls whatever the
    default policy decides for the others."""
    latencies: list[float] = []

    async def converse(client: httpx.AsyncClient, n: int) -> None:
        topic = TOPICS[n % len(TOPICS)]
        system = f"You are a patient tutor on {topic}. " + " ".join(
            f"Rule {k}: answer about {topic} in plain words, give one example, and keep to the point." for k in
            range(40))
        messages = [{"role": "system", "content": system}]
        headers = {"x-kvrelay-policy": "fixed_threshold"} if n % 2 else {}
        for turn in range(turns):
            messages.append({"role": "user", "content": f"Question {turn + 1} about {topic}: tell me one more fact."})
            sent = time.monotonic()
            reply = await client.post(f"{base}/v1/chat/completions", headers=headers, json={
                "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}, timeout=600)
            reply.raise_for_status()
            latencies.append(time.monotonic() - sent)
            messages.append({"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"]})

    async with httpx.AsyncClient() as client:
        await asyncio.gather(*(converse(client, n) for n in range(conversations)))
    latencies.sort()
    return {"requests": len(latencies), "latency_s_p50": round(latencies[len(latencies) // 2], 3),
            "latency_s_max": round(latencies[-1], 3)}


def verdict(windows: list[dict[str, Any]], since_s: float) -> dict[str, Any]:
    """The target on the windows that start `since_s` + TARGET_AFTER_S - WINDOW_S or later (every window that ends
    more than TARGET_AFTER_S after `since_s`, or just at it)."""
    judged = [w for w in windows if w["from_s"] >= since_s + TARGET_AFTER_S - WINDOW_S - 0.5]
    worst = max((w["kvrelay_cores"] for w in judged), default=None)
    return {"from_s": round(since_s, 1), "worst_kvrelay_cores": worst,
            "met": worst is not None and worst <= TARGET_CORES, "windows_judged": len(judged)}


def stats_summary(base: str) -> dict[str, Any]:
    stats = httpx.get(f"{base}/kvrelay/stats", timeout=30).json()
    directory = stats["directory"]
    return {"counters": stats["counters"],
            "directory": {k: v for k, v in directory.items() if "hold" in k or k in ("entries", "replicas")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle-s", type=float, default=300.0, help="seconds measured from healthy")
    parser.add_argument("--after-s", type=float, default=120.0, help="seconds measured from the burst's last answer")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", default=str(RESULTS_DIR / "idle.json"))
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="kvidle"))
    started = time.monotonic()
    served = start_served(folder)
    try:
        wait_for(served, lambda: healthy(served), "healthy")
        healthy_at = time.monotonic()
        print(f"healthy {healthy_at - started:.0f} s after start", flush=True)
        meter = Meter(kvrelay_processes(served.base, served.proc.pid), served.proc.pid)
        after_start, ready_s = measure(meter, healthy_at, args.idle_s, "after healthy", watch=lambda: ready(served))
        if ready_s is None:
            wait_for(served, lambda: ready(served), "ready")
            ready_s = time.monotonic() - healthy_at
        print(f"ready (calibrated) {ready_s:.0f} s after healthy", flush=True)
        for window in after_start:
            window["calibrating"] = window["from_s"] < ready_s
        model = httpx.get(f"{served.base}/v1/models", timeout=30).json()["data"][0]["id"]
        before = stats_summary(served.base)
        burst = asyncio.run(chat_burst(served.base, model, args.conversations, args.turns, args.max_tokens))
        last = time.monotonic()
        after_burst, _ = measure(meter, last, args.after_s, "after burst")
        after = stats_summary(served.base)
    finally:
        stop_served(served)
    pulls = after["counters"].get("plans_pull", 0) - before["counters"].get("plans_pull", 0)
    result = {
        "what": "cores per process of the app started as `make serve` starts it, idle, in 10 s windows: from /health's "
                "first 200 with both replicas (the start-up calibration runs until 'ready'), and from the last answer "
                "of a burst of multi-turn chats",
        "target": {"kvrelay_cores_at_most": TARGET_CORES, "within_s": TARGET_AFTER_S,
                   "kvrelay_processes": "engine replicas, their engine processes, ingress, directory"},
        "healthy_after_s": round(healthy_at - started, 1),
        "ready_after_healthy_s": round(ready_s, 1),
        "processes": {str(pid): label for pid, label in meter.kvrelay.items()},
        "after_healthy": {"verdict_from_healthy": verdict(after_start, 0.0),
                          "verdict_from_ready": verdict(after_start, ready_s), "windows": after_start},
        "burst": {**burst, "conversations": args.conversations, "turns": args.turns, "max_tokens": args.max_tokens,
                  "pulls": pulls, "before": before, "after": after},
        "after_burst": {"verdict": verdict(after_burst, 0.0), "windows": after_burst},
    }
    print("from healthy:", result["after_healthy"]["verdict_from_healthy"], "from ready:",
          result["after_healthy"]["verdict_from_ready"], "after burst:", result["after_burst"]["verdict"],
          f"({pulls} pulls in the burst)")
    write_result(args.out, result)

if __name__ == "__main__":
    main()
