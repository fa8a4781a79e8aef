"""The control plane at fleet scale: the real ingress, KV directory actor and the ingress's mirror of it over many
simulated replicas (`engine.kind: sim`), loaded to a million directory blocks and more.

    python -m benchmarks.control_plane --replicas 64 --out benchmarks/results/control_plane.json

The blocks come from driving conversations through the real ingress: each first turn is a fresh prompt of nearly the
whole context, which the planner places, a simulated replica prefills in the H100 profile's time (times
`--dilation`), and whose blocks reach the directory as that replica's vLLM KV events, and the ingress's mirror through
the directory's change feed. Then follow-up turns of those conversations (whose plans look up long cached chains) are
run for the plan times. Measured: the planner's time per turn (the ingress's own `plan_ms`, last 1024 turns, and its
planning thread's CPU time for them, `plan_cpu_ms`, which leaves out waits for a saturated machine's cores), the lag
from a turn's end to its blocks planning as a local hit on the ingress (probes through `Ingress.plan`, throughout), the
growth of the directory's and the ingress's process memory per million blocks (the ingress's growth bounds its
mirror's), KV block events the directory absorbed per second while loading, and each simulated replica process's
memory and start-up CPU. Prompts are seeded; placement follows the replicas' real timing.

What explains those figures is measured beside them: the cores each role used (simulated replicas, ingress,
directory, driver, Ray's daemons) while loading and while planning, the share of plans whose thread was preempted
or waited, the garbage collector's passes in the ingress and the directory, and the mirror's bytes by type. The app
runs Serve's request path as `make serve` does, and the simulated replicas at nice 10 by default: they stand in for
GPU engines, whose work a fleet does not run on its control plane's cores (`--simulator-nice 0` shares the cores
equally; their KV-event forwarding, part of the control plane, then runs at that priority too).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import start_app, stop_app, write_result
from benchmarks.engine_priority import set_nice

SIM_PROFILE = "h100-llama-3.1-8b"
MODEL = "tiny-llama"
MAX_MODEL_LEN = 4096
FIRST_TOKENS = MAX_MODEL_LEN - 256  # a first turn's prompt: room left for a follow-up's 128 new tokens and reply
REPLY = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
PROBE_TOKENS = 512
TARGETS = {"plan_ms_p99": 2.0, "feed_lag_ms_p99": 100.0, "directory_mb_per_m_blocks": 150.0,
           "mirror_mb_per_m_blocks": 150.0}
MB = 1e6
# Shared int objects: a driver's prompt token costs a pointer, not an int (thousands of 4k-token histories).
_TOKENS = list(range(32_000))


def meminfo() -> dict[str, int]:
    """/proc/meminfo's figures, in bytes."""
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        out[key] = int(value.split()[0]) * 1024
    return out


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def object_bytes(holder: str, attributes: tuple[str, ...]) -> Any:
    """Run in a Serve replica's process (`__ray_call__`): the bytes CPython allocated for the objects reachable from
    each named attribute of the process's one `holder` instance (the mirror's copy of the directory, the actor's
    directory and change log), each object counted once, rounded up as pymalloc does. What the process's RSS adds
    beyond them is the heap's growth around them (allocator arenas, serving's transient objects), not their size."""
    import gc
    import sys
    import types

    gc.unfreeze()  # Serve freezes what a replica made at start (its mirror too) out of gc.get_objects()' sight
    owner = next(o for o in gc.get_objects() if type(o).__name__ == holder)
    opaque = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)
    seen: set[int] = set()
    sizes: dict[str, Any] = {}
    by_type: dict[str, int] = {}
    for name in attributes:
        total, stack = 0, [getattr(owner, name)]
        while stack:
            obj = stack.pop()
            if id(obj) in seen or isinstance(obj, opaque):
                continue
            seen.add(id(obj))
            size = (sys.getsizeof(obj) + 15) & ~15
            total += size
            by_type[type(obj).__name__] = by_type.get(type(obj).__name__, 0) + size
            stack.extend(gc.get_referents(obj))
        sizes[name] = total
    sizes["by_type"] = dict(sorted(by_type.items(), key=lambda kv: -kv[1])[:6])
    return sizes


