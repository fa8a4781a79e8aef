"""Multi-turn conversations over HTTP: kvrelay's planner against the routers users would run instead, in one run.

    python -m benchmarks.multi_turn --out benchmarks/results/multi_turn.json [--quick] [--config FILE]
                                    [--base-url URL] [--sharegpt FILE]

Synthetic conversations in the shape of vLLM's benchmarks/multi_turn: a system prefix shared by all, a prefix
of each conversation's own (the document it is about), then turns whose user and output token counts are drawn
from distributions; every turn resends the whole history, as OpenAI clients do. Clients run conversations
with a fixed concurrency, or start them as a Poisson process. Every policy (`kvtransfer/policies/`, chosen
per request by the `x-kvrelay-policy` header) serves the same conversations on the same engines; each policy
runs under its own API key, so no policy reuses KV another one left behind. Measured per request as the
client sees it: TTFT, TPOT, latency, reused tokens, plan mode.

Writes the JSON to --out, a markdown table next to it (.md), and two plots (TTFT distribution per policy,
TTFT by turn index). Without --base-url it starts its own app with the default model on two replicas.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field

from benchmarks.common import machine, write_result

POLICIES = ("round_robin", "session", "prefix_affinity", "fixed_threshold", "kvrelay")


class Span(BaseModel):
    """Token counts drawn uniformly from [min, max]."""

    model_config = ConfigDict(extra="forbid")
    min: int = Field(ge=1)
    max: int = Field(ge=1)

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.min, max(self.min, self.max))


class BenchConfig(BaseModel):
    """The workload and the app it runs against (`--config FILE` takes this as JSON)."""

    model_config = ConfigDict(extra="forbid")

    conversations: int = Field(default=12, ge=1)
    turns: Span = Span(min=4, max=6)
    system_prefix_tokens: int = Field(default=200, ge=0)
    # Each conversation's own first-message prefix (vLLM's `prefix_num_tokens`), e.g. a document to discuss.
    conversation_prefix_tokens: Span = Span(min=500, max=900)
    user_tokens: Span = Span(min=60, max=160)
    output_tokens: Span = Span(min=16, max=32)
    # "concurrency": that many clients, each running conversations back to back. "poisson": conversations
    # start at `rate` per second, each running its turns back to back.
    arrival: Literal["concurrency", "poisson"] = "concurrency"
    concurrency: int = Field(default=4, ge=1)
    rate: float = Field(default=0.5, gt=0)
    think_time_s: float = Field(default=0.0, ge=0)
    policies: list[Literal["round_robin", "session", "prefix_affinity", "fixed_threshold", "kvrelay"]] = list(
        POLICIES)
    seed: int = 0
    # Runs of every policy. Round r serves fresh conversations (seed + r) with the policies in forward order on even
    # rounds and reversed on odd ones, so a machine that drifts during the run does not favour a policy by its slot.
    rounds: int = Field(default=1, ge=1)
    # Seconds between policies, so holds left by one (they keep engines stepping) expire before the next.
    settle_s: float = Field(default=12.0, ge=0)
    request_timeout_s: float = Field(default=300.0, gt=0)
    # The app this benchmark starts when no --base-url is given.
    model: str | None = None
    num_replicas: int = Field(default=2, ge=1)
    # PoolConfig and EngineConfig fields of that app (configs/app.py, configs/engine.py).
    pool: dict[str, Any] = Field(default_factory=dict)
    engine: dict[str, Any] = Field(default_factory=lambda: {"max_model_len": 4096,
                                                            "kv_cache_memory_bytes": 768 * 1024**2})


QUICK = BenchConfig()
# Without --quick: twice the conversations, for tighter percentiles (about twice the time).
FULL = BenchConfig(conversations=24)


class Conversation(BaseModel):
    conv_id: str
    system: str
    user_messages: list[str]
    output_tokens: list[int]


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


# ------------------------------------------------------------------------------------------------ workload


def word_pool(tokenizer: Any) -> list[str]:
    """Words that are one token each with a leading space, so n words are about n tokens."""
    words = []
    for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        text = tokenizer.convert_tokens_to_string([token])
        if len(text) > 3 and text[0] == " " and text[1:].isalpha() and text[1:].islower():
            words.append(text[1:])
    if len(words) < 100:
        raise RuntimeError("the tokenizer has too few plain word tokens to build synthetic text")
    return words


def synthetic_conversations(config: BenchConfig, words: list[str], seed: int | None = None) -> list[Conversation]:
    rng = random.Random(config.seed if seed is None else seed)

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    system = "You are a helpful assistant. " + text(config.system_prefix_tokens)
    conversations = []
    for i in range(config.conversations):
        turns = config.turns.draw(rng)
        users = [text(config.user_tokens.draw(rng)) for _ in range(turns)]
        users[0] = text(config.conversation_prefix_tokens.draw(rng)) + "\n\n" + users[0]
        conversations.append(Conversation(
            conv_id=f"conv-{i}",
            system=system,
            user_messages=users,
            output_tokens=[config.output_tokens.draw(rng) for _ in range(turns)],
        ))
    return conversations


def sharegpt_conversations(path: Path, config: BenchConfig, tokenizer: Any) -> list[Conversation]:
    """ShareGPT-style JSON: [{"id", "conversations": [{"from": "human"|"gpt", "value"}, ...]}, ...]."""
    items = json.loads(path.read_text())
    conversations = []
    for item in items:
        turns = item.get("conversations", [])
        users = [t["value"] for t in turns if t.get("from") == "human"]
        outputs = [max(1, len(tokenizer(t["value"])["input_ids"])) for t in turns if t.get("from") == "gpt"]
        n = min(len(users), len(outputs))
        if n:
            conversations.append(Conversation(conv_id=str(item.get("id", len(conversations))), system="",
                                              user_messages=users[:n], output_tokens=outputs[:n]))
        if len(conversations) >= config.conversations:
            break
    return conversations


# ------------------------------------------------------------------------------------------------ client


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


# ------------------------------------------------------------------------------------------------ results


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return round(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo), 2)


def summarize(records: list[RequestRecord], wall_s: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    tpot = [r.tpot_ms for r in ok if r.tpot_ms is not None]
    latency = [r.latency_ms for r in ok if r.latency_ms is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    by_turn: dict[int, list[float]] = {}
    for r in ok:
        by_turn.setdefault(r.turn, []).append(r.ttft_ms)
    modes: dict[str, int] = {}
    placement: dict[str, int] = {}
    for r in ok:
        modes[r.mode or "?"] = modes.get(r.mode or "?", 0) + 1
        placement[r.replica or "?"] = placement.get(r.replica or "?", 0) + 1
    return {
        "ttft_ms": {"p50": percentile(ttft, 0.5), "p90": percentile(ttft, 0.9), "p99": percentile(ttft, 0.99),
                    "mean": round(statistics.fmean(ttft), 2) if ttft else None},
        "tpot_ms": {"p50": percentile(tpot, 0.5)},
        "latency_ms": {"p50": percentile(latency, 0.5), "p90": percentile(latency, 0.9)},
        "requests": len(records),
        "errors": len(records) - len(ok),
        "reused_token_share": round(sum(r.reused_tokens for r in ok) / prompt, 4) if prompt else 0.0,
        "modes": modes,
        # Requests per replica, busiest first: how evenly the policy spread the load.
        "requests_per_replica": sorted(placement.values(), reverse=True),
        "ttft_ms_p50_by_turn": {str(t): percentile(v, 0.5) for t, v in sorted(by_turn.items())},
        # Measured over estimated TTFT of the option run, per mode (the estimate is the mode's best option).
        "measured_over_estimate_p50": {
            m: percentile([r.ttft_ms / r.estimate_ms for r in ok if r.mode == m and r.estimate_ms], 0.5)
            for m in sorted(modes) if any(r.mode == m and r.estimate_ms for r in ok)},
        # Mean |estimated - measured| / measured TTFT per mode: how far off the planner's estimates were.
        "estimate_error_mean": {
            m: round(statistics.fmean(abs(r.estimate_ms - r.ttft_ms) / r.ttft_ms
                                      for r in ok if r.mode == m and r.estimate_ms), 3)
            for m in sorted(modes) if any(r.mode == m and r.estimate_ms for r in ok)},
        "wall_s": round(wall_s, 1),
    }


def markdown_table(policies: dict[str, dict[str, Any]]) -> str:
    lines = ["| policy | TTFT p50 (ms) | TTFT p90 (ms) | TTFT p99 (ms) | TTFT mean (ms) | TPOT p50 (ms) | requests | "
             "errors | reused token share | modes | requests per replica |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for name, s in policies.items():
        t = s["ttft_ms"]
        modes = ", ".join(f"{m} {n}" for m, n in sorted(s["modes"].items()))
        lines.append(f"| {name} | {t['p50']} | {t['p90']} | {t['p99']} | {t['mean']} | {s['tpot_ms']['p50']} | "
                     f"{s['requests']} | {s['errors']} | {s['reused_token_share']:.1%} | {modes} | "
                     f"{' / '.join(map(str, s['requests_per_replica']))} |")
    return "\n".join(lines) + "\n"


def targets(policies: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets: kvrelay p50 at least 2x lower than round robin; within 5% of the best other
    policy at p50 and p90; no errors."""
    if "kvrelay" not in policies:
        return {}
    k = policies["kvrelay"]["ttft_ms"]
    out: dict[str, Any] = {"errors_total": sum(s["errors"] for s in policies.values())}
    if "round_robin" in policies:
        out["p50_speedup_vs_round_robin"] = round(policies["round_robin"]["ttft_ms"]["p50"] / k["p50"], 3)
    others = {n: s["ttft_ms"] for n, s in policies.items() if n != "kvrelay"}
    for q in ("p50", "p90"):
        if others:
            best_name, best = min(others.items(), key=lambda kv: kv[1][q])
            out[f"{q}_vs_best_other"] = {"best_other": best_name, "ratio": round(k[q] / best[q], 3)}
    out["met"] = {
        "p50_2x_below_round_robin": out.get("p50_speedup_vs_round_robin", 0) >= 2.0,
        "p50_within_5pct_of_best_other": out.get("p50_vs_best_other", {}).get("ratio", 9) <= 1.05,
        "p90_within_5pct_of_best_other": out.get("p90_vs_best_other", {}).get("ratio", 9) <= 1.05,
        "no_errors": out["errors_total"] == 0,
    }
    return out


