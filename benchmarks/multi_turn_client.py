"""The multi-turn benchmark's client: conversations sent over HTTP under one routing policy, every turn resending the
whole history as OpenAI clients do, each request timed as the client sees it (`RequestRecord`)."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
from pydantic import BaseModel

from benchmarks.multi_turn_workload import BenchConfig, Conversation


class RequestRecord(BaseModel):
    policy: str
    round: int = 0
    conv_id: str
    turn: int
    ok: bool
    error: str | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    latency_ms: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reused_tokens: int = 0
    mode: str | None = None
    replica: str | None = None
    # The planner's estimate of this turn's time to first token (the option it ran; kvrelay's own cost model).
    estimate_ms: float | None = None
    # Its time to first token as the ingress measured it (the rest of ttft_ms is the HTTP path and this client).
    server_ttft_ms: float | None = None
    # Why the planner chose it, with the other options' estimates and the delay it imposes on others.
    reason: str | None = None



async def one_turn(http: httpx.AsyncClient, model: str, policy: str, conv: Conversation, turn: int,
                   messages: list[dict[str, str]], headers: dict[str, str]) -> tuple[RequestRecord, str]:
    body = {"model": model, "messages": messages, "max_tokens": conv.output_tokens[turn], "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    record = RequestRecord(policy=policy, conv_id=conv.conv_id, turn=turn, ok=False)
    text: list[str] = []
    start = time.perf_counter()
    first = None
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                record.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return record, ""
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    record.error = str(chunk["error"])[:300]
                    return record, ""
                for choice in chunk.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        first = first or time.perf_counter()
                        text.append(piece)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    record.prompt_tokens = usage["prompt_tokens"]
                    record.completion_tokens = usage["completion_tokens"]
                if chunk.get("kvrelay"):
                    record.mode = chunk["kvrelay"]["mode"]
                    record.replica = chunk["kvrelay"]["replica"]
                    record.reused_tokens = chunk["kvrelay"]["reused_tokens"]
                    record.estimate_ms = chunk["kvrelay"]["estimates_ms"].get(record.mode)
                    record.server_ttft_ms = chunk["kvrelay"].get("ttft_ms")
                    record.reason = chunk["kvrelay"].get("reason")
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        record.error = repr(exc)[:300]
        return record, ""
    end = time.perf_counter()
    record.ok = first is not None
    if first is None:
        record.error = "no content streamed"
        return record, ""
    record.ttft_ms = (first - start) * 1e3
    record.latency_ms = (end - start) * 1e3
    if record.completion_tokens > 1:
        record.tpot_ms = (end - first) * 1e3 / (record.completion_tokens - 1)
    return record, "".join(text)


async def run_conversation(http: httpx.AsyncClient, model: str, policy: str, conv: Conversation,
                           headers: dict[str, str], config: BenchConfig, records: list[RequestRecord]) -> None:
    messages = [{"role": "system", "content": conv.system}] if conv.system else []
    headers = dict(headers, **{"x-session-id": conv.conv_id})
    for turn, user in enumerate(conv.user_messages):
        messages.append({"role": "user", "content": user})
        record, reply = await one_turn(http, model, policy, conv, turn, messages, headers)
        records.append(record)
        if not record.ok:
            return  # the history would diverge from what the other policies see
        messages.append({"role": "assistant", "content": reply})
        if config.think_time_s:
            await asyncio.sleep(config.think_time_s)


async def run_policy(base_url: str, model: str, policy: str, conversations: list[Conversation], config: BenchConfig,
                     run_id: str) -> tuple[list[RequestRecord], float]:
    """Every conversation under one policy; returns the records and the wall time."""
    records: list[RequestRecord] = []
    # A tenant per policy and run: its KV is never offered to another policy's turns.
    headers = {"authorization": f"Bearer bench-{run_id}-{policy}", "x-kvrelay-policy": policy}
    total = sum(len(c.user_messages) for c in conversations)
    started = time.perf_counter()
    limits = httpx.Limits(max_connections=max(config.concurrency, 8) * 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=config.request_timeout_s, limits=limits) as http:

        async def progress() -> None:
            while True:
                await asyncio.sleep(10)
                errors = sum(not r.ok for r in records)
                print(f"  [{policy}] {len(records)}/{total} requests, {errors} errors, "
                      f"{time.perf_counter() - started:.0f} s", flush=True)

        reporter = asyncio.create_task(progress())
        try:
            if config.arrival == "concurrency":
                queue: asyncio.Queue[Conversation] = asyncio.Queue()
                for conv in conversations:
                    queue.put_nowait(conv)

                async def client() -> None:
                    while not queue.empty():
                        await run_conversation(http, model, policy, queue.get_nowait(), headers, config, records)

                await asyncio.gather(*(client() for _ in range(config.concurrency)))
            else:
                rng = random.Random(config.seed)
                tasks = []
                for conv in conversations:
                    tasks.append(asyncio.create_task(run_conversation(http, model, policy, conv, headers, config,
                                                                      records)))
                    await asyncio.sleep(rng.expovariate(config.rate))
                await asyncio.gather(*tasks)
        finally:
            reporter.cancel()
    return records, time.perf_counter() - started

