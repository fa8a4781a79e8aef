"""The ingress's front end derenders short outputs on its event loop and long ones on vLLM's thread pool, and both
give the text the model's tokenizer decodes. Real tokenizer (the default model's); no engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from transformers import AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest

from actors.replica_api import GenerateDelta
from app.frontend import ON_LOOP_DERENDER_TOKENS, Frontend
from configs.app import OpenAISettings
from model_prep.store import ensure_model


class CountingPool(ThreadPoolExecutor):
    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self.calls = 0

    def submit(self, fn, /, *args, **kwargs):
        self.calls += 1
        return super().submit(fn, *args, **kwargs)


def answer(tokens: list[int], prompt_tokens: int) -> list[GenerateDelta]:
    """A turn's deltas, one token each."""
    return [GenerateDelta(token_ids=[t], text="", finished=i == len(tokens) - 1,
                          finish_reason="length" if i == len(tokens) - 1 else None,
                          prompt_tokens=prompt_tokens, completion_tokens=i + 1) for i, t in enumerate(tokens)]


def test_short_outputs_derender_on_the_loop_long_ones_on_the_pool() -> None:
    model_dir = ensure_model("smollm2-135m-instruct", progress=lambda _msg: None)
    frontend = Frontend(model_dir, "m", 4096, OpenAISettings())
    pool = CountingPool()
    frontend.renderer.renderer._executor._inner = pool  # vLLM's renderer pool, which its derenderer also uses
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = "Paris is the capital of France, a city of museums, bridges and parks along the river Seine. " * 8
    ids = tokenizer.encode(text, add_special_tokens=False)
    short, long = ids[:ON_LOOP_DERENDER_TOKENS], ids[:ON_LOOP_DERENDER_TOKENS + 1]

    async def run() -> None:
        chat = ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "Tell me about Paris."}], "max_tokens": 128})
        rendered = await frontend.render_chat(chat)
        completion = CompletionRequest.model_validate({"model": "m", "prompt": "About Paris:", "max_tokens": 128})
        [rendered_completion] = await frontend.render_completion(completion)
        for tokens, pooled in ((short, 0), (long, 1)):
            before = pool.calls
            deltas = answer(tokens, len(rendered.token_ids))
            body = await frontend.chat_response(chat, rendered, [deltas])
            assert body.choices[0].message.content == tokenizer.decode(tokens)
            assert pool.calls - before == pooled, f"{len(tokens)} tokens: {pool.calls - before} pool calls"

            before = pool.calls
            body = await frontend.completion_response(completion, [rendered_completion], [[answer(tokens, 4)]])
            assert body.choices[0].text == tokenizer.decode(tokens)
            assert pool.calls - before == pooled

        async def stream() -> AsyncIterator[GenerateDelta]:
            for delta in answer(long, 4):
                yield delta

        before = pool.calls
        pieces = [chunk.choices[0].text async for chunk, _ in
                  frontend.completion_chunks(completion, rendered_completion, 0, stream()) if chunk.choices]
        assert "".join(pieces) == tokenizer.decode(long)
        assert pool.calls == before, "one-token stream chunks derender on the loop"

    asyncio.run(run())
    pool.shutdown()
