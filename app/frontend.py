"""vLLM's own OpenAI front end, without an engine: requests render to token ids and sampling parameters, and a
turn's token deltas derender into OpenAI responses.

These are the pieces vLLM's GPU-less render server and its scale-out endpoints are built from (`OnlineRenderer`,
`OnlineDerenderer`, `ServingRender`, `ServingTokenization`), so what a vLLM server accepts on chat and completions
kvrelay accepts with the same meaning: the same code parses, renders, checks and answers it. kvrelay's ingress
plans and routes in between; nothing here knows about replicas.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel
from vllm.config import VllmConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.generate.base.serving import clamp_prompt_logprobs
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
)
from vllm.entrypoints.openai.completion.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
)
from vllm.entrypoints.openai.models.protocol import BaseModelPath
from vllm.entrypoints.openai.models.serving import OpenAIModelRegistry
from vllm.entrypoints.scale_out.render.serving import ServingRender
from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
    DerenderStreamState,
    GenerateLogProbs,
    GenerateRequest,
    GenerateTokensChoice,
    GenerateTokensResponse,
    GenerateTokensStreamChoice,
    GenerateTokensStreamResponse,
)
from vllm.entrypoints.serve.engine.protocol import ErrorResponse, PromptTokenUsageInfo, UsageInfo
from vllm.entrypoints.serve.tokenize.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from vllm.entrypoints.serve.tokenize.serving import ServingTokenization
from vllm.renderers import renderer_from_config
from vllm.renderers.chat_utils import load_chat_template
from vllm.renderers.online_derenderer import OnlineDerenderer
from vllm.renderers.online_renderer import OnlineRenderer

from actors.replica_api import GenerateDelta
from app.prompt_tokens import reuse_prompt_tokens
from app.responses import ClientError, as_client_error
from configs.app import OpenAISettings

OpenAIRequest = ChatCompletionRequest | CompletionRequest
T = TypeVar("T", bound=BaseModel)
R = TypeVar("R")

# vLLM's derenderer runs every call on its renderer's thread pool. For a short output the hop there and back costs
# more than the work: a 2-token answer took 0.89 ms to derender in the ingress, 0.58 ms on its event loop (cold, as
# the ingress meets it between turns; docs/design.md). Outputs up to this many tokens (a whole response's, all
# choices; a streamed chunk's) are derendered on the loop, longer ones on the pool as vLLM does.
ON_LOOP_DERENDER_TOKENS = 64


@dataclass
class TurnTokens:
    """A finished (or streaming) turn's output as the derenderer reads it."""

    token_ids: list[int]
    logprobs: GenerateLogProbs | None
    finish_reason: str | None


def merged(deltas: list[GenerateDelta]) -> TurnTokens:
    """All deltas of one turn as one output."""
    logprobs = None
    if any(d.logprobs is not None for d in deltas):
        logprobs = GenerateLogProbs(content=[c for d in deltas if d.logprobs for c in d.logprobs.content or []])
    return TurnTokens([t for d in deltas for t in d.token_ids], logprobs, deltas[-1].finish_reason)


def tokens_as_ids(logprobs: Any, generated: GenerateLogProbs | None) -> None:
    """`return_tokens_as_token_ids`: name each logprob's token "token_id:N", as vLLM's server does (for tokens
    that do not decode to text on their own). `logprobs` is a chat or a completion logprobs object."""
    if logprobs is None or generated is None or not generated.content:
        return
    name = "token_id:{}".format
    if isinstance(logprobs, CompletionLogProbs):
        logprobs.tokens = [name(g.token_id) for g in generated.content]
        logprobs.top_logprobs = [{name(t.token_id): t.logprob for t in g.top_logprobs} for g in generated.content]
        return
    for entry, g in zip(logprobs.content or [], generated.content, strict=False):
        entry.token, entry.bytes = name(g.token_id), list(name(g.token_id).encode())
        for top, t in zip(entry.top_logprobs, g.top_logprobs, strict=False):
            top.token, top.bytes = name(t.token_id), list(name(t.token_id).encode())