def replica_actor(deployment: str) -> Any:
    import ray
    from ray._private.state import actors

    name = next(a["Name"] for a in actors(actor_state_name="ALIVE").values()
                if a["ActorClassName"].endswith(f":{deployment}"))
    return ray.get_actor(name, namespace="serve")


def replica_object_bytes(deployment: str, holder: str, attributes: tuple[str, ...]) -> dict[str, Any]:
    import ray

    actor = replica_actor(deployment)
    return ray.get(actor.__ray_call__.remote(lambda _replica: object_bytes(holder, attributes)))


def time_collections() -> None:
    """Run in a Serve replica's process: from now on, time each of the garbage collector's passes by generation,
    on the clock and in CPU time of the thread that ran it (a pass waits for a saturated machine's cores too)
    (`collection_pauses` reads them)."""
    import gc
    import time

    pauses: dict[int, list[tuple[float, float]]] = {0: [], 1: [], 2: []}
    started = [0.0, 0.0]

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started[:] = time.perf_counter(), time.thread_time()
        else:
            pauses[info["generation"]].append(((time.perf_counter() - started[0]) * 1e3,
                                               (time.thread_time() - started[1]) * 1e3))

    gc.callbacks.append(callback)
    gc.collection_pauses = pauses  # type: ignore[attr-defined]  # where `collection_pauses` finds them


def collection_pauses() -> dict[str, Any]:
    """Run where `time_collections` ran: per generation, the passes since, their total and longest time (ms), on the
    clock and in CPU time."""
    import gc

    out = {}
    for g, passes in gc.collection_pauses.items():  # type: ignore[attr-defined]
        wall, cpu = [w for w, _ in passes], [c for _, c in passes]
        out[f"gen{g}"] = {"count": len(passes), "total_ms": round(sum(wall), 1),
                          "max_ms": round(max(wall, default=0.0), 1), "cpu_total_ms": round(sum(cpu), 1),
                          "cpu_max_ms": round(max(cpu, default=0.0), 1)}
    return out


def on_replica(deployment: str, fn: Any) -> Any:
    import ray

    return ray.get(replica_actor(deployment).__ray_call__.remote(lambda _replica: fn()))


