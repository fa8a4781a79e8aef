"""What vLLM's OpenAI front end costs the ingress per request, in-process (no engine, no Ray): rendering a chat
request to token ids and sampling parameters, derendering a whole answer, and derendering one streamed chunk.

    python -m benchmarks.frontend --out benchmarks/results/frontend.json [--iterations 300]

The conversation is a system prompt and a user turn of about 300 tokens of the default model; the answer is 32
tokens. Medians after 50 warm-up iterations, in milliseconds.

Long histories: conversations of a ~3k-token document and six turns, each turn's chat rendered by two front ends in
turn, one reusing the tokens of the history it rendered before (as the ingress runs, app/prompt_tokens.py) and one
tokenizing every prompt whole; medians over the turns after the first, once the reusing front end trusts reuse (its
first reuses are checked against a full tokenization).

Cold and warm: the overhead benchmark's request (a 64-token completion prompt, 2 tokens out) parsed, rendered,
derendered and serialized by one front end, back to back and then with a pause (`--pause-ms`, a short turn's engine
time) before its derender and before the next request, as the ingress meets them. On this machine a process that
slept that long runs these calls from cold caches (`overhead_request_ms_p50`, `overhead_request_cold_vs_warm`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path

from vllm.entrypoints.openai.completion.protocol import CompletionRequest

from actors.replica_api import GenerateDelta
from app.frontend import Frontend, parse_request
from app.prompt_tokens import VERIFY_FIRST
from benchmarks.common import write_result
from configs.app import OpenAISettings
from configs.models import DEFAULT_MODEL
from model_prep.store import model_path

ANSWER = "Paris is the capital of France, a large city with many museums and parks along the river Seine."


async def measure(frontend: Frontend, iterations: int) -> dict[str, float]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    body = {"model": frontend.served_name, "max_tokens": 32, "stream": True,
            "messages": [{"role": "system", "content": "You are a helpful assistant. " * 40},
                         {"role": "user", "content": "Tell me about Paris and its history. " * 15}]}
    answer = frontend.renderer.renderer.get_tokenizer().encode(ANSWER, add_special_tokens=False)[:32]
    render, whole, chunk = [], [], []
    prompt_tokens = 0
    for _ in range(iterations):
        started = time.perf_counter()
        request = ChatCompletionRequest.model_validate(body)
        rendered = await frontend.render_chat(request)
        render.append(time.perf_counter() - started)
        prompt_tokens = len(rendered.token_ids)
        deltas = [GenerateDelta(token_ids=[t], text="", finished=i == len(answer) - 1,
                                finish_reason="length" if i == len(answer) - 1 else None,
                                prompt_tokens=prompt_tokens, completion_tokens=i + 1)
                  for i, t in enumerate(answer)]

        async def stream(items: list[GenerateDelta] = deltas) -> AsyncIterator[GenerateDelta]:
            for item in items:
                yield item

        started = time.perf_counter()
        async for piece, _ in frontend.chat_chunks(request, rendered, 0, stream()):
            json.dumps(piece.model_dump(mode="json"))
        chunk.append((time.perf_counter() - started) / len(deltas))
        started = time.perf_counter()
        json.dumps((await frontend.chat_response(request, rendered, [deltas])).model_dump(mode="json"))
        whole.append(time.perf_counter() - started)

    def median_ms(samples: list[float]) -> float:
        return round(statistics.median(samples[50:]) * 1e3, 3)

    return {"render_ms_p50": median_ms(render), "derender_answer_ms_p50": median_ms(whole),
            "derender_chunk_ms_p50": median_ms(chunk), "prompt_tokens": prompt_tokens, "answer_tokens": len(answer)}


STEPS = ("parse", "render", "derender", "json")


async def overhead_request(frontend: Frontend, model: str, requests: int, pause_s: float) -> dict[str, float]:
    """Median ms of each step over `requests` requests (the first tenth left out: warm-up)."""
    body = {"model": model, "prompt": list(range(100, 164)), "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    last = GenerateDelta(token_ids=[28, 29], text="", finished=True, finish_reason="length", prompt_tokens=64,
                         completion_tokens=2)
    samples: dict[str, list[float]] = {step: [] for step in STEPS}
    for _ in range(requests):
        t0 = time.perf_counter()
        request = parse_request(CompletionRequest, body)
        t1 = time.perf_counter()
        rendered = await frontend.render_completion(request)
        t2 = time.perf_counter()
        await asyncio.sleep(pause_s)  # the engine's turn
        t3 = time.perf_counter()
        response = await frontend.completion_response(request, rendered, [[[last]]])
        t4 = time.perf_counter()
        json.dumps(response.model_dump(mode="json"))
        t5 = time.perf_counter()
        for step, ms in zip(STEPS, (t1 - t0, t2 - t1, t4 - t3, t5 - t4), strict=True):
            samples[step].append(ms * 1e3)
        await asyncio.sleep(pause_s)  # until the next request
    skip = requests // 10
    return {step: round(statistics.median(ms[skip:]), 3) for step, ms in samples.items()}


async def long_histories(frontends: dict[str, Frontend], conversations: int = 16) -> dict[str, object]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    rng = random.Random(0)
    words = ANSWER.split()
    times: dict[str, list[float]] = {name: [] for name in frontends}
    tokens = 0
    for _ in range(conversations):
        messages = [{"role": "system", "content": " ".join(rng.choice(words) for _ in range(2400))},
                    {"role": "user", "content": " ".join(rng.choice(words) for _ in range(20))}]
        for turn in range(6):
            request = ChatCompletionRequest.model_validate(
                {"model": frontends["reuse"].served_name, "messages": messages, "max_tokens": 8})
            # The first reuses of a process are checked against a full tokenization: time the steady state.
            steady = frontends["reuse"].prompt_tokens.stats.verified >= VERIFY_FIRST
            for name, frontend in frontends.items():
                started = time.perf_counter()
                rendered = await frontend.render_chat(request)
                if turn and steady:
                    times[name].append(time.perf_counter() - started)
                tokens = len(rendered.token_ids)
            messages += [{"role": "assistant", "content": " ".join(rng.choice(words) for _ in range(60))},
                         {"role": "user", "content": " ".join(rng.choice(words) for _ in range(15))}]
    return {"long_history_render_ms_p50": {name: round(statistics.median(t) * 1e3, 3) for name, t in times.items()},
            "long_history_prompt_tokens_last": tokens, "long_history_turns_timed": len(times["reuse"]),
            "prompt_token_reuse": frontends["reuse"].prompt_tokens.public()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--pause-ms", type=float, default=100.0)
    args = parser.parse_args()
    frontend = Frontend(model_path(args.model), args.model, 4096, OpenAISettings())
    figures = asyncio.run(measure(frontend, max(args.iterations, 60))) | {"model": args.model}
    whole = Frontend(model_path(args.model), args.model, 4096, OpenAISettings())
    whole.prompt_tokens.turn_off("this front end tokenizes every prompt whole")
    reuse = Frontend(model_path(args.model), args.model, 4096, OpenAISettings())
    figures |= asyncio.run(long_histories({"reuse": reuse, "whole": whole}))

    async def warm_and_cold() -> tuple[dict[str, float], dict[str, float]]:
        return (await overhead_request(frontend, args.model, 200, 0.0),
                await overhead_request(frontend, args.model, 200, args.pause_ms / 1e3))

    warm, cold = asyncio.run(warm_and_cold())
    figures |= {"overhead_request_ms_p50": {"back_to_back": warm, f"pause_{args.pause_ms:g}_ms": cold},
                "overhead_request_cold_vs_warm": round(sum(cold.values()) / sum(warm.values()), 2)}
    print(json.dumps(figures, indent=2))
    write_result(args.out, figures)


if __name__ == "__main__":
    main()