def usage(outputs: list[list[list[GenerateDelta]]] | list[list[GenerateDelta]]) -> UsageInfo:
    """Token counts of a response: per prompt its prompt once and every choice's completion; cached tokens are
    the prompt tokens not computed (reused or pulled). `outputs`: per prompt, each choice's deltas."""
    prompt = completion = cached = 0
    for per_prompt in outputs:
        first = per_prompt[0][-1]
        prompt, cached = prompt + first.prompt_tokens, cached + first.num_cached_tokens
        completion += sum(deltas[-1].completion_tokens for deltas in per_prompt)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=cached))


def on_loop_when_short(run: Callable[..., R], pooled: Callable[..., Awaitable[R]],
                       tokens: Callable[..., int]) -> Callable[..., Awaitable[R]]:
    """An async call that runs `run` on the caller's loop when `tokens(*args)` is at most ON_LOOP_DERENDER_TOKENS,
    else awaits `pooled` (the same call on vLLM's thread pool)."""
    async def call(*args: Any, **kwargs: Any) -> R:
        if tokens(*args) <= ON_LOOP_DERENDER_TOKENS:
            return run(*args, **kwargs)
        return await pooled(*args, **kwargs)
    return call


def parse_request(request_cls: type[T], body: dict[str, Any]) -> T:
    """A request body as one of vLLM's request models; any refusal is the client's 400. vLLM's validators assume
    well-typed fields and fail on some malformed ones with a TypeError or AttributeError rather than a
    validation error: the body is at fault all the same."""
    try:
        return request_cls.model_validate(body)
    except Exception as exc:
        refused = as_client_error(exc)
        if refused is not None:
            raise refused from None
        raise ClientError(400, f"the request body is malformed: a field has the wrong shape ({exc})") from None


def raise_error(result: ErrorResponse) -> None:
    """vLLM's refusal as the client's error (its status, message and parameter)."""
    raise ClientError(result.error.code, result.error.message, param=result.error.param)


