"""KV directory benchmark: lookup and record latency in-process and through a Ray actor call, and memory.

    python -m benchmarks.directory --out benchmarks/results/directory.json [--quick]

Loads N conversations of B full blocks (plus a partial block) as exported holds, then looks up their next
turn (hits) and unknown conversations (misses). Keys are hashed by the caller, as the planner does, and
hashing is reported on its own. Memory per entry is measured with tracemalloc on a separate load, and memory
per block again on a load shaped like a fleet's (`fleet_memory`: conversations' blocks reported as each
replica's prefix-cache store ops, as vLLM's KV events bring them, over `--replicas` replicas, with a pending hold
for one conversation in 30; `benchmarks.control_plane` measures the same through the real actors). Ray calls
go to the directory actor the app deploys (ingresses plan from their own mirror of it, so a lookup through Ray
is not on the per-turn path); a no-op call on an identical actor gives the floor.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
import tracemalloc
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from actors.kv_directory import KVDirectoryActor
from benchmarks.common import machine, write_result
from kvtransfer.directory_index.index import KVDirectory
from kvtransfer.directory_index.results import StoreResident
from kvtransfer.prefix_key import PrefixKey, Scope, chain_hashes, scope_seed
from kvtransfer.types import Hold, HoldId

SCOPE = Scope("bench-model", "bench-tenant")
VOCAB = 50_000
_TOKEN_POOL = list(range(VOCAB))  # shared int objects: a token costs a pointer, not an int, in memory
REPO_ROOT = Path(__file__).resolve().parents[1]


def conversation(index: int, num_tokens: int) -> list[int]:
    rng = random.Random(index)
    pool = _TOKEN_POOL
    return [pool[rng.randrange(VOCAB)] for _ in range(num_tokens)]


def kv_hold(index: int, blocks: int, num_tokens: int) -> Hold:
    """A hold as vLLM's bidirectional connector exports it for one finished turn."""
    return Hold(
        engine_id=f"engine-{index % 4}",
        host="127.0.0.1",
        port=5600 + index % 4,
        block_ids=[list(range(index * blocks, (index + 1) * blocks))],
        num_tokens=num_tokens,
        hold_id=HoldId(f"engine-{index % 4}", index),
        request_id=f"req-{index}",
        expiry_time=0.0,
        extra={"tp_size": 1},
    )


def keys(indices: range | list[int], num_tokens: int, block_size: int) -> Iterator[tuple[int, PrefixKey]]:
    for i in indices:
        yield i, PrefixKey.build(conversation(i, num_tokens), SCOPE, block_size)


