"""The tiny test models' tokenizer: a byte-level BPE trained in seconds on pseudo-English built in code, with a
prefix-stable chat template."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from model_prep.hf_folder import save_tokenizer

# Special tokens of the locally trained tokenizer; their ids are fixed by this order.
TINY_PAD, TINY_BOS, TINY_EOS = "<|pad|>", "<|bos|>", "<|eos|>"
TINY_ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
TINY_SPECIAL_TOKENS = (TINY_PAD, TINY_BOS, TINY_EOS, *TINY_ROLE_TOKENS)
TINY_VOCAB_SIZE = 2048
# Every turn ends with eos so generation stops where the next turn's rendering continues (prefix-stable).
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

_WORDS = (
    "the a an of to and in is was for on that with as it by at from this be are or have has had not but "
    "what which who when where why how all can will would should could may might must one two three four "
    "five six seven eight nine ten first last next new old good great small large long short high low "
    "time year day week month hour minute second people world country city river mountain sea island "
    "capital paris france berlin germany rome italy madrid spain london england tokyo japan ottawa canada "
    "model token cache memory prefix prompt request replica engine server cluster router transfer layer "
    "attention key value block batch decode prefill latency throughput queue worker node network bandwidth "
    "python rust code function class object list dict string number value error test build install run "
    "question answer reply user assistant system message turn chat conversation history context window "
    "water fire earth air light dark sun moon star tree flower bird fish dog cat horse house door road "
    "book page letter word sentence story song music color red green blue yellow black white bright "
    "happy sad quick slow warm cold hot early late near far inside outside above below before after "
    "make take give find think know see look come go say tell ask help need want use work call try "
    "because however therefore although while until unless since whether again also only just very"
).split()

_TEMPLATES = (
    "What is the capital of {Country}? The capital of {Country} is {City}.",
    "The {noun} {verb}s the {adj} {noun2} {prep} the {noun3}.",
    "{Noun} and {noun2} are {adj}, but the {noun3} is {adj2}.",
    "Can you {verb} the {noun} {prep} {num} {noun2}s? Yes, I can {verb} it.",
    "In {num}, {num2} {noun}s {verb}ed {prep} {City}.",
    "def {noun}_{noun2}(x, y):\n    return x * {num} + y\n",
    "User: {Verb} me a {adj} {noun}.\nAssistant: Here is a {adj2} {noun}: {noun2}, {noun3}.",
    "{Noun}s per second: {num}.{num2}; {noun2} latency: {num2} ms ({adj}).",
    "Q: Why is the {noun} {adj}?\nA: Because the {noun2} {verb}s {prep} it!",
    '{"{noun}": {num}, "{noun2}": "{adj}", "{noun3}": [{num2}, {num}]}',
)

_PLACES = (
    ("France", "Paris"),
    ("Germany", "Berlin"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("England", "London"),
    ("Japan", "Tokyo"),
    ("Canada", "Ottawa"),
)


def corpus_text(seed: int = 0, sentences: int = 1500) -> str:
    """Deterministic pseudo-English training text for the tiny tokenizer (tens of KB, built in code)."""
    rng = random.Random(seed)
    nouns = [w for w in _WORDS if len(w) > 3]
    lines = []
    for _ in range(sentences):
        country, city = rng.choice(_PLACES)
        words = {
            "noun": rng.choice(nouns),
            "noun2": rng.choice(nouns),
            "noun3": rng.choice(nouns),
            "verb": rng.choice(_WORDS[:120]),
            "adj": rng.choice(_WORDS),
            "adj2": rng.choice(_WORDS),
            "prep": rng.choice(("in", "on", "at", "from", "with", "above", "below", "before", "after")),
            "num": str(rng.randint(0, 2048)),
            "num2": str(rng.randint(0, 99)),
            "Country": country,
            "City": city,
        }
        words["Noun"] = words["noun"].capitalize()
        words["Verb"] = words["verb"].capitalize()
        text = rng.choice(_TEMPLATES)
        for key in sorted(words, key=len, reverse=True):
            text = text.replace("{" + key + "}", words[key])
        lines.append(text)
    return "\n".join(lines) + "\n"


def build_tokenizer(out: Path, max_len: int, vocab_size: int = TINY_VOCAB_SIZE) -> Any:
    """Train a byte-level BPE on `corpus_text()` and save it as an HF tokenizer (with chat template) in `out`.

    The BPE trainer breaks count ties deterministically, so one fixed text gives the same bytes every build.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(TINY_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_text().splitlines(keepends=True), trainer=trainer)
    bos_id = tok.token_to_id(TINY_BOS)
    # Plain completions get BOS like Llama; the chat template writes BOS itself (no specials added).
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{TINY_BOS} $A",
                pair=f"{TINY_BOS} $A {TINY_BOS} $B",
                special_tokens=[(TINY_BOS, bos_id)],
            ),
        ]
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=TINY_BOS,
        eos_token=TINY_EOS,
        pad_token=TINY_PAD,
        additional_special_tokens=list(TINY_ROLE_TOKENS),
        chat_template=TINY_CHAT_TEMPLATE,
        model_max_length=max_len,
        padding_side="left",
    )
    save_tokenizer(hf_tok, out, max_len)
    return hf_tok