class Frontend:
    """Render, derender and tokenize for one served model, exactly as vLLM's server does."""

    def __init__(self, model_dir: Path, served_name: str, max_model_len: int, settings: OpenAISettings) -> None:
        self.served_name = served_name
        args = AsyncEngineArgs(
            model=str(model_dir),
            served_model_name=[served_name],
            max_model_len=max_model_len,
            generation_config=settings.generation_config,
            reasoning_parser=settings.reasoning_parser or "",
        )
        environ = dict(os.environ)
        try:
            model_config = args.create_model_config()
            model_config.quantization = None  # nothing runs the weights here
            vllm_config = VllmConfig(
                model_config=model_config, structured_outputs_config=args.create_structured_outputs_config()
            )
        finally:
            # vLLM's platform hook rewrites this process's environment for engine processes (LD_PRELOAD, thread
            # counts); the ingress starts none, and its own children must not inherit them.
            os.environ.clear()
            os.environ.update(environ)
        renderer = renderer_from_config(vllm_config)
        self.prompt_tokens = reuse_prompt_tokens(renderer)
        chat_template = load_chat_template(settings.chat_template)
        common: dict[str, Any] = dict(
            model_config=model_config,
            renderer=renderer,
            request_logger=None,
            chat_template=chat_template,
            chat_template_content_format="auto",
            enable_auto_tools=settings.enable_auto_tool_choice,
            tool_parser=settings.tool_call_parser,
            reasoning_parser=vllm_config.structured_outputs_config.reasoning_parser or None,
        )
        self.renderer = OnlineRenderer(**common)
        self.renderer.warmup()
        self.derenderer = OnlineDerenderer(**common)
        derenderer = self.derenderer
        derenderer._derender_chat_async = on_loop_when_short(
            derenderer._derender_chat, derenderer._derender_chat_async,
            lambda generated, *_: sum(len(c.token_ids or ()) for c in generated.choices))
        derenderer._derender_completion_async = on_loop_when_short(
            derenderer._derender_completion, derenderer._derender_completion_async,
            lambda generated, *_: sum(len(c.token_ids or ()) for g in generated for c in g.choices))
        derenderer._detokenize_delta_async = on_loop_when_short(
            derenderer._detokenize_delta, derenderer._detokenize_delta_async,
            lambda tokenizer, token_ids, *_: len(token_ids))
        registry = OpenAIModelRegistry(
            model_config=model_config, base_model_paths=[BaseModelPath(name=served_name, model_path=str(model_dir))]
        )
        self.render = ServingRender(registry, self.renderer)
        self.tokenization = ServingTokenization(
            registry, self.renderer, chat_template=chat_template, chat_template_content_format="auto"
        )

    # ------------------------------------------------------------------------------ requests

    async def render_chat(self, request: ChatCompletionRequest) -> GenerateRequest:
        return await self._call(self.render.render_chat_request(request))

    async def render_completion(self, request: CompletionRequest) -> list[GenerateRequest]:
        return await self._call(self.render.render_completion_request(request))

    async def tokenize(self, body: dict[str, Any]) -> TokenizeResponse:
        request = parse_request(TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest, body)
        return await self._call(self.tokenization.create_tokenize(request, None))

    async def detokenize(self, body: dict[str, Any]) -> DetokenizeResponse:
        return await self._call(self.tokenization.create_detokenize(parse_request(DetokenizeRequest, body), None))

    @staticmethod
    async def _call(pending: Any) -> Any:
        """Await one of vLLM's serving calls; its refusals (returned or raised) become the client's 4xx."""
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
        from vllm.exceptions import VLLMClientError

        try:
            result = await pending
        except (VLLMClientError, ValueError, TypeError, OverflowError, NotImplementedError) as exc:
            result = create_error_response(exc)
        if isinstance(result, ErrorResponse):
            raise_error(result)
        return result

    # ------------------------------------------------------------------------------ responses

    async def chat_response(
        self, request: ChatCompletionRequest, rendered: GenerateRequest, outputs: list[list[GenerateDelta]]
    ) -> ChatCompletionResponse:
        """The chat response; `outputs` holds each choice's deltas (n of them)."""
        generated = GenerateTokensResponse(request_id=rendered.request_id, choices=self._choices(outputs),
                                           prompt_token_ids=rendered.token_ids)
        choices = await self.derenderer.derender_chat(generated, request, rendered.token_ids)
        echo = self._chat_echo(request)
        for choice, deltas in zip(choices, outputs, strict=True):
            if request.return_tokens_as_token_ids:
                tokens_as_ids(choice.logprobs, merged(deltas).logprobs)
            if choice.message.tool_calls and request.tool_choice in (None, "auto") and choice.finish_reason == "stop":
                choice.finish_reason = "tool_calls"  # as vLLM's own server says when the model chose to call
            if echo:
                choice.message.content = echo + (choice.message.content or "")
        return ChatCompletionResponse(
            id=rendered.request_id, model=self.served_name, created=int(time.time()), choices=choices,
            usage=usage([outputs]), prompt_logprobs=clamp_prompt_logprobs(outputs[0][0].prompt_logprobs),
            prompt_token_ids=rendered.token_ids if request.return_token_ids else None,
            prompt_text=self._decode(rendered.token_ids) if request.return_prompt_text else None,
        )

    async def completion_response(
        self, request: CompletionRequest, rendered: list[GenerateRequest], outputs: list[list[list[GenerateDelta]]]
    ) -> CompletionResponse:
        """The completion response; `outputs` holds, per prompt, each choice's deltas (choices numbered across
        prompts, as vLLM does)."""
        generated = [GenerateTokensResponse(request_id=r.request_id, choices=self._choices(per_prompt),
                                            prompt_token_ids=r.token_ids)
                     for r, per_prompt in zip(rendered, outputs, strict=True)]
        choices, _, _ = await self.derenderer.derender_completion(
            generated, [len(r.token_ids) for r in rendered], completion_request=request,
            prompt_token_ids=[r.token_ids for r in rendered],
        )
        prompts = self._prompt_texts(request, rendered) if request.echo else [""] * len(rendered)
        per_choice = [(r, prompt, deltas) for r, prompt, per_prompt in zip(rendered, prompts, outputs, strict=True)
                      for deltas in per_prompt]
        for choice, (r, prompt, deltas) in zip(choices, per_choice, strict=True):
            if request.echo:
                choice.text = prompt + choice.text
            if request.return_tokens_as_token_ids:
                tokens_as_ids(choice.logprobs, merged(deltas).logprobs)
            choice.prompt_logprobs = clamp_prompt_logprobs(deltas[0].prompt_logprobs)
            if request.return_token_ids:  # vLLM's render-path derenderer leaves both out; its server sends them
                choice.prompt_token_ids = list(r.token_ids)
                choice.token_ids = merged(deltas).token_ids
        return CompletionResponse(id=rendered[0].request_id, model=self.served_name, created=int(time.time()),
                                  choices=choices, usage=usage(outputs))

    async def chat_chunks(
        self, request: ChatCompletionRequest, rendered: GenerateRequest, index: int,
        deltas: AsyncIterator[GenerateDelta],
    ) -> AsyncIterator[tuple[ChatCompletionStreamResponse, GenerateDelta]]:
        """One choice's chat stream chunks (vLLM's derendered deltas), each with the delta it came from."""
        state: DerenderStreamState | None = None
        echo = self._chat_echo(request)
        async for delta in deltas:
            chunk, state = await self.derenderer.derender_chat_stream(
                self.served_name, self._stream_chunk(rendered, delta, index), state, request,
                prompt_tokens=len(rendered.token_ids), prompt_token_ids=rendered.token_ids,
            )
            if not chunk.choices:
                continue
            if request.return_tokens_as_token_ids:
                tokens_as_ids(chunk.choices[0].logprobs, delta.logprobs)
            if echo:  # the echoed message leads the first chunk, as vLLM's server sends it
                chunk.choices[0].delta.content, echo = echo + (chunk.choices[0].delta.content or ""), ""
            yield chunk, delta

    async def completion_chunks(
        self, request: CompletionRequest, rendered: GenerateRequest, index: int,
        deltas: AsyncIterator[GenerateDelta],
    ) -> AsyncIterator[tuple[CompletionStreamResponse, GenerateDelta]]:
        """One choice's completion stream chunks, each with the delta it came from."""
        state: DerenderStreamState | None = None
        echo = self._prompt_texts(request, [rendered])[0] if request.echo else ""
        first = True
        async for delta in deltas:
            chunk, state = await self.derenderer.derender_completion_stream(
                self.served_name, self._stream_chunk(rendered, delta, index), state,
                prompt_tokens=len(rendered.token_ids), completion_request=request,
                prompt_token_ids=rendered.token_ids,
            )
            if echo and chunk.choices:  # the prompt leads the first chunk, as vLLM's server sends it
                chunk.choices[0].text, echo = echo + chunk.choices[0].text, ""
            if request.return_tokens_as_token_ids and chunk.choices:
                tokens_as_ids(chunk.choices[0].logprobs, delta.logprobs)
            if request.return_token_ids and chunk.choices:  # as vLLM's server: the prompt's ids in the first chunk
                chunk.choices[0].token_ids = list(delta.token_ids)
                chunk.choices[0].prompt_token_ids, first = (list(rendered.token_ids) if first else None), False
            yield chunk, delta

    @staticmethod
    def _choices(outputs: list[list[GenerateDelta]]) -> list[GenerateTokensChoice]:
        choices = []
        for index, deltas in enumerate(outputs):
            output = merged(deltas)
            choices.append(GenerateTokensChoice(index=index, token_ids=output.token_ids, logprobs=output.logprobs,
                                                finish_reason=output.finish_reason))
        return choices

    @staticmethod
    def _chat_echo(request: ChatCompletionRequest) -> str:
        """What a chat `echo` repeats, as vLLM does: the last message, when it has the role being answered."""
        if not request.echo or not request.messages:
            return ""
        last = request.messages[-1]
        role = "assistant" if request.add_generation_prompt else last.get("role")
        content = last.get("content")
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        return content if last.get("role") == role and isinstance(content, str) else ""

    def _decode(self, token_ids: list[int]) -> str:
        return self.renderer.renderer.get_tokenizer().decode(token_ids)

    def _prompt_texts(self, request: CompletionRequest, rendered: list[GenerateRequest]) -> list[str]:
        """What `echo` repeats: the prompts as sent when they are text, else their tokens decoded."""
        prompt = request.prompt
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            return list(prompt)
        return [self._decode(r.token_ids) for r in rendered]

    @staticmethod
    def _stream_chunk(rendered: GenerateRequest, delta: GenerateDelta, index: int) -> GenerateTokensStreamResponse:
        return GenerateTokensStreamResponse(
            request_id=rendered.request_id,
            choices=[GenerateTokensStreamChoice(index=index, token_ids=delta.token_ids, logprobs=delta.logprobs,
                                                finish_reason=delta.finish_reason if delta.finished else None)],
        )
