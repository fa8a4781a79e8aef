"""A replica costs only its compute: no worker process spinning beside the engine, no stepping while only holds
are pending, the model's thread on the replica's own core, one UCX worker for NIXL, no lost wake-up after idle gaps,
and holds that leave room for requests.

Each test fails if its fix stops being in force (actors/lean_engine.py, kvtransfer/throttled_nixl.py). CPU use
is read from the kernel's per-process accounting with wide margins: the broken behaviour costs a whole core.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from actors.engine_replica import EngineReplica
from actors.replica_api import GenerateRequest, Sampling
from actors.vllm_engine import HoldStepper, lower_engine_priority
from configs.engine import EngineConfig
from tests.conftest import REPO_ROOT, collect

MiB = 1024**2
HOLD_TTL_S = 6.0


@pytest.fixture(scope="module")
def replica(loop_thread):
    replica = EngineReplica(EngineConfig(
        model="tiny-llama", dtype="float32", max_model_len=1024, kv_cache_memory_bytes=64 * MiB,
        nixl={"hold_ttl_s": HOLD_TTL_S}, cpu_core_offset=0,
    ))
    yield replica
    replica.engine.shutdown()


def vllm_processes(replica: EngineReplica) -> dict[str, list[psutil.Process]]:
    """The replica's engine-core processes and any worker processes they started."""
    cores = [psutil.Process(pid) for pid in replica.engine_pids]
    workers = [c for p in cores for c in p.children(recursive=True) if "Worker" in c.name()]
    return {"engine_core": cores, "worker": workers}


def cores_used(procs: list[psutil.Process], seconds: float) -> float:
    def total() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in procs)

    before, start = total(), time.monotonic()
    time.sleep(seconds)
    return (total() - before) / (time.monotonic() - start)


def run(loop_thread, replica: EngineReplica, prompt: list[int], max_tokens: int, export_hold: bool):
    request = GenerateRequest(
        request_id=uuid.uuid4().hex, prompt_token_ids=prompt, export_hold=export_hold,
        params=Sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True).to_params(),
    )
    return loop_thread.run(collect(replica.generate(request)))


def test_the_model_runs_in_the_engine_core_process(loop_thread, replica):
    procs = vllm_processes(replica)
    assert len(procs["engine_core"]) == 1
    assert procs["worker"] == [], "vLLM's CPU default (a Worker process beside EngineCore) is back"


def test_the_model_thread_stays_on_the_replica_core(loop_thread, replica):
    """vLLM's NIXL worker moves the thread that creates it to the last core; the model thread must stay put."""
    engine_core = vllm_processes(replica)["engine_core"][0]
    run(loop_thread, replica, list(range(100, 164)), 2, export_hold=False)
    assert set(psutil.Process(engine_core.pid).cpu_affinity()) == set(replica.cpu_cores)


def nice_of(pid: int, tid: int) -> int:
    """A thread's nice value, from /proc (field 19 of its stat line, counted after the command name)."""
    stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[16])


def test_the_engine_computes_at_a_lower_priority_than_the_request_path(loop_thread, replica):
    """Two engines on two cores leave the request path (ingress, Serve, this replica's own loop) no core of its own:
    at equal priority its work waited for the models' time slices. Every engine thread, including those started
    after the engine (a request has run), has the configured nice value; this replica's process keeps its own."""
    run(loop_thread, replica, list(range(100, 164)), 2, export_hold=True)
    engine_core = replica.engine_pids[0]
    threads = [int(t) for t in os.listdir(f"/proc/{engine_core}/task")]
    assert replica.config.engine_nice == 19
    assert {tid: nice_of(engine_core, tid) for tid in threads} == {tid: 19 for tid in threads}
    own = [int(t) for t in os.listdir(f"/proc/{os.getpid()}/task")]
    assert max(nice_of(os.getpid(), tid) for tid in own) < 19