def machine_busy_s() -> float:
    """CPU seconds all cores of the machine spent busy since boot (/proc/stat: all but idle and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def ray_daemon_pids() -> list[int]:
    """This machine's Ray daemons (GCS server and raylet: the run's local cluster)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() in ("gcs_server", "raylet"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def cpu_by_role(roles: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds so far of each role's processes, and of the whole machine ("machine")."""
    def used(pid: int) -> float:
        try:
            return cpu_s(pid)
        except OSError:  # ended meanwhile
            return 0.0
    return {role: sum(used(p) for p in pids) for role, pids in roles.items()} | {"machine": machine_busy_s()}


def cores_used(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    """Cores each role kept busy between two `cpu_by_role` readings `seconds` apart; "other": the machine's busy
    time none of the roles accounts for (Serve's controller and proxy, Ray's other processes, the kernel)."""
    used = {role: (after[role] - before[role]) / seconds for role in after}
    used["other"] = used["machine"] - sum(v for role, v in used.items() if role != "machine")
    return {role: round(v, 2) for role, v in used.items()}


def maps_library(pid: int, name: str) -> bool:
    return name in Path(f"/proc/{pid}/maps").read_text()


class MemoryGuard:
    """Samples the machine's memory every second; `tripped` once less than `floor` bytes are available (the run
    then stops before the machine swaps or kills its neighbours)."""

    def __init__(self, floor: int) -> None:
        self.floor, self.tripped = floor, False
        self.start_used = self.peak_used = self._used()
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    @staticmethod
    def _used() -> int:
        info = meminfo()
        return info["MemTotal"] - info["MemAvailable"]

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            used = self._used()
            self.peak_used = max(self.peak_used, used)
            if meminfo()["MemAvailable"] < self.floor:
                self.tripped = True

    def check(self) -> None:
        if self.tripped:
            raise MemoryError(f"less than {self.floor / 2**30:.1f} GiB of memory left: stopped the run")

    def stop(self) -> None:
        self._stop.set()


def actor_pids(deployment: str) -> list[int]:
    """The pids of the live replicas of one of the app's deployments (Ray's actor table, from its GCS: no
    dashboard here)."""
    from ray._private.state import actors

    return [a["Pid"] for a in actors(actor_state_name="ALIVE").values()
            if a["ActorClassName"].endswith(f":{deployment}")]


def serve_pids() -> dict[str, int]:
    """The pids of the app's (one) ingress and directory replicas."""
    pids = {role: actor_pids(role) for role in ("ingress", "kv_directory")}
    if any(len(found) != 1 for found in pids.values()):
        raise RuntimeError(f"expected one ingress and one directory replica, found {pids}")
    return {role: found[0] for role, found in pids.items()}


def replica_processes(stats: dict[str, Any], started_s: float) -> dict[str, Any]:
    """Memory and CPU of each simulated replica's process, and whether vLLM or torch is in it."""
    pids = [r["pid"] for r in stats["replicas"]]
    sizes, cpus = [rss(p) for p in pids], [cpu_s(p) for p in pids]
    return {"count": len(pids), "rss_mb_mean": round(sum(sizes) / len(sizes) / MB, 1),
            "rss_mb_max": round(max(sizes) / MB, 1), "cpu_s_mean_after_start": round(sum(cpus) / len(cpus), 2),
            "torch_loaded": any(maps_library(p, "libtorch") for p in pids),
            "vllm_loaded": any(maps_library(p, "/vllm/") for p in pids), "fleet_start_s": round(started_s, 1)}


def exit_on_sigterm() -> None:
    """A `timeout` that ends the run unwinds it (its `finally` stops Ray) instead of leaving the cluster behind."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


class Driver:
    """Turns through the ingress handle, `concurrency` at a time, and feed-lag probes beside them."""

    def __init__(self, app: Any, args: argparse.Namespace, guard: MemoryGuard) -> None:
        self.app, self.args, self.guard = app, args, guard
        self.rng = random.Random(args.seed)
        self.vocab = _TOKENS[40:min(app.vocab_size, len(_TOKENS))]
        self.histories: list[list[int]] = []
        self.lags_ms: list[float] = []
        self.probe_misses = 0
        self.turns = 0

    def tokens(self, n: int) -> list[int]:
        return [self.rng.choice(self.vocab) for _ in range(n)]

    async def run_turns(self, prompts: Any, until: Any) -> None:
        async def worker() -> None:
            for prompt in prompts:
                if until():
                    return
                answer = await self.app.ingress.turn.remote(prompt, REPLY)
                self.histories.append(prompt + answer.token_ids)
                self.turns += 1

        await asyncio.gather(*(worker() for _ in range(self.args.concurrency)))

    async def probe(self, stop: asyncio.Event) -> None:
        """Every half second: a fresh prompt's turn (round robin: it leaves no hold, so only the replica's KV events
        can tell), then how long until the ingress plans its follow-up as a hit on that replica."""
        full_blocks = (PROBE_TOKENS + REPLY["max_tokens"] - 1) // self.args.block_size
        while not stop.is_set():
            prompt = self.tokens(PROBE_TOKENS)
            answer = await self.app.ingress.turn.remote(prompt, REPLY, policy="round_robin")
            done = time.monotonic()
            follow_up, where = prompt + answer.token_ids + self.tokens(8), [answer.kvrelay.replica]
            while True:
                plan = await self.app.ingress.plan.remote(follow_up, where)
                waited = time.monotonic() - done
                if plan["mode"] == "local" and plan["reused_tokens"] >= full_blocks * self.args.block_size:
                    self.lags_ms.append(waited * 1e3)
                    break
                if waited > 5.0:
                    self.probe_misses += 1
                    break
                await asyncio.sleep(0.002)
            await asyncio.sleep(0.5)

    async def directory_blocks(self) -> int:
        return (await self.app.ingress.stats.remote())["directory"]["resident_blocks"]


async def load_and_measure(
    app: Any, args: argparse.Namespace, guard: MemoryGuard, roles: dict[str, list[int]]
) -> dict[str, Any]:
    drive = Driver(app, args, guard)
    stop_probes = asyncio.Event()
    probes = asyncio.get_running_loop().create_task(drive.probe(stop_probes))
    blocks = {"now": await drive.directory_blocks()}
    started, start_blocks = time.monotonic(), blocks["now"]
    cpu_at_start = cpu_by_role(roles)

    async def watch() -> None:
        while blocks["now"] < args.blocks:
            guard.check()
            if time.monotonic() - started > args.load_limit_s:  # measure at the size reached (the file says it)
                print(f"  load stopped at {args.load_limit_s} s with {blocks['now']} blocks", flush=True)
                return
            await asyncio.sleep(1.0)
            blocks["now"] = await drive.directory_blocks()
            print(f"  {time.monotonic() - started:6.1f} s  {drive.turns} turns  {blocks['now']} blocks", flush=True)

    first_turns = (drive.tokens(FIRST_TOKENS) for _ in range(10**9))
    watcher = asyncio.get_running_loop().create_task(watch())
    await asyncio.gather(drive.run_turns(first_turns, lambda: blocks["now"] >= args.blocks or watcher.done()),
                         watcher)
    load_s = time.monotonic() - started
    cpu_loaded = cpu_by_role(roles)
    loaded = await app.ingress.stats.remote()
    absorbed = loaded["directory"]["resident_blocks"] - start_blocks
    load_turns = drive.turns
    # Follow-ups of the loaded conversations: their plans walk long cached chains in a mirror of a million blocks.
    picks = random.Random(args.seed + 1).sample(drive.histories, min(args.plan_turns, len(drive.histories)))
    follow_ups = (h + drive.tokens(128) for h in picks)
    measured = time.monotonic()
    await drive.run_turns(follow_ups, lambda: False)
    follow_s = time.monotonic() - measured
    cpu_followed = cpu_by_role(roles)
    stop_probes.set()
    await probes
    stats = await app.ingress.stats.remote()
    return {"stats": stats, "load_s": load_s, "absorbed_blocks": absorbed, "load_turns": load_turns,
            "follow_up_turns": drive.turns - load_turns, "follow_up_s": follow_s, "lags_ms": drive.lags_ms,
            "probe_misses": drive.probe_misses,
            "cores": {"load": cores_used(cpu_at_start, cpu_loaded, load_s),
                      "follow_ups": cores_used(cpu_loaded, cpu_followed, follow_s)}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=1_050_000, help="directory blocks to load before measuring")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dilation", type=float, default=0.25, help="real seconds per modelled second")
    parser.add_argument("--concurrency", type=int, default=24)
    parser.add_argument("--plan-turns", type=int, default=1200, help="follow-up turns whose plans are timed")
    parser.add_argument("--load-limit-s", type=float, default=420)
    parser.add_argument("--min-free-gib", type=float, default=3.0, help="stop if less memory than this is left")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve-mode", choices=["default", "throughput_optimized"], default="throughput_optimized",
                        help="Ray Serve's request path; throughput_optimized as `make serve` runs it (user code on the "
                             "replica's own event loop, no second Python thread taking the GIL from the planner)")
    parser.add_argument("--simulator-nice", type=int, default=10,
                        help="nice value of the simulated replicas' processes: they stand in for GPU engines, whose "
                             "work a fleet does not run on its control plane's cores (0: share them equally)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/control_plane.json"))
    args = parser.parse_args(argv)
    exit_on_sigterm()
    guard = MemoryGuard(int(args.min_free_gib * 2**30))
    print(f"memory used before start: {guard.start_used / 2**30:.1f} GiB", flush=True)
    engine = {"kind": "sim", "sim_profile": SIM_PROFILE, "sim_dilation": args.dilation, "max_model_len": MAX_MODEL_LEN,
              "block_size": args.block_size}
    began = time.monotonic()
    app = start_app(model=MODEL, num_replicas=args.replicas, pool={"num_cpus": 0.05, "engine": engine},
                    app={"ingress_num_cpus": 0.1}, throughput_optimized=args.serve_mode == "throughput_optimized")
    try:
        fleet_start_s = time.monotonic() - began
        app.ingress.calibrated.remote().result(timeout_s=300)
        guard.check()
        idle = app.ingress.stats.remote().result()
        pids = serve_pids()
        processes = replica_processes(idle, fleet_start_s)
        print(f"{args.replicas} replicas up in {fleet_start_s:.0f} s: {processes}", flush=True)
        set_nice([replica["pid"] for replica in idle["replicas"]], args.simulator_nice)
        before = {role: rss(pid) for role, pid in pids.items()}
        for deployment in ("ingress", "kv_directory"):
            on_replica(deployment, time_collections)
        roles = {"simulated_replicas": [r["pid"] for r in idle["replicas"]], "ingress": [pids["ingress"]],
                 "kv_directory": [pids["kv_directory"]], "driver": [os.getpid()], "ray_daemons": ray_daemon_pids()}
        run = asyncio.run(load_and_measure(app, args, guard, roles))
        after = {role: rss(pid) for role, pid in pids.items()}
        collections = {deployment: on_replica(deployment, collection_pauses)
                       for deployment in ("ingress", "kv_directory")}
        objects = {"mirror": replica_object_bytes("ingress", "DirectoryMirror", ("_copy",)),
                   "kv_directory": replica_object_bytes("kv_directory", "KVDirectoryActor", ("_directory", "_log"))}
    finally:
        guard.stop()
        stop_app(app)
    stats, directory = run["stats"], run["stats"]["directory"]
    blocks = directory["resident_blocks"]
    per_m = {role: (after[role] - before[role]) / MB / (blocks / 1e6) for role in after}
    lags = run["lags_ms"]
    result = {
        "replicas": args.replicas,
        "blocks": blocks,
        "plan_ms_p50": round(stats["plan_ms"]["p50"], 3),
        "plan_ms_p99": round(stats["plan_ms"]["p99"], 3),
        "feed_lag_ms_p99": round(pct(lags, 0.99), 1) if lags else None,
        "directory_mb_per_m_blocks": round(per_m["kv_directory"], 1),
        "mirror_mb_per_m_blocks": round(per_m["ingress"], 1),
        "events_per_s": round(run["absorbed_blocks"] / run["load_s"]),
        "targets": TARGETS,
        "setup": {"profile": SIM_PROFILE, "time_dilation": args.dilation, "model_tokenizer": MODEL,
                  "block_size": args.block_size, "max_model_len": MAX_MODEL_LEN, "first_turn_tokens": FIRST_TOKENS,
                  "reply": REPLY, "concurrency": args.concurrency, "seed": args.seed, "ingress_replicas": 1,
                  "serve_mode": args.serve_mode, "simulator_nice": args.simulator_nice,
                  "blocks_from": "first turns driven through the real ingress; their blocks reach the directory as "
                                 "the simulated replicas' vLLM KV events"},
        "plan_ms_samples": stats["plan_ms"]["samples"],
        # The ingress's planning thread's CPU time per plan: the planner's own cost, without the waits for cores
        # that a saturated machine adds to plan_ms.
        "plan_cpu_ms_p50": round(stats["plan_cpu_ms"]["p50"], 3),
        "plan_cpu_ms_p99": round(stats["plan_cpu_ms"]["p99"], 3),
        # Why a plan's wall time exceeds its CPU time: the share of plans whose thread waited (for the GIL, which
        # Serve's request thread in the ingress's process takes too) or was preempted (the cores given to another
        # process), and the wall times of the plans that ran through.
        "plan_switched": stats["plan_switched"],
        "feed_lag_ms_p50": round(pct(lags, 0.5), 1) if lags else None,
        # The feed's part of that lag: the actor logging an update to the mirror applying it (the mirror's last 1,024
        # answers that brought updates, the end of the run); the rest is the replica's events reaching the actor.
        "feed_lag_actor_to_mirror_ms": stats["mirror"]["lag_ms"],
        "feed_lag_probes": len(lags), "feed_lag_probe_misses_over_5s": run["probe_misses"],
        "feed_lag_measures": "a round-robin turn's end at the driver to the ingress planning its follow-up as a local "
                             "hit on that replica (Ingress.plan polled every ~2 ms through Ray: an upper bound)",
        "events_per_s_measures": "net resident blocks the directory added per second of load (block hashes of the "
                                 "replicas' BlockStored events, less any BlockRemoved)",
        "mirror_mb_measures": "growth of the ingress replica's process RSS while loading, which holds the mirror",
        # What those processes' RSS growth is made of: the bytes of the objects the mirror's copy, and the actor's
        # directory and change log, hold at the end (`object_bytes`), per 1M blocks.
        "objects_mb_per_m_blocks": {role: {name: round(n / MB / (blocks / 1e6), 1) for name, n in found.items()
                                           if name != "by_type"} for role, found in objects.items()},
        # The same by the objects' type (the six largest, all attributes together).
        "objects_by_type_mb_per_m_blocks": {role: {name: round(n / MB / (blocks / 1e6), 1)
                                                   for name, n in found["by_type"].items()}
                                            for role, found in objects.items()},
        # Where the machine's cores went while loading and while the follow-ups' plans were timed.
        "cores_used": run["cores"],
        # The garbage collector's passes in the ingress's and the directory's processes over the whole load: each
        # stops that process's Python threads (a full pass walks every tracked object, the mirror's too).
        "gc_passes": collections,
        "load": {"turns": run["load_turns"], "seconds": round(run["load_s"], 1),
                 "turns_per_s": round(run["load_turns"] / run["load_s"], 1)},
        "follow_ups": {"turns": run["follow_up_turns"], "seconds": round(run["follow_up_s"], 1)},
        "directory": {k: directory[k] for k in ("entries", "bytes", "holds", "resident_blocks", "chains_evicted",
                                                "resident_skipped", "feed_seq")},
        "directory_accounted_mb_per_m_blocks": round(directory["bytes"] / MB / (blocks / 1e6), 1),
        "rss_mb": {role: {"before": round(before[role] / MB), "after": round(after[role] / MB)} for role in after},
        "replica_process": processes,
        "machine_memory_gib": {"used_at_start": round(guard.start_used / 2**30, 2),
                               "peak_used": round(guard.peak_used / 2**30, 2)},
        "seconds": round(time.monotonic() - began, 1),
    }
    result["targets_met"] = {f"{k}<={v}": result[k] is not None and result[k] <= v for k, v in TARGETS.items()}
    written = write_result(args.out, result)
    print({k: written[k] for k in ("replicas", "blocks", "plan_ms_p50", "plan_ms_p99", "plan_cpu_ms_p99",
                                   "feed_lag_ms_p99", "directory_mb_per_m_blocks", "mirror_mb_per_m_blocks",
                                   "events_per_s", "targets_met")})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
