"""The multi-turn benchmark's workload: its config (`BenchConfig`, the JSON files in benchmarks/configs/) and the
conversations it sends, synthetic or read from a ShareGPT-style file.

Synthetic conversations take the shape of vLLM's benchmarks/multi_turn: a system prefix shared by all, a prefix of
each conversation's own (the document it is about), then turns whose user and output token counts are drawn from
distributions.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

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

