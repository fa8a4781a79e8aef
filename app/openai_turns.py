"""OpenAI requests as turns: a chat or completion request becomes one `Turn` per prompt and choice, rendered by
vLLM's own front end (`app/frontend.py`), and the turns' deltas become vLLM's OpenAI response or stream chunks,
each with the `kvrelay` object saying how its turn was served. HTTP and the Python handle API both use it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest as RenderedRequest

from actors.replica_api import GenerateDelta
from app.auth import hashed
from app.frontend import Frontend, OpenAIRequest, usage
from app.responses import ClientError, now
from app.turn_types import Turn, TurnOutcome
from kvtransfer.policies import PlacementPolicy, get_policy, policy_names

# A turn's deltas, each with the turn's outcome, as the deployment runs it (`Ingress._run`: admission first).
TurnDeltas = AsyncIterator[tuple[GenerateDelta, TurnOutcome]]
RunTurn = Callable[[Turn], TurnDeltas]


@dataclass
class Choice:
    """One choice of an OpenAI response: a turn on one rendered prompt, numbered as the response numbers it."""

    rendered: RenderedRequest
    turn: Turn
    index: int


def with_kvrelay(body: BaseModel, outcome: TurnOutcome) -> dict[str, Any]:
    """An OpenAI body as JSON-ready dict, with the `kvrelay` object saying how its turn was served."""
    return {**body.model_dump(mode="json"), "kvrelay": outcome.public()}


def requested_policy(requested: str | None, default: PlacementPolicy) -> PlacementPolicy:
    """The deployment's policy, or the one a request names (`x-kvrelay-policy`, for side-by-side benchmarks)."""
    if requested is None:
        return default
    try:
        return get_policy(requested)
    except ValueError:
        raise ClientError(400, f"unknown placement policy {requested!r}; known: {policy_names()}",
                          param="x-kvrelay-policy") from None


def check_room(rendered: RenderedRequest, max_model_len: int) -> None:
    """Refuse (400) a prompt whose `max_tokens` do not fit in the model's context after it."""
    room = max_model_len - len(rendered.token_ids)
    asked = rendered.sampling_params.max_tokens or 1
    if room < 1 or asked > room:
        raise ClientError(
            400,
            f"this model's context is {max_model_len} tokens, but the prompt has {len(rendered.token_ids)} "
            f"tokens and max_tokens asks for {asked} more; shorten the prompt or lower max_tokens",
            param="max_tokens" if room >= 1 else "messages", code="context_length_exceeded",
        )


async def collect(deltas: TurnDeltas) -> tuple[list[GenerateDelta], TurnOutcome]:
    """A whole turn: all its deltas, and its outcome."""
    items = [item async for item in deltas]
    return [delta for delta, _ in items], items[-1][1]


