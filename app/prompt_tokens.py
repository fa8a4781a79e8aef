"""The tokens of a chat prompt whose beginning an earlier prompt already had, without tokenizing that beginning again.

A conversation's next prompt is its last prompt's text up to the generation prompt, then the reply and the new
message; tokenizing a 3k-token history again costs the ingress about 4 ms of CPU each turn (more than everything
else it does for the turn), on a machine whose cores the engines want.

Why reuse is exact: a fast (HF `tokenizers`) tokenizer first splits its input at the added tokens it finds (leftmost,
longest first), then normalizes, pre-tokenizes and encodes each piece between them on its own. So when a new text and
a cached one agree up to and including a special token that the tokenizer itself matched at character `b` in the
cached text, the new text's tokens are the cached tokens before that special token followed by the tokens of
`text[b:]` (which starts with that special token, so whatever the token does to the text after it happens there
too). That holds for special tokens that are matched before normalization, do not strip the text on their left and
are not part of a longer added token (`PromptTokenCache.usable` checks the tokenizer for this), and only for calls
that add no special tokens of their own and truncate nothing. The first `VERIFY_FIRST` reuses in each process are
also compared with a full tokenization; any difference turns reuse off for good and logs the texts' lengths.
"""

from __future__ import annotations

import logging
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("kvrelay.prompt_tokens")

# Tokens of cached prompts kept per process (about 4 bytes of ids and 4 of text each).
CAPACITY_TOKENS = 1_000_000
# Special tokens of a prompt under which a later prompt may find it, counted from its end: a next turn shares all
# but its last few (the generation prompt), a regenerated or edited turn one a little further back.
CUT_POINTS_KEPT = 32
# Reuses checked against a full tokenization when a process starts (then reuse is trusted).
VERIFY_FIRST = 32

Encode = Callable[[str], tuple[Sequence[int], Sequence[tuple[int, int]]]]


@dataclass
class _Prompt:
    text: str
    ids: array
    # (character, token index) of each special token the tokenizer matched, in order.
    cut_points: list[tuple[int, int]]
    keys: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    tokens_reused: int = 0
    tokens_encoded: int = 0
    verified: int = 0
    disabled_reason: str | None = None