def plot(records: list[RequestRecord], policies: list[str], stem: Path) -> list[str]:
    """Two PNGs next to the JSON: TTFT distribution per policy, and median TTFT by turn index."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def save(fig, ax, title: str, xlabel: str, ylabel: str, suffix: str) -> str:
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = stem.with_name(stem.name + suffix)
        fig.savefig(path, dpi=110)
        return str(path)

    ok = [r for r in records if r.ok]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in policies:
        values = sorted(r.ttft_ms for r in ok if r.policy == policy)
        if values:
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=policy)
    ax.set_xscale("log")
    cdf = save(fig, ax, "TTFT distribution per policy", "time to first token (ms, log scale)",
               "fraction of requests", "_ttft_cdf.png")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in policies:
        turns: dict[int, list[float]] = {}
        for r in ok:
            if r.policy == policy:
                turns.setdefault(r.turn, []).append(r.ttft_ms)
        xs = sorted(turns)
        ax.plot([x + 1 for x in xs], [statistics.median(turns[x]) for x in xs], "o-", label=policy)
    by_turn = save(fig, ax, "TTFT by turn index", "turn of the conversation", "median TTFT (ms)",
                   "_ttft_by_turn.png")
    plt.close("all")
    return [cdf, by_turn]


# ------------------------------------------------------------------------------------------------ main


def load_config(args: argparse.Namespace) -> BenchConfig:
    if args.config:
        config = BenchConfig.model_validate_json(args.config.read_text())
    else:
        config = QUICK if args.quick else FULL
    if args.policies:
        config = config.model_copy(update={"policies": args.policies.split(",")})
    if args.rounds:
        config = config.model_copy(update={"rounds": args.rounds})
    return BenchConfig.model_validate(config.model_dump())


async def warm_up(base_url: str, model: str, conversations: list[Conversation], config: BenchConfig,
                  run_id: str) -> None:
    """Two short conversations under a tenant of their own, so engines, NIXL handshakes and the ingress's cost
    model see traffic before anything is measured; then the configured settle time."""
    warm = [c.model_copy(update={"user_messages": c.user_messages[:2]}) for c in conversations[:2]]
    for policy in ("round_robin", "kvrelay"):
        await run_policy(base_url, model, policy, warm, config.model_copy(update={"concurrency": 2}),
                         f"{run_id}-warmup")
    await asyncio.sleep(config.settle_s)


async def benchmark(base_url: str, model: str, rounds: list[list[Conversation]], config: BenchConfig,
                    run_id: str) -> tuple[dict[str, dict[str, Any]], list[RequestRecord]]:
    """Every policy over each round's conversations (see `BenchConfig.rounds`); summaries pool the rounds."""
    await warm_up(base_url, model, rounds[0], config, run_id)
    records_of: dict[str, list[RequestRecord]] = {p: [] for p in config.policies}
    wall_of: dict[str, float] = dict.fromkeys(config.policies, 0.0)
    for number, conversations in enumerate(rounds):
        order = config.policies if number % 2 == 0 else config.policies[::-1]
        for policy in order:
            print(f"round {number} policy {policy}: {len(conversations)} conversations", flush=True)
            records, wall = await run_policy(base_url, model, policy, conversations, config, f"{run_id}-r{number}")
            for r in records:
                r.round = number
            records_of[policy].extend(records)
            wall_of[policy] += wall
            ttft = summarize(records, wall)["ttft_ms"]
            print(f"round {number} policy {policy}: {json.dumps(ttft)}", flush=True)
            await asyncio.sleep(config.settle_s)
    summaries = {p: summarize(records_of[p], wall_of[p]) for p in config.policies}
    return summaries, [r for p in config.policies for r in records_of[p]]


def workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that choose the workload and where results go (`load_config` reads them)."""
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="the CPU default (finishes in under 15 minutes)")
    parser.add_argument("--config", type=Path, help="a BenchConfig as JSON (see benchmarks/configs/)")
    parser.add_argument("--base-url", help="a running kvrelay app (default: start one here)")
    parser.add_argument("--policies", help="comma-separated subset of " + ",".join(POLICIES))
    parser.add_argument("--rounds", type=int, help="runs of every policy, in alternating order (default: config's)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    workload_arguments(parser)
    parser.add_argument("--sharegpt", type=Path, help="ShareGPT-style JSON instead of synthetic conversations")
    parser.add_argument("--serve-mode", choices=["default", "throughput_optimized"], default="throughput_optimized",
                        help="Ray Serve's request path when starting the app here (as `make serve` runs it)")
    args = parser.parse_args()
    config = load_config(args)

    from transformers import AutoTokenizer

    from benchmarks.common import start_app, stop_app
    from configs.models import DEFAULT_MODEL
    from model_prep.store import model_path

    model = config.model or DEFAULT_MODEL
    tokenizer = AutoTokenizer.from_pretrained(model_path(model))
    if args.sharegpt:  # the same conversations every round (each round runs under its own tenants)
        rounds = [sharegpt_conversations(args.sharegpt, config, tokenizer)] * config.rounds
    else:
        words = word_pool(tokenizer)
        rounds = [synthetic_conversations(config, words, config.seed + r) for r in range(config.rounds)]
    app = None
    base_url = args.base_url
    started = time.time()
    if base_url is None:
        print(f"starting kvrelay: {model} on {config.num_replicas} replicas", flush=True)
        app = start_app(model, config.num_replicas, config.pool,
                        throughput_optimized=args.serve_mode == "throughput_optimized", **config.engine)
        base_url = app.direct_url or app.base_url
        print("cost model after start-up calibration:", json.dumps(app.ingress.calibrated.remote().result()),
              flush=True)
    try:
        summaries, records = asyncio.run(benchmark(base_url, model, rounds, config, f"{started:.0f}"))
        ingress_stats = app.ingress.stats.remote().result() if app else None
    finally:
        if app is not None:
            stop_app(app)
    result = {
        "config": config.model_dump() | {"model": model, "sharegpt": str(args.sharegpt) if args.sharegpt else None},
        "policies": summaries,
        "targets": targets(summaries),
        "cost_model": ingress_stats and ingress_stats["cost_model"],
        "planner_counters": ingress_stats and ingress_stats["counters"],
        "machine": machine(),
        "serve_mode": args.serve_mode if app is not None else None,
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "seconds": round(time.time() - started, 1),
        "requests": [r.model_dump() for r in records],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result["plots"] = plot(records, config.policies, args.out.with_suffix(""))
    write_results(args.out, result, markdown_table(summaries))


def write_results(out: Path, result: dict[str, Any], table: str) -> None:
    """The JSON at `out` and the markdown table beside it (.md); prints the table and the targets."""
    write_result(out, result)
    out.with_suffix(".md").write_text(table)
    print(table)
    print(json.dumps(result["targets"], indent=2))
    print("written", out)


if __name__ == "__main__":
    main()