class OpenAITurns:
    """One deployment's mapping between OpenAI requests and turns. It renders with `frontend` and runs every turn
    through `run`; it keeps no state of its own, so concurrent requests may share it."""

    def __init__(
        self, frontend: Frontend, model: str, max_model_len: int, fast_prefill: bool, policy: PlacementPolicy,
        run: RunTurn,
    ) -> None:
        self.frontend = frontend
        self.model = model
        self.max_model_len = max_model_len
        # A KV-sharing fast prefill skips prompt positions in its shared layers: no prompt logprobs there.
        self.fast_prefill = fast_prefill
        self.policy = policy
        self.run = run

    async def turns(
        self, req: OpenAIRequest, tenant: str, session_id: str | None, policy: str | None
    ) -> list[list[Choice]]:
        """Render the request with vLLM's front end; per prompt (a completion may batch several), its `n` choices,
        each a turn of its own."""
        if req.kv_transfer_params is not None:
            raise ClientError(400, "kv_transfer_params cannot be set by clients: kvrelay plans KV reuse itself and "
                              "never lets a request name KV blocks", param="kv_transfer_params")
        if req.prompt_logprobs is not None and self.fast_prefill:
            raise ClientError(400, "prompt_logprobs cannot be served by this deployment: it runs KV-sharing fast "
                              "prefill, whose shared layers skip prompt positions; drop prompt_logprobs",
                              param="prompt_logprobs")
        if isinstance(req, ChatCompletionRequest):
            rendered = [await self.frontend.render_chat(req)]
        else:
            rendered = await self.frontend.render_completion(req)
        if req.cache_salt:  # the client's own isolation within its tenant
            tenant = hashed(f"{tenant}/{req.cache_salt}")
        session_id = session_id or req.session_id
        prompts = []
        for r in rendered:
            check_room(r, self.max_model_len)
            choices = []
            for index in range(req.n):
                params = r.sampling_params.clone()
                params.n = 1
                if params.seed is not None and index:  # n samples, as different as vLLM's n from one seed
                    params.seed = (params.seed + index) % 2**63
                turn = Turn(request_id=f"{r.request_id}-{index}" if req.n > 1 else r.request_id,
                            token_ids=list(r.token_ids), params=params, tenant=tenant, session_id=session_id,
                            policy=requested_policy(policy, self.policy), priority=r.priority)
                choices.append(Choice(r, turn, len(prompts) * req.n + index))
            prompts.append(choices)
        return prompts

    async def respond(self, req: OpenAIRequest, prompts: list[list[Choice]]) -> tuple[BaseModel, TurnOutcome]:
        """The whole (non-streaming) response, and the first turn's outcome."""
        turns = [c.turn for choices in prompts for c in choices]
        if len(turns) == 1:  # most requests: no task of its own (gather's costs a loop turn before the response)
            results = [await collect(self.run(turns[0]))]
        else:
            results = await asyncio.gather(*(collect(self.run(turn)) for turn in turns))
        outcome = results[0][1]
        outputs, at = [], 0
        for choices in prompts:
            outputs.append([deltas for deltas, _ in results[at:at + len(choices)]])
            at += len(choices)
        if isinstance(req, ChatCompletionRequest):
            body = await self.frontend.chat_response(req, prompts[0][0].rendered, outputs[0])
        else:
            body = await self.frontend.completion_response(req, [choices[0].rendered for choices in prompts], outputs)
        return body, outcome

    async def stream(
        self, req: OpenAIRequest, prompts: list[list[Choice]]
    ) -> AsyncIterator[tuple[dict[str, Any], TurnOutcome]]:
        """The stream's chunk dicts, choice after choice; the chunk that finishes a turn, and the usage chunk,
        carry its `kvrelay`."""
        chat = isinstance(req, ChatCompletionRequest)
        chunks = self.frontend.chat_chunks if chat else self.frontend.completion_chunks
        outputs: list[list[list[GenerateDelta]]] = []
        for choices in prompts:
            outputs.append([])
            for choice in choices:
                outcome: list[TurnOutcome] = []
                deltas = self._deltas(choice.turn, outcome)
                async for chunk, delta in chunks(req, choice.rendered, choice.index, deltas):
                    body = chunk.model_dump(mode="json")
                    if delta.finished:
                        body["kvrelay"] = outcome[0].public()
                        outputs[-1].append([delta])
                    yield body, outcome[0]
        if req.stream_options and req.stream_options.include_usage:
            yield {"id": prompts[0][0].rendered.request_id, "object": "chat.completion.chunk" if chat else
                   "text_completion", "created": now(), "model": self.model, "choices": [],
                   "usage": usage(outputs).model_dump(mode="json"), "kvrelay": outcome[0].public()}, outcome[0]

    async def _deltas(self, turn: Turn, outcome: list[TurnOutcome]) -> AsyncIterator[GenerateDelta]:
        """The turn's deltas; its outcome lands in `outcome` with the first one."""
        async for delta, turn_outcome in self.run(turn):
            if not outcome:
                outcome.append(turn_outcome)
            yield delta