def percentiles(samples_ns: list[int]) -> tuple[float, float]:
    """(p50, p99) in microseconds."""
    ordered = sorted(samples_ns)
    p50 = ordered[len(ordered) // 2]
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return p50 / 1e3, p99 / 1e3


def timed(fn: Callable[[], Any]) -> int:
    start = time.perf_counter_ns()
    fn()
    return time.perf_counter_ns() - start


def load_directory(directory: KVDirectory, args: argparse.Namespace, expires: float) -> list[int]:
    """Record every conversation as a hold; returns the per-record latencies (ns)."""
    samples = []
    for i, key in keys(range(args.conversations), args.tokens, args.block_size):
        replica, hold = f"r{i % 4}", kv_hold(i, args.blocks, args.tokens)
        samples.append(timed(lambda k=key, r=replica, h=hold: directory.record_hold(r, k, h, expires)))
    return samples


def query_keys(args: argparse.Namespace) -> list[PrefixKey]:
    """Next turns of sampled conversations (hits) and unknown conversations (misses), shuffled."""
    rng = random.Random(7)
    hits = rng.sample(range(args.conversations), args.query_hits)
    turn = [_TOKEN_POOL[rng.randrange(VOCAB)] for _ in range(args.new_turn_tokens)]
    queries = [key.extend(turn) for _, key in keys(hits, args.tokens, args.block_size)]
    misses = range(10**6, 10**6 + args.query_misses)
    queries += [key for _, key in keys(misses, args.tokens + args.new_turn_tokens, args.block_size)]
    rng.shuffle(queries)
    return queries


def bench_inproc(args: argparse.Namespace, queries: list[PrefixKey]) -> dict[str, Any]:
    directory = KVDirectory(args.block_size)
    expires = time.time() + 3600
    record_ns = load_directory(directory, args, expires)
    stats = directory.stats()
    lookup = directory.lookup
    for q in queries[:200]:
        lookup(q)  # warm up
    rounds = max(1, args.lookups // len(queries))
    start = time.perf_counter_ns()
    for _ in range(rounds):
        for q in queries:
            lookup(q)
    elapsed = time.perf_counter_ns() - start
    lookup_ns = [timed(lambda q=q: lookup(q)) for q in queries]
    raw = [(list(q.token_ids), q.scope) for q in queries[:500]]
    raw_start = time.perf_counter_ns()
    for tokens, scope in raw:
        lookup(tokens, scope)
    raw_elapsed = time.perf_counter_ns() - raw_start
    sample = conversation(3, args.tokens)
    full = PrefixKey.build(sample, SCOPE, args.block_size)
    hash_ns = [timed(lambda: PrefixKey.build(sample, SCOPE, args.block_size)) for _ in range(200)]
    turn = sample[: args.new_turn_tokens]
    extend_ns = [timed(lambda: full.extend(turn)) for _ in range(200)]
    hit_rate = sum(1 for q in queries if lookup(q).matches) / len(queries)
    directory.check_integrity() if args.check else None
    rec50, rec99 = percentiles(record_ns)
    look50, look99 = percentiles(lookup_ns)
    return {
        "entries": stats.entries,
        "holds": stats.holds,
        "accounted_bytes_per_entry": round(stats.bytes / stats.entries, 1),
        "lookup_inproc_ops_s": round(rounds * len(queries) / (elapsed / 1e9)),
        "lookup_inproc_us_p50": round(look50, 2),
        "lookup_inproc_us_p99": round(look99, 2),
        "lookup_inproc_query_hit_rate": round(hit_rate, 3),
        "lookup_inproc_from_token_ids_ops_s": round(len(raw) / (raw_elapsed / 1e9)),
        "record_inproc_ops_s": round(len(record_ns) / (sum(record_ns) / 1e9)),
        "record_inproc_us_p50": round(rec50, 2),
        "record_inproc_us_p99": round(rec99, 2),
        "hash_key_us_p50": round(percentiles(hash_ns)[0], 1),
        "extend_key_by_turn_us_p50": round(percentiles(extend_ns)[0], 1),
    }


def bench_memory(args: argparse.Namespace, _queries: list[PrefixKey]) -> dict[str, Any]:
    """tracemalloc growth of a loaded directory, per entry (keys' token tuples are freed as we go)."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    directory = KVDirectory(args.block_size)
    load_directory(directory, args, time.time() + 3600)
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    stats = directory.stats()
    gc_start = time.perf_counter()
    gc.collect()  # a full collection walks every node: the worst pause the directory's size can cause
    gc_ms = (time.perf_counter() - gc_start) * 1e3
    return {
        "bytes_per_entry": round(used / stats.entries, 1),
        "gc_full_collection_ms": round(gc_ms, 1),
        "directory_mib": round(used / 2**20, 1),
        "accounted_mib": round(stats.bytes / 2**20, 1),
    }


def fleet_conversation(index: int, blocks: int, block_size: int) -> tuple[list[int], list[bytes]]:
    """Conversation `index` of a fleet-shaped load: its tokens (`blocks` full blocks and half of one more) and its
    block hashes, fresh objects, as when unpickled from an event batch."""
    rng = random.Random(index)
    tokens = [_TOKEN_POOL[t % VOCAB] for t in array("H", rng.randbytes(2 * (blocks * block_size + block_size // 2)))]
    return tokens, chain_hashes(scope_seed(SCOPE, block_size), tokens, block_size)


def stored(hashes: list[bytes]) -> list[StoreResident]:
    """A prefill's blocks as vLLM's KV events report them: two store ops (a chunked prefill's two steps)."""
    half = len(hashes) // 2
    return [StoreResident(None, tuple(hashes[:half])), StoreResident(hashes[half - 1], tuple(hashes[half:]))]


def fleet_load(directory: KVDirectory, conversations: int, blocks: int, replicas: int, expires: float) -> None:
    """Store `conversations` conversations of `blocks` full blocks, each on one of `replicas` replicas (round robin),
    and record a pending hold for every 30th (the turn's KV exported for a pull). Blocks are held by one replica
    each, as in a fleet of distinct conversations."""
    bs = directory.block_size
    for i in range(conversations):
        tokens, hashes = fleet_conversation(i, blocks, bs)
        replica = f"replica-{i % replicas}"
        directory.apply_resident(replica, stored(hashes))
        if i % 30 == 0:
            key = PrefixKey.build(tokens, SCOPE, bs)
            directory.record_hold(replica, key, kv_hold(i, blocks, len(tokens)), expires, prompt_tokens=blocks * bs)


def serving_load(directory: KVDirectory, conversations: int, blocks: int, replicas: int, expires: float) -> None:
    """`fleet_load`'s conversations as serving records them: each turn's hold first (the ingress, as the turn ends),
    then its blocks (the replica's KV events), then the hold consumed (a pull): every block's full record is made and
    settles back into its cache segment, a delete and an insert in the block table."""
    bs = directory.block_size
    for i in range(conversations):
        tokens, hashes = fleet_conversation(i, blocks, bs)
        replica = f"replica-{i % replicas}"
        hold = kv_hold(i, blocks, len(tokens))
        directory.record_hold(replica, PrefixKey.build(tokens, SCOPE, bs), hold, expires, prompt_tokens=blocks * bs)
        directory.apply_resident(replica, stored(hashes))
        directory.consume_hold(hold.hold_id)


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def bench_fleet_memory(args: argparse.Namespace, _queries: list[PrefixKey]) -> dict[str, Any]:
    """Bytes per resident block of a fleet-shaped load: the process's RSS growth (as `benchmarks.control_plane`
    measures the actors), then tracemalloc's count on a second load, by the line that allocated it; and the bytes of
    the block table per block when the same conversations come as serving records them (`serving_load`)."""
    blocks_each = args.fleet_conversation_blocks
    conversations = args.fleet_blocks // blocks_each
    unbounded = {"max_entries": 10**9, "max_bytes": 2**62}
    gc.collect()
    before = rss_bytes()
    directory = KVDirectory(args.block_size, **unbounded)
    fleet_load(directory, conversations, blocks_each, args.replicas, time.time() + 3600)
    gc.collect()
    rss = rss_bytes() - before
    stats = directory.stats()
    gc_start = time.perf_counter()
    gc.collect()  # what the directory's objects cost a full collection (a pause in the actor's event loop)
    gc_ms = (time.perf_counter() - gc_start) * 1e3
    del directory
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    directory = KVDirectory(args.block_size, **unbounded)
    fleet_load(directory, conversations, blocks_each, args.replicas, time.time() + 3600)
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    snapshot = tracemalloc.take_snapshot()
    tracemalloc.stop()
    del directory
    gc.collect()
    serving = KVDirectory(args.block_size, **unbounded)
    serving_started = time.perf_counter()
    serving_load(serving, conversations, blocks_each, args.replicas, time.time() + 3600)
    serving_s = time.perf_counter() - serving_started
    blocks = stats.resident_blocks
    by_line = {}
    for stat in snapshot.statistics("lineno")[:12]:
        frame = stat.traceback[0]
        by_line[f"{Path(frame.filename).name}:{frame.lineno}"] = round(stat.size / blocks, 1)
    serving_blocks = serving.stats().resident_blocks
    return {
        "fleet_replicas": args.replicas,
        "fleet_blocks_per_conversation": blocks_each,
        "fleet_blocks": blocks,
        "fleet_holds": stats.holds,
        "fleet_rss_bytes_per_block": round(rss / blocks, 1),
        "fleet_traced_bytes_per_block": round(used / blocks, 1),
        "fleet_accounted_bytes_per_block": round(stats.bytes / blocks, 1),
        "fleet_gc_full_collection_ms": round(gc_ms, 1),
        "fleet_traced_bytes_per_block_by_line": by_line,
        # The same conversations as serving records them (`serving_load`): every block's record made and settled.
        "serving_blocks": serving_blocks,
        "serving_table_bytes_per_block": round(serving.table_bytes() / serving_blocks, 1),
        "serving_load_s": round(serving_s, 1),
    }


class NoopActor:
    """Same placement and call shape as the directory, no work: the Ray call's own floor on this box."""

    async def ping(self, key: PrefixKey | None = None) -> None:
        return None


def start_directory(ray: Any, block_size: int) -> Any:
    """The directory actor, with Ray's task events off for the calls measured here (they feed Ray's dashboard
    and cost about a fifth of a call's latency on this box)."""
    for method in ("lookup", "record_hold", "consume_hold", "apply_resident"):
        ray.method(enable_task_events=False)(getattr(KVDirectoryActor, method))
    options = {"name": "kvrelay-bench-directory", "namespace": "kvrelay-bench", "max_task_retries": 0, "num_cpus": 0.01}
    return ray.remote(KVDirectoryActor).options(**options).remote(block_size=block_size)


def init_ray() -> Any:
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ.pop("RAY_ADDRESS", None)
    import ray

    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=512 * 1024**2,
        _temp_dir=tempfile.mkdtemp(prefix="kvrb", dir="/tmp"),
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}},
        logging_level="WARNING",
    )
    return ray


