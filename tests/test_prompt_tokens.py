"""Reusing an earlier prompt's tokens gives exactly the tokens a full tokenization gives.

Real tokenizers: the default model's (byte-level BPE, as SmolLM2 ships it) and SentencePiece-style ones built here
with the `tokenizers` library (Metaspace with a prefix space on the first piece only, an NFKC normalizer, special
tokens that strip the text beside them), since the model hub cannot be reached. Conversations grow turn by turn,
are edited and regenerated, and carry text that looks like special tokens, so that every kind of cut is exercised.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

import app.prompt_tokens as prompt_tokens
from app.prompt_tokens import PromptTokenCache
from model_prep.store import ensure_model

WORDS = ("the of and to in is was for on that with as by at from it an be this are or have café naïve ﬁle "
         "Ｆｕｌｌ 東京 😀 \t tab  two-spaces\n newline <|im_ <|im_end <im_end|> end|> <s").split(" ")


def text(rng: random.Random, n: int) -> str:
    words = [rng.choice(WORDS) for _ in range(n)]
    if rng.random() < 0.2:
        words.insert(rng.randrange(len(words) + 1), rng.choice(["<|im_end|>", "<|im_start|>", "</s>", "<end>"]))
    return (" " if rng.random() < 0.3 else "") + " ".join(words) + (" \n" if rng.random() < 0.3 else "")


def chatml(messages: list[dict[str, str]]) -> str:
    body = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return "<s>" + body + "<|im_start|>assistant\n"


def sentencepiece_like(strip_right: bool, strip_left: bool) -> PreTrainedTokenizerFast:
    """A Metaspace tokenizer trained here; special tokens as Llama-2/Gemma-style tokenizers have them."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    rng = random.Random(0)
    corpus = [text(rng, 40) for _ in range(300)]
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>"]))
    tokenizer.add_special_tokens([
        AddedToken("<s>", special=True, normalized=False),
        AddedToken("</s>", special=True, normalized=False),
        AddedToken("<|im_start|>", special=True, normalized=False, lstrip=strip_left),
        AddedToken("<|im_end|>", special=True, normalized=False, rstrip=strip_right),
        AddedToken("<end>", special=True, normalized=False, rstrip=True, lstrip=True),
    ])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def default_model_tokenizer():
    return AutoTokenizer.from_pretrained(ensure_model("smollm2-135m-instruct", progress=lambda _msg: None))


def render_for(tokenizer):
    if getattr(tokenizer, "chat_template", None):
        return lambda messages: tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return chatml


def encode_with(tokenizer):
    def encode(s: str):
        encoding = tokenizer(s, add_special_tokens=False, return_offsets_mapping=True)
        return encoding["input_ids"], encoding["offset_mapping"]
    return encode


def conversations(rng: random.Random, render, count: int, turns: int):
    """Prompts as clients send them: growing histories, some turns regenerated (the same prompt again) or edited
    (an earlier message changed), several conversations interleaved."""
    histories = [[{"role": "system", "content": "You are kind." + text(rng, 30)}] for _ in range(count)]
    for _ in range(turns):
        for history in histories:
            history.append({"role": "user", "content": text(rng, rng.randrange(1, 60))})
            yield render(history)
            if rng.random() < 0.2:
                yield render(history)  # regenerated
            if rng.random() < 0.15 and len(history) > 2:
                edited = [dict(m) for m in history]
                edited[rng.randrange(1, len(edited))]["content"] = text(rng, 10)
                yield render(edited)
            history.append({"role": "assistant", "content": text(rng, rng.randrange(1, 80))})


@pytest.mark.parametrize("which", ["default_model", "sentencepiece", "sentencepiece_rstrip", "sentencepiece_lstrip"])
def test_reused_tokens_equal_a_full_tokenization(which: str, monkeypatch) -> None:
    tokenizer = {
        "default_model": default_model_tokenizer,
        "sentencepiece": lambda: sentencepiece_like(strip_right=False, strip_left=False),
        "sentencepiece_rstrip": lambda: sentencepiece_like(strip_right=True, strip_left=False),
        "sentencepiece_lstrip": lambda: sentencepiece_like(strip_right=False, strip_left=True),
    }[which]()
    monkeypatch.setattr(prompt_tokens, "VERIFY_FIRST", 0)  # the comparison here is the test's own, every prompt
    cache = PromptTokenCache(tokenizer, capacity_tokens=20_000)
    assert cache.usable, cache.stats.disabled_reason
    if which == "sentencepiece_lstrip":
        assert "<|im_start|>" not in cache.special.values()  # it strips the text before it: never a cut
    assert "<end>" not in cache.special.values()
    encode = encode_with(tokenizer)
    rng = random.Random(which)
    prompts = longest = 0
    for prompt in conversations(rng, render_for(tokenizer), count=4, turns=6):
        full = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert cache.tokens(prompt, encode) == full, prompt
        prompts, longest = prompts + 1, max(longest, len(full))
    stats = cache.public()
    assert stats["hits"] >= prompts // 2, stats
    assert stats["tokens_reused"] > stats["tokens_encoded"], stats  # most of every later turn is reused
    assert stats["tokens"] <= 20_000 + longest  # the oldest prompts were let go


def test_a_tokenizer_that_does_not_split_at_special_tokens_is_never_reused() -> None:
    tokenizer = default_model_tokenizer()
    tokenizer.split_special_tokens = True
    cache = PromptTokenCache(tokenizer)
    assert not cache.usable
    prompt = render_for(tokenizer)([{"role": "user", "content": "hi"}])
    assert cache.tokens(prompt, encode_with(tokenizer)) == tokenizer(prompt, add_special_tokens=False)["input_ids"]


def test_a_reuse_that_differs_from_a_full_tokenization_turns_reuse_off() -> None:
    tokenizer = default_model_tokenizer()
    cache = PromptTokenCache(tokenizer)
    render = render_for(tokenizer)
    history = [{"role": "user", "content": "hello there"}]
    honest = encode_with(tokenizer)
    cache.tokens(render(history), honest)
    history += [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "more"}]

    def lying(s: str):  # tokenizes the tail wrongly: the check against a full tokenization must catch it
        ids, offsets = honest(s)
        return (ids if len(s) == len(render(history)) else [*ids[:-1], ids[-1] + 1]), offsets

    assert cache.tokens(render(history), lying) == honest(render(history))[0]
    assert not cache.usable and "other tokens" in cache.stats.disabled_reason
    assert cache.public()["prompts"] == 0


def test_vllm_renderer_tokenizes_chats_through_the_cache() -> None:
    """The ingress's front end (vLLM's renderer) gives the full tokenization's tokens, and reuses the history's."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    from app.frontend import Frontend
    from configs.app import OpenAISettings

    model_dir = ensure_model("smollm2-135m-instruct", progress=lambda _msg: None)
    frontend = Frontend(model_dir, "m", 4096, OpenAISettings())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(1)
    messages = [{"role": "system", "content": text(rng, 300)}]

    async def turns() -> None:
        for _ in range(4):
            messages.append({"role": "user", "content": text(rng, 20)})
            request = ChatCompletionRequest.model_validate({"model": "m", "messages": messages, "max_tokens": 4})
            rendered = await frontend.render_chat(request)
            full = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            assert list(rendered.token_ids) == tokenizer(full, add_special_tokens=False)["input_ids"]
            messages.append({"role": "assistant", "content": text(rng, 30)})

    asyncio.run(turns())
    stats = frontend.prompt_tokens.public()
    assert stats["misses"] == 1 and stats["hits"] == 3, stats
    assert stats["disabled_reason"] is None