class PromptTokenCache:
    """Recent prompts' tokens, found again by the text before one of their special tokens."""

    def __init__(self, tokenizer: Any, capacity_tokens: int = CAPACITY_TOKENS) -> None:
        self.capacity_tokens = capacity_tokens
        self.stats = CacheStats()
        self._lock = threading.Lock()
        self._prompts: OrderedDict[int, _Prompt] = OrderedDict()
        self._index: dict[tuple[int, int], int] = {}  # (character, hash of the text before it) -> prompt
        self._tokens = 0
        self._next_id = 0
        self.special: dict[int, str] = {}
        reason = self._check(tokenizer)
        if reason is not None:
            self.stats.disabled_reason = reason
            self._find = None
        else:
            contents = sorted(set(self.special.values()), key=len, reverse=True)
            self._find = re.compile("|".join(re.escape(c) for c in contents))

    @property
    def usable(self) -> bool:
        return self.stats.disabled_reason is None

    def _check(self, tokenizer: Any) -> str | None:
        """Why reuse would not be exact for this tokenizer (None: it is)."""
        backend = getattr(tokenizer, "_tokenizer", None)
        if backend is None or not getattr(tokenizer, "is_fast", False):
            return "not a fast tokenizer"
        if getattr(tokenizer, "split_special_tokens", False):
            return "the tokenizer does not split at special tokens"
        try:
            added = backend.get_added_tokens_decoder()
        except AttributeError:
            return "the tokenizer does not list its added tokens"
        contents = [token.content for token in added.values()]
        for token_id, token in added.items():
            if not token.special or token.normalized or token.lstrip or token.single_word or not token.content:
                continue
            if any(token.content in other and token.content != other for other in contents):
                continue  # part of a longer added token: a match of it depends on the text around it
            self.special[token_id] = token.content
        if not self.special:
            return "no special token to cut at"
        return None

    # ------------------------------------------------------------------------------------------------ tokens

    def tokens(self, text: str, encode: Encode) -> list[int]:
        """`text`'s token ids as `encode` would give them; `encode(s)` returns (ids, character offsets) of `s`
        tokenized on its own, with no special tokens added and no truncation."""
        if not self.usable:
            return list(encode(text)[0])
        found = self._lookup(text)
        if found is None:
            ids, offsets = encode(text)
            ids = list(ids)
            cut_points = self._cut_points(text, ids, offsets, 0, 0)
            keys: list[tuple[int, int]] = []
            with self._lock:
                self.stats.misses += 1
                self.stats.tokens_encoded += len(ids)
        else:
            prompt, cut, index = found
            tail_ids, tail_offsets = encode(text[cut:])
            ids = prompt.ids[:index].tolist() + list(tail_ids)
            cut_points = [p for p in prompt.cut_points if p[0] < cut]
            keys = [k for k in prompt.keys if k[0] < cut]  # the same text before them: the same keys
            cut_points += self._cut_points(text, tail_ids, tail_offsets, cut, index)
            full = self._mismatch(text, ids, encode)
            if full is not None:
                return full
            with self._lock:
                self.stats.hits += 1
                self.stats.tokens_reused += index
                self.stats.tokens_encoded += len(tail_ids)
        self._store(text, ids, cut_points, keys)
        return ids

    def _cut_points(
        self, text: str, ids: Sequence[int], offsets: Sequence[tuple[int, int]], shift: int, first: int
    ) -> list[tuple[int, int]]:
        """The special tokens the tokenizer matched in `text[shift:]` (tokenized as `ids`, `offsets`), as
        (character in `text`, token index counting from `first`)."""
        points = []
        for k, token_id in enumerate(ids):
            content = self.special.get(token_id)
            if content is None:
                continue
            start = offsets[k][0] + shift
            if text.startswith(content, start):
                points.append((start, first + k))
        return points

    def _lookup(self, text: str) -> tuple[_Prompt, int, int] | None:
        """The cached prompt that shares the longest beginning with `text`, cut at one of its special tokens:
        (prompt, character, token index of that special token)."""
        starts = [m.start() for m in self._find.finditer(text)]
        for cut in reversed(starts[-CUT_POINTS_KEPT:]):
            before = text[:cut]
            with self._lock:
                key = self._index.get((cut, hash(before)))
                prompt = self._prompts.get(key) if key is not None else None
                if prompt is None:
                    continue
                self._prompts.move_to_end(key)
            index = next((i for c, i in prompt.cut_points if c == cut), None)
            if (index is not None and prompt.text[:cut] == before
                    and text.startswith(self.special[prompt.ids[index]], cut)):
                return prompt, cut, index
        return None

    def _mismatch(self, text: str, ids: list[int], encode: Encode) -> list[int] | None:
        """A full tokenization of `text` if it differs from the reused `ids` (reuse is then turned off), else None.
        Only the first VERIFY_FIRST reuses of a process are checked; later ones are trusted."""
        with self._lock:
            if self.stats.verified >= VERIFY_FIRST:
                return None
        full = list(encode(text)[0])
        if full == ids:
            with self._lock:
                self.stats.verified += 1
            return None
        first = next((k for k, (a, b) in enumerate(zip(full, ids, strict=False)) if a != b), min(len(full), len(ids)))
        self.turn_off(f"a reused prefix gave other tokens than a full tokenization (prompt of {len(text)} characters, "
                      f"{len(full)} tokens; first difference at token {first})")
        logger.error("prompt token reuse turned off: %s", self.stats.disabled_reason)
        return full

    def turn_off(self, reason: str) -> None:
        """No reuse from now on in this process (every prompt is tokenized whole); the cached prompts are let go."""
        with self._lock:
            self.stats.disabled_reason = reason
            self._prompts.clear()
            self._index.clear()
            self._tokens = 0

    def _store(
        self, text: str, ids: list[int], cut_points: list[tuple[int, int]], keys: list[tuple[int, int]]
    ) -> None:
        """Keep a prompt, findable under its last CUT_POINTS_KEPT special tokens (`keys`: those already hashed)."""
        known = {cut for cut, _ in keys}
        keys = keys + [(cut, hash(text[:cut])) for cut, _ in cut_points[-CUT_POINTS_KEPT:] if cut not in known]
        prompt = _Prompt(text, array("l", ids), cut_points, keys[-CUT_POINTS_KEPT:])
        with self._lock:
            key = self._next_id
            self._next_id += 1
            for index_key in prompt.keys:
                self._index[index_key] = key
            self._prompts[key] = prompt
            self._tokens += len(ids)
            while self._tokens > self.capacity_tokens and len(self._prompts) > 1:
                old_key, old = self._prompts.popitem(last=False)
                self._tokens -= len(old.ids)
                for index_key in old.keys:
                    if self._index.get(index_key) == old_key:
                        del self._index[index_key]

    def public(self) -> dict[str, Any]:
        with self._lock:
            return {**self.stats.__dict__, "prompts": len(self._prompts), "tokens": self._tokens}


def reuse_prompt_tokens(renderer: Any) -> PromptTokenCache:
    """Route a vLLM renderer's prompt tokenization through a PromptTokenCache where reuse is exact: text prompts
    without multimodal data, tokenized with no special tokens added (chat prompts: the template writes them) and
    no character offsets asked for; a prompt longer than the truncation limit is tokenized as vLLM would, so
    vLLM truncates or refuses it. Every other call goes to vLLM's own `_tokenize_prompt` unchanged."""
    from vllm.utils.async_utils import make_async

    tokenizer = renderer.get_tokenizer()
    cache = PromptTokenCache(tokenizer)
    if not cache.usable:
        logger.info("prompt token reuse is off: %s", cache.stats.disabled_reason)
        return cache
    vllm_tokenize = renderer._tokenize_prompt

    def encode(text: str) -> tuple[list[int], list[tuple[int, int]]]:
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return encoding["input_ids"], encoding["offset_mapping"]

    def tokenize_prompt(prompt: Any, params: Any) -> Any:
        kwargs = params.get_encode_kwargs()
        if (kwargs.get("add_special_tokens") or renderer._wants_offsets(prompt, params)
                or prompt.get("multi_modal_data") or prompt.get("multi_modal_uuids") or not cache.usable):
            return vllm_tokenize(prompt, params)
        ids = cache.tokens(prompt["prompt"], encode)
        limit = kwargs.get("max_length") if kwargs.get("truncation") else None
        if limit is not None and len(ids) > limit:
            return vllm_tokenize(prompt, params)
        return renderer._build_tokens_prompt(ids, prompt)

    renderer._tokenize_prompt = tokenize_prompt
    # vLLM's async path wraps the method it had at construction: wrap ours the same way, on its executor.
    renderer._tokenize_prompt_async = make_async(tokenize_prompt, executor=renderer._executor)
    return cache