def bench_ray(args: argparse.Namespace, queries: list[PrefixKey]) -> dict[str, Any]:
    ray = init_ray()
    try:
        handle = start_directory(ray, args.block_size)
        expires = time.time() + 3600
        ray.get(handle.stats.remote())
        sequential = min(args.ray_records, args.conversations)
        bulk = range(args.conversations - sequential)
        pending = []
        for i, key in keys(bulk, args.tokens, args.block_size):  # pipelined load, 64 calls in flight
            pending.append(handle.record_hold.remote(f"r{i % 4}", key, kv_hold(i, args.blocks, args.tokens), expires))
            if len(pending) >= 64:
                ray.get(pending)
                pending = []
        ray.get(pending)
        record_ns = []
        for i, key in keys(range(args.conversations - sequential, args.conversations), args.tokens, args.block_size):
            hold = kv_hold(i, args.blocks, args.tokens)
            record_ns.append(
                timed(lambda key=key, hold=hold: ray.get(handle.record_hold.remote("r0", key, hold, expires)))
            )
        noop = ray.remote(NoopActor).options(num_cpus=0.01).remote()
        for q in queries[:100]:
            ray.get([handle.lookup.remote(q), noop.ping.remote(q)])  # warm up

        lookup_ns, noop_ns, noop_key_ns = [], [], []
        for q in queries[: args.ray_lookups]:  # interleaved, so load swings hit all three alike
            lookup_ns.append(timed(lambda q=q: ray.get(handle.lookup.remote(q))))
            noop_ns.append(timed(lambda: ray.get(noop.ping.remote())))
            noop_key_ns.append(timed(lambda q=q: ray.get(noop.ping.remote(q))))
        start = time.perf_counter_ns()
        window = queries[: args.ray_lookups]
        for chunk in range(0, len(window), 32):  # 32 callers' worth of lookups in flight
            ray.get([handle.lookup.remote(q) for q in window[chunk : chunk + 32]])
        concurrent = len(window) / ((time.perf_counter_ns() - start) / 1e9)
        stats = ray.get(handle.stats.remote())
        ray.kill(handle)
    finally:
        ray.shutdown()
    look50, look99 = percentiles(lookup_ns)
    rec50, rec99 = percentiles(record_ns)
    return {
        "ray_entries": stats.entries,
        "lookup_ray_ms_p50": round(look50 / 1e3, 3),
        "lookup_ray_ms_p99": round(look99 / 1e3, 3),
        "noop_ray_call_ms_p50": round(percentiles(noop_ns)[0] / 1e3, 3),
        "noop_ray_call_with_key_ms_p50": round(percentiles(noop_key_ns)[0] / 1e3, 3),
        "lookup_ray_sequential_ops_s": round(len(lookup_ns) / (sum(lookup_ns) / 1e9)),
        "lookup_ray_32_in_flight_ops_s": round(concurrent),
        "record_ray_ms_p50": round(rec50 / 1e3, 3),
        "record_ray_ms_p99": round(rec99 / 1e3, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--conversations", type=int, default=10_000)
    parser.add_argument("--blocks", type=int, default=64, help="full blocks per conversation")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--lookups", type=int, default=100_000, help="in-process lookups timed")
    parser.add_argument("--ray-lookups", type=int, default=3_000)
    parser.add_argument("--ray-records", type=int, default=2_000, help="records timed one by one via Ray")
    parser.add_argument("--new-turn-tokens", type=int, default=40)
    parser.add_argument("--fleet-blocks", type=int, default=1_000_000, help="resident blocks of the fleet-shaped load")
    parser.add_argument("--fleet-conversation-blocks", type=int, default=120, help="full blocks per conversation there")
    parser.add_argument("--replicas", type=int, default=64, help="replicas of the fleet-shaped load")
    parser.add_argument(
        "--parts", default="inproc,memory,fleet_memory,ray",
        help="comma-separated subset of inproc, memory, fleet_memory, ray",
    )
    parser.add_argument("--check", action="store_true", help="run check_integrity on the loaded directory")
    parser.add_argument("--quick", action="store_true", help="1,000 conversations, fewer calls")
    args = parser.parse_args(argv)
    if args.quick:
        args.conversations, args.lookups, args.ray_lookups, args.ray_records = 1_000, 20_000, 500, 300
        args.fleet_blocks = 100_000
    # Each conversation: `blocks` full blocks plus half a block (a hold's last block is usually partial).
    args.tokens = args.blocks * args.block_size + args.block_size // 2
    args.query_hits = min(2_000, args.conversations)
    args.query_misses = args.query_hits // 4

    started = time.time()
    load_before = os.getloadavg()
    queries = query_keys(args)
    figures: dict[str, Any] = {
        "conversations": args.conversations,
        "blocks_per_conversation": args.blocks,
        "block_size": args.block_size,
        "tokens_per_conversation": args.tokens,
        "query_tokens": args.tokens + args.new_turn_tokens,
    }
    parts = set(args.parts.split(","))
    # fleet_memory first: its RSS growth is only the load's in a process that has not yet freed other parts' memory
    # (after them it read 70 bytes a block where tracemalloc counted 118).
    benches = {"fleet_memory": bench_fleet_memory, "inproc": bench_inproc, "memory": bench_memory, "ray": bench_ray}
    for part, bench in benches.items():
        if part in parts:
            figures.update(bench(args, queries))
            gc.collect()
    figures["targets_met"] = {
        "lookup_inproc_ops_s>=100000": figures.get("lookup_inproc_ops_s", 0) >= 100_000,
        "lookup_ray_ms_p50<1": figures.get("lookup_ray_ms_p50", float("inf")) < 1.0,
        "fleet_rss_bytes_per_block<=150": figures.get("fleet_rss_bytes_per_block", float("inf")) <= 150,
    }
    figures["machine"] = machine() | {
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "seconds": round(time.time() - started, 1),
    }
    write_result(args.out, figures)
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
