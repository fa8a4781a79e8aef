"""Scripted faults played against a running app under background load, each next turn checked token for token
against a recompute (the faults and races are described in `benchmarks/faults.py`, which runs this)."""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx

from actors.replica_api import Sampling
from benchmarks.common import BenchApp
from benchmarks.fault_processes import kill, replica_tree, serve_replica_processes, signal_all

MODEL = "tiny-llama"
HOLD_TTL_S = 12.0
GREEDY = Sampling(max_tokens=48, temperature=0.0, ignore_eos=True)
LONG_STREAM = 300  # tokens of the turn whose replica is killed mid-stream
FAULTS = ("holder_killed_between_turns", "serving_replica_killed_mid_stream", "directory_killed", "ingress_killed",
          "holder_stopped_during_pull", "pull_at_the_end_of_the_offer")
RACES = ("lease_ends_during_pull", "release_racing_a_read", "holder_paused_through_lease", "reader_killed_mid_read")


class SetupFailed(RuntimeError):
    """A race could not be set up (its hold was gone before the fault could strike): not a turn of the app's."""


class Campaign:
    """Each of `faults` played `reps` times (a reader-killing race `kill_reps` times) on `app` while two background
    conversations run; `run()` returns the figures the results file records."""

    # A race that cannot be set up (its hold gone or not offered) is set up again, with a new conversation, at most
    # this many times in all.
    SETUP_ATTEMPTS = 4

    def __init__(self, app: BenchApp, reps: int, faults: tuple[str, ...] = FAULTS, hold_ttl_s: float = HOLD_TTL_S,
                 kill_reps: int | None = None) -> None:
        self.app = app
        self.reps = reps
        self.faults = faults
        self.hold_ttl_s = hold_ttl_s
        self.kill_reps = reps if kill_reps is None else kill_reps
        self.setup_retries = 0  # conversations a race set up again because their first turn left no hold
        self.last_error: str | None = None
        self.rng = random.Random(7)
        self.url = app.base_url  # Serve's proxy: it stays up while an ingress replica restarts

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(100, self.app.vocab_size) for _ in range(n)]

    def live(self, count: int = 2, timeout_s: float = 300, without: str | None = None) -> list[str]:
        """Ids of `count` live replicas (none of them `without`, a replica that was killed)."""
        deadline = time.monotonic() + timeout_s
        while True:
            ids = [r for r in self.app.replica_ids(count, timeout_s) if r != without]
            if len(ids) >= count or time.monotonic() > deadline:
                return ids
            time.sleep(0.5)

    def turn(self, history: list[int], force: tuple[str, str] | None = None, sampling: Sampling = GREEDY):
        return self.app.ingress.turn.remote(history, sampling, force).result(timeout_s=300)

    def reference(self, history: list[int], tokens: int = GREEDY.max_tokens) -> list[int]:
        target = self.live(1)[0]
        sampling = GREEDY.model_copy(update={"max_tokens": tokens})
        return self.turn(history, ("recompute", target), sampling).token_ids

    def http_turn(self, history: list[int], tokens: int, on_token: Callable[[int, str], None] | None = None,
                  deadline_s: float = 90) -> list[int] | None:
        """A streamed completion on token ids, retried as OpenAI's SDK retries (connection errors, 5xx, 429);
        the tokens it streamed, or None if no answer came within `deadline_s`."""
        body = {"model": MODEL, "prompt": history, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "logprobs": 0, "return_tokens_as_token_ids": True}
        give_up, wait = time.monotonic() + deadline_s, 1.0
        while time.monotonic() < give_up:
            try:
                with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as resp:
                    if resp.status_code >= 500 or resp.status_code == 429:
                        raise httpx.HTTPStatusError("retryable", request=resp.request, response=resp)
                    resp.raise_for_status()
                    replica = json.loads(resp.headers["x-kvrelay-plan"])["replica"]
                    streamed: list[int] = []
                    for line in resp.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line.removeprefix("data: "))
                        if "error" in event:
                            raise RuntimeError(event["error"]["message"])
                        for choice in event.get("choices", []):
                            for token in choice["logprobs"]["tokens"]:
                                streamed.append(int(token.removeprefix("token_id:")))
                                if on_token is not None:
                                    on_token(len(streamed), replica)
                    return streamed
            except (httpx.HTTPError, RuntimeError, KeyError):
                time.sleep(wait)
                wait = min(wait * 2, 8.0)
        return None

    # ------------------------------------------------------------------------------ one fault

    def play(self, fault: str) -> dict[str, Any]:
        for _ in range(5):
            history = self.tokens(300)
            first = self.turn(history)
            holder = first.kvrelay.replica
            history = history + first.token_ids + self.tokens(24)
            # A race needs the pull it races: the first turn must have left a hold (a replica whose pending holds
            # pin their share of its cache leaves none; the turn then tries another conversation).
            if fault not in RACES or self.hold_of(history, holder) is not None:
                break
            self.setup_retries += 1
        other = next(r for r in self.live() if r != holder)
        if fault in RACES and not self.pull_offered(history, other):
            # On a loaded machine the first turn and the checks above can outlast the hold's offer window (the
            # lease less the directory's margin): there is no pull left to race.
            raise SetupFailed("the ingress did not offer the hold to a pull within 5 s")
        struck = time.monotonic()
        tokens = GREEDY.max_tokens
        killed: list[str] = []  # the engine replica a fault killed: recovered once another has taken its place
        answer: list[int] | None
        if fault == "holder_killed_between_turns":
            killed.append(holder)
            kill(replica_tree(self.app, holder))
            answer = self.turn(history).token_ids
        elif fault == "serving_replica_killed_mid_stream":
            tokens = LONG_STREAM

            def strike(count: int, replica: str) -> None:
                if count >= 10 and not killed:
                    killed.append(replica)
                    kill(replica_tree(self.app, replica))
            struck = time.monotonic()
            answer = self.http_turn(history, tokens, strike)
        elif fault == "directory_killed":
            kill(serve_replica_processes("kv_directory"))
            answer = self.turn(history).token_ids
        elif fault == "ingress_killed":
            kill(serve_replica_processes("ingress"))
            answer = self.http_turn(history, tokens)
        elif fault == "holder_stopped_during_pull":
            stopped = replica_tree(self.app, holder)
            for proc in stopped:
                proc.send_signal(signal.SIGSTOP)
            resume = threading.Timer(3.0, lambda: [p.send_signal(signal.SIGCONT) for p in stopped])
            resume.start()
            try:
                answer = self.turn(history, ("pull", other)).token_ids
            finally:
                resume.join()
        elif fault == "pull_at_the_end_of_the_offer":
            time.sleep(max(0.0, self.offer_s() - 0.5 - (time.monotonic() - struck)))
            answer = self.turn(history, ("pull", other)).token_ids
        elif fault in RACES:
            answer = self.race(fault, history, holder, other, struck, killed)
        else:
            raise ValueError(fault)
        self.live(2, without=killed[0] if killed else None)
        if fault == "ingress_killed":
            self.http_turn(self.tokens(8), 1)
        recovery_s = time.monotonic() - struck
        reference = self.reference(history, tokens)
        row = {"fault": fault, "failed": answer is None, "wrong": answer is not None and answer != reference,
               "recovery_s": round(recovery_s, 1)}
        if self.last_error is not None:
            row["error"], self.last_error = self.last_error, None
        return row

    def pull_offered(self, history: list[int], target: str, timeout_s: float = 5.0) -> bool:
        """Whether, within `timeout_s`, the ingress's own view of the directory (its mirror, a change feed behind the
        directory) offers the turn a pull onto `target` (it waits until it does)."""
        deadline = time.monotonic() + timeout_s
        while "pull" not in self.app.ingress.plan.remote(history, [target]).result()["estimates_ms"]:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def hold_of(self, history: list[int], holder: str) -> Any:
        """The hold `holder` offers for `history`, as the KV directory has it (None if it offers none)."""
        from ray import serve

        from kvtransfer.prefix_key import Scope

        directory = serve.get_deployment_handle("kv_directory", app_name="bench")
        found = directory.lookup.remote(history, Scope(self.app.model, "")).result(timeout_s=30)
        return next((m.hold.hold for m in found.matches if m.hold is not None and m.replica_id == holder), None)

    def offer_s(self) -> float:
        """How long after its turn a hold is offered: its lease less the directory's margin (app/builder.py)."""
        return self.hold_ttl_s - min(10.0, 0.3 * self.hold_ttl_s)

    def race(self, fault: str, history: list[int], holder: str, other: str, struck: float,
             killed: list[str]) -> list[int] | None:
        """A pull of the holder's hold to `other`, with `fault` striking around its read; the answer's tokens."""
        from actors.replica_api import HoldRelease

        pull: dict[str, Any] = {}

        def send() -> None:
            try:
                pull["answer"] = self.turn(history, ("pull", other)).token_ids
            except Exception as exc:  # a turn the ingress could not answer: counted as failed
                pull["error"] = repr(exc)

        sender = threading.Thread(target=send)
        if fault == "lease_ends_during_pull":
            time.sleep(max(0.0, self.offer_s() - 0.6 - (time.monotonic() - struck)))
            reader = replica_tree(self.app, other)
            sender.start()
            time.sleep(0.02)
            signal_all(reader, signal.SIGSTOP)
            time.sleep(self.rng.uniform(1.0, 3.5))
            signal_all(reader, signal.SIGCONT)
        elif fault == "release_racing_a_read":
            hold = self.hold_of(history, holder)
            if hold is None:
                raise SetupFailed("the hold was no longer offered when the race began")
            sender.start()
            time.sleep(self.rng.uniform(0.0, 0.05))
            self.app.engines.release_hold.remote(HoldRelease(hold=hold, target_replica=other)).result(timeout_s=60)
        elif fault == "holder_paused_through_lease":
            paused = replica_tree(self.app, holder)
            sender.start()
            time.sleep(0.02)
            signal_all(paused, signal.SIGSTOP)
            time.sleep(max(0.0, self.hold_ttl_s + 1.0 - (time.monotonic() - struck)))
            signal_all(paused, signal.SIGCONT)
        elif fault == "reader_killed_mid_read":
            reader = replica_tree(self.app, other)
            sender.start()
            time.sleep(self.rng.uniform(0.02, 0.15))
            killed.append(other)
            kill(reader)
        sender.join()
        self.last_error = pull.get("error")
        return pull.get("answer")

    def reps_of(self, fault: str) -> int:
        return self.kill_reps if fault == "reader_killed_mid_read" else self.reps

    def idle_kv_usage(self) -> dict[str, float]:
        """Each replica's KV cache usage once every lease has ended with no load: anything left is a leaked hold."""
        time.sleep(self.hold_ttl_s + 3.0)
        deadline = time.monotonic() + 30
        while True:
            replicas = self.app.ingress.stats.remote().result()["replicas"]
            usage = {r["replica_id"]: r["kv_cache_usage"] for r in replicas}
            if not any(usage.values()) or time.monotonic() > deadline:
                return usage
            time.sleep(1.0)

    def run(self) -> dict[str, Any]:
        stop = threading.Event()
        background = Counter()

        def converse() -> None:
            """A client of the Python handle API that retries a failed call twice, 1 and 2 s later (as OpenAI's SDK
            retries): a call in flight on an ingress replica that dies is lost with it."""
            history = self.tokens(200)
            while not stop.is_set():
                for attempt in range(3):
                    try:
                        result = self.turn(history)
                        break
                    except Exception:
                        background["retried" if attempt < 2 else "failed"] += 1
                        time.sleep(attempt + 1)
                else:
                    continue
                history = history + result.token_ids + self.tokens(16)
                background["turns"] += 1
                if len(history) > 1500:
                    history = self.tokens(200)

        threads = [threading.Thread(target=converse, daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        rows = []
        counters: dict[str, dict[str, int]] = {}
        try:
            for rep in range(max(self.reps_of(f) for f in self.faults)):
                for fault in self.faults:
                    if rep >= self.reps_of(fault):
                        continue
                    for _ in range(self.SETUP_ATTEMPTS):
                        before = self.app.ingress.stats.remote().result()["counters"]
                        try:
                            rows.append({"rep": rep, **self.play(fault)})
                            break
                        except SetupFailed as exc:
                            self.setup_retries += 1
                            print(f"{fault}: set up again ({exc})", flush=True)
                    else:
                        continue
                    after = self.app.ingress.stats.remote().result()["counters"]
                    mine = counters.setdefault(fault, Counter())
                    for name in ("pulls_verified", "pulls_refused", "pull_failures", "plans_pull"):
                        mine[name] += after.get(name, 0) - before.get(name, 0)
                    print(json.dumps(rows[-1]), flush=True)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=120)
        summary = {}
        for fault in self.faults:
            mine = [r for r in rows if r["fault"] == fault]
            summary[fault] = {"runs": len(mine), "failed_turns": sum(r["failed"] for r in mine),
                              "wrong_turns": sum(r["wrong"] for r in mine),
                              "recovery_s_max": max(r["recovery_s"] for r in mine), **counters.get(fault, {})}
        usage = self.idle_kv_usage()
        return {"faults": summary, "runs": rows, "setup_retries": self.setup_retries,
                "background_turns": background["turns"],
                "background_failed_turns": background["failed"], "background_retries": background["retried"],
                "failed_turns": sum(r["failed"] for r in rows) + background["failed"],
                "wrong_turns": sum(r["wrong"] for r in rows),
                "kv_cache_usage_after": usage, "leaked_holds": any(usage.values())}