def test_an_engines_worker_process_gets_the_same_priority():
    """With `separate_worker_process` the model runs in the engine core's child: it is lowered too."""
    child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \
            "time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", child])
    try:
        deadline = time.monotonic() + 10
        while not psutil.Process(parent.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        (worker,) = psutil.Process(parent.pid).children()
        lower_engine_priority([parent.pid], 7)
        assert nice_of(parent.pid, parent.pid) == 7
        assert nice_of(worker.pid, worker.pid) == 7
    finally:
        for proc in psutil.Process(parent.pid).children() + [psutil.Process(parent.pid)]:
            proc.kill()
        parent.wait()


def test_the_engine_process_hands_free_heap_pages_back(replica):
    """Without a periodic malloc_trim, each engine process grew by freed activations kept resident by glibc."""
    from actors.lean_engine import HEAP_TRIM_THREAD

    engine_core = vllm_processes(replica)["engine_core"][0]
    names = {Path(f"/proc/{engine_core.pid}/task/{t.id}/comm").read_text().strip() for t in engine_core.threads()}
    assert HEAP_TRIM_THREAD.decode() in names, names


def test_nixl_runs_one_ucx_worker_on_cpu(replica):
    """vLLM asks NIXL's UCX backend for 4 transfer threads, each with its own UCX worker and TCP connections (the
    agent connects every worker to itself at start-up): on CPU kvrelay asks for none, which leaves one connection
    of the engine to itself (both ends in this process) instead of ten."""
    engine_core = vllm_processes(replica)["engine_core"][0]
    established = [c for c in engine_core.net_connections(kind="tcp") if c.status == psutil.CONN_ESTABLISHED]
    assert 0 < len(established) <= 2, established


def test_an_idle_replica_with_a_pending_hold_does_not_spin(loop_thread, replica):
    deltas = run(loop_thread, replica, list(range(200, 456)), 4, export_hold=True)
    assert deltas[-1].hold is not None, "the turn should have left a hold"
    procs = vllm_processes(replica)["engine_core"]
    # vLLM steps every millisecond while a hold is pending: about a core. Quiet: a few hundredths.
    assert cores_used(procs, 2.0) < 0.25


def wakeups(process: psutil.Process) -> dict[str, int]:
    """Voluntary context switches (a thread going to sleep: one per wake-up) per thread name, so far."""
    found: dict[str, int] = {}
    for thread in process.threads():
        task = Path(f"/proc/{process.pid}/task/{thread.id}")
        try:
            name = (task / "comm").read_text().strip()
            switches = int((task / "status").read_text().split("voluntary_ctxt_switches:")[1].split()[0])
        except OSError:
            continue
        found[f"{name}/{thread.id}"] = switches
    return found


def test_an_idle_engine_wakes_rarely(loop_thread, replica):
    """An idle engine sleeps. Two threads wake it about 100 times a second each: NIXL's UCX progress thread, whose
    poll() times out every `nixl.progress_delay_us` (10 ms; at 200 us it woke about 1,000 times a second and used
    twice the idle CPU, benchmarks/progress_delay.py; at NIXL's own 0 it spins), and the one gloo device's loop
    thread (10 ms), shared by all of vLLM's single-rank process groups: with a device each, 12 such threads woke
    1,200 times a second (actors/lean_engine.py, `one_gloo_device_per_process`)."""
    assert replica.config.nixl.progress_delay_us >= 10_000
    time.sleep(HOLD_TTL_S + 1)  # no hold pending from earlier tests (their leases step the engine now and then)
    engine_core = vllm_processes(replica)["engine_core"][0]
    before, started = wakeups(engine_core), time.monotonic()
    time.sleep(3.0)
    after, elapsed = wakeups(engine_core), time.monotonic() - started
    per_s = {name: (after[name] - count) / elapsed for name, count in before.items() if name in after}
    assert sum(per_s.values()) < 400, sorted(per_s.items(), key=lambda item: -item[1])[:5]
    assert sum(name.startswith("gloo_tcp_loop/") for name in after) == 1, sorted(after)


def test_an_idle_engine_with_holds_is_woken_ever_less_often_until_the_leases_end():
    """The hold clock (`HoldStepper`) backs off: its wake-ups cost the actor and the engine a millisecond each, and an
    idle engine's held blocks are needed by nobody. It steps twice after the last lease, so expired holds are freed.
    The engine here records when it is woken (the real engine's side is the other tests of this module)."""

    class Recorder:
        def __init__(self) -> None:
            self.woken: list[float] = []

        async def call_utility_async(self, name: str) -> None:
            self.woken.append(time.monotonic())

    async def scenario() -> tuple[float, list[float]]:
        engine = type("Engine", (), {"engine_core": Recorder()})()
        stepper = HoldStepper(engine, step_s=0.05, hold_ttl_s=1.0)
        started = time.monotonic()
        stepper.hold_exported()
        await asyncio.sleep(1.4)
        stepper.stop()
        return started, [t - started for t in engine.engine_core.woken]

    started, woken = asyncio.run(scenario())
    # At 0.05, 0.15, 0.35, 0.75 s (each wait twice the last), then 0.05 and 0.10 s after the 1 s lease: 6 in all,
    # against 22 at a fixed 0.05 s.
    expected = [0.05, 0.15, 0.35, 0.75, 1.05, 1.10]
    assert len(woken) == len(expected), woken
    assert all(abs(w - e) < 0.04 for w, e in zip(woken, expected, strict=True)), woken


def test_an_expired_hold_is_freed_while_the_replica_is_idle(loop_thread, replica):
    """The quiet scheduler still steps for holds, only less often: an expired lease frees its blocks."""
    run(loop_thread, replica, list(range(300, 812)), 4, export_hold=True)
    in_use = loop_thread.run(replica.stats()).kv_cache_usage
    assert in_use > 0
    deadline = time.monotonic() + HOLD_TTL_S + 10
    while loop_thread.run(replica.stats()).kv_cache_usage >= in_use and time.monotonic() < deadline:
        time.sleep(0.5)
    assert loop_thread.run(replica.stats()).kv_cache_usage < in_use


def test_short_requests_after_idle_gaps_never_stall(loop_thread, replica):
    """Whatever replaced the spin must not lose a wake-up: a lost one costs seconds, or forever."""
    slowest = 0.0
    for i, gap in enumerate([0.0, 0.3, 1.2, 0.05, 2.1, 0.0, 1.1, 0.2]):
        time.sleep(gap)
        started = time.monotonic()
        run(loop_thread, replica, list(range(400 + i, 440 + i)), 2, export_hold=bool(i % 2))
        slowest = max(slowest, time.monotonic() - started)
    assert slowest < 3.0


def test_holds_never_pin_more_than_their_share_of_the_kv_cache(loop_thread, replica):
    """Without a cap, turns that leave holds filled the cache and every new request waited for a lease to end
    (tens of seconds, seen in the autoscaling test). Past `max_held_fraction` (0.5) a turn leaves no hold."""
    time.sleep(HOLD_TTL_S + 1)  # earlier tests' holds have expired
    share = replica.config.nixl.max_held_fraction
    held = []
    for i in range(12):  # 12 x 32 blocks of 1,004 tokens, of 512 blocks: all would fit, half may be held
        prompt = [100 + (7 * i + j) % 900 for j in range(1000)]
        held.append(run(loop_thread, replica, prompt, 4, export_hold=True)[-1].hold is not None)
    usage = loop_thread.run(replica.stats()).kv_cache_usage
    assert held[:4] == [True] * 4 and not all(held), held
    assert sum(held) <= 8 and usage <= share + 0.05, (held, usage)


ORPHAN_SCRIPT = """
import os

from actors.engine_replica import EngineReplica

if __name__ == "__main__":
    replica = EngineReplica({"model": "tiny-llama", "dtype": "float32", "max_model_len": 512,
                             "kv_cache_memory_bytes": 32 * 1024**2, "nixl": {"enabled": False}})
    print(f"engine pid {replica.engine_pids[0]}", flush=True)
    os._exit(0)  # no shutdown: the engine process must notice on its own
"""


def test_the_engine_process_exits_when_its_replica_process_dies(tmp_path):
    script = tmp_path / "start_and_vanish.py"
    script.write_text(ORPHAN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    out = tmp_path / "out.txt"
    with open(out, "w") as sink:  # a file, not a pipe: an orphaned engine would keep a pipe open
        done = subprocess.run([sys.executable, str(script)], cwd=REPO_ROOT, env=env, stdout=sink,
                              stderr=subprocess.STDOUT, timeout=300)
    assert done.returncode == 0, out.read_text()[-2000:]
    # Other lines may follow it (multiprocessing's resource tracker warns about what os._exit left behind).
    engine_pid = int(next(line for line in out.read_text().splitlines() if line.startswith("engine pid "))[11:])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if psutil.Process(engine_pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.2)
    else:
        psutil.Process(engine_pid).kill()  # leave nothing behind, then fail
        pytest.fail("vLLM's engine process outlived its replica's process by 10 s")


def test_accelerators_keep_vllms_ucx_transfer_threads():
    """One UCX worker is for CPU engines; on a GPU, vLLM's 4 transfer threads stay (parallel RDMA transfers)."""
    from configs.engine import NixlSettings
    from kvtransfer.connector import kv_transfer_config

    def threads(settings: NixlSettings, device: str) -> int:
        return kv_transfer_config(settings, "engine", device)["kv_connector_extra_config"]["num_threads"]

    assert threads(NixlSettings(), "cpu") == 0
    assert threads(NixlSettings(), "cuda") == 4
    assert threads(NixlSettings(ucx_threads=2), "cpu") == 2


def test_the_kv_event_publisher_sleeps_until_an_event_or_a_replay_request(tmp_path):
    """vLLM's publisher thread wakes every 0.1 s to look at its replay socket; the engine's sleeps until an event
    or a replay request comes (actors/lean_engine.py, `WaitingEventPublisher`), and loses neither. The engine
    process gets it from vLLM's factory, as here."""
    import zmq
    from vllm.config.kv_events import KVEventsConfig
    from vllm.distributed.kv_events import AllBlocksCleared, EventPublisherFactory, KVEventBatch

    from actors.lean_engine import WaitingEventPublisher, waiting_event_publisher

    waiting_event_publisher()
    endpoint, replay_endpoint = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    publisher = EventPublisherFactory.create(KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, replay_endpoint=replay_endpoint))
    assert isinstance(publisher, WaitingEventPublisher)
    status = Path(f"/proc/self/task/{publisher._thread.native_id}/status")

    def switches() -> int:
        return int(status.read_text().split("voluntary_ctxt_switches:")[1].split()[0])

    ctx = zmq.Context.instance()
    sub, replay = ctx.socket(zmq.SUB), ctx.socket(zmq.DEALER)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    replay.connect(replay_endpoint)
    try:
        time.sleep(0.5)  # the subscription reaches the publisher
        before = switches()
        time.sleep(2.0)
        assert switches() - before <= 2  # vLLM's thread: about 20

        # Events published in bursts and after idle gaps all arrive, in order, at once.
        sent = 0
        for burst in (1, 5, 1, 3):
            started = time.monotonic()
            for _ in range(burst):
                publisher.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
            for _ in range(burst):
                assert sub.poll(1000), f"event {sent} not delivered"
                _topic, seq, _payload = sub.recv_multipart()
                assert int.from_bytes(seq, "big") == sent
                sent += 1
            assert time.monotonic() - started < 0.05
            time.sleep(0.3)

        # A replay request is answered at once, with every buffered batch from the sequence asked for.
        started = time.monotonic()
        replay.send_multipart([b"", (2).to_bytes(8, "big")])
        replayed = []
        while True:
            assert replay.poll(1000), "replay not answered"
            _empty, _topic, seq, _payload = replay.recv_multipart()
            if seq == WaitingEventPublisher.END_SEQ:
                break
            replayed.append(int.from_bytes(seq, "big"))
        assert replayed == list(range(2, sent)) and time.monotonic() - started < 0.05
    finally:
        sub.close(linger=0)
        replay.close(linger=0)
        started = time.monotonic()
        publisher.shutdown()
    assert not publisher._thread.is_alive() and time.monotonic() - started < 0.5
